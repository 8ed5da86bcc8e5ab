"""Teacher-forced training data: target forwards over given text, no decoding (see specdec.train.data).

Two corpora, one builder (`build_corpus_dataset`) and one shard format:

* text files (`specdec train data --corpus FILES`): cut into `chunk_tokens` pieces, each put in an
  assistant turn after `instruction`; one batched forward per group of equal-length chunks;
* conversations (`--conversations sharegpt`, or a ShareGPT-format JSON file; specdec.train.sharegpt):
  the target's chat template over the whole conversation, cut at `max_length` tokens, ONE prefill
  per conversation run in pieces of `chunk_tokens` through the KV cache (each piece sees everything
  before it, so the rows are those of one forward; the pieces bound the [tokens, vocab] logits).
  Every position's label is the target's own top-1 (never the conversation's next token), and the
  shard marks the assistant tokens: the loss only uses labels that are assistant tokens, so the
  drafter learns to draft what this target would write in replies, never the users' turns.
  Each conversation's held-out side is fixed by its first user turn (sharegpt.is_held_out).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..checks import check_positive_int
from ..files import check_output_dir, open_output_dir
from ..heads import check_target_matches
from . import sharegpt
from .data import (MANIFEST_FILE, TEACHER_FORCED, Sample, _fill_shards, _new_manifest, _write_json_atomic, read_manifest,
                   resolve_layers)

TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
NOT_STATED = "not stated (--corpus-licence records it; specdec does not check it)"  # a source's licence when not given
# settings.licence as manifests before 2026-12 wrote it when none was given (also for ShareGPT from the
# package, whose own licence is in its source record): read as "" so those directories still resume
_OLD_UNSTATED_LICENCE = "the licence of the given files (not checked by specdec)"
MIN_CHUNK_TOKENS = 16  # a file's last piece shorter than this is dropped


@dataclass
class CorpusSettings:
    """What `build_corpus_dataset` makes (recorded in the manifest and checked on resume)."""

    chunk_tokens: int = 256  # corpus tokens per sample (the answer part); conversations: tokens per forward
    max_chunks: int | None = None  # keep this many chunks / conversations (after a seeded shuffle); None = all
    layers: list[int] | None = None  # as DataSettings.layers
    instruction: str = "Continue the following text."  # the user turn the chunk answers
    shard_size: int = 64  # chunks per shard
    batch_size: int = 8  # chunks per target forward
    seed: int = 0
    licence: str = ""  # the text files' (or a conversations file's) licence as the user states it; "" = not stated
    corpus_digest: str = ""  # sha256 of the samples' token ids (filled in by build_corpus_dataset)
    conversations: str = ""  # "sharegpt" or a ShareGPT-format JSON file: conversations instead of text files
    max_length: int = 2048  # conversations: tokens kept of each (the rest is cut off)

    def validate(self, target) -> None:
        optional = ("max_chunks",) if self.max_chunks is not None else ()
        for name in ("chunk_tokens", "shard_size", "batch_size", "max_length", *optional):
            check_positive_int(name, getattr(self, name))
        for name in ("chunk_tokens", "max_length"):
            if getattr(self, name) < MIN_CHUNK_TOKENS:
                raise ValueError(f"{name} must be >= {MIN_CHUNK_TOKENS}, got {getattr(self, name)}")
        self.layers = resolve_layers(self.layers, target)
        if self.conversations:
            target.check_fits(self.max_length - 1, 1)  # the longest conversation kept is one prefill
            return
        if not self.instruction.strip():
            raise ValueError("the instruction (the user turn before each chunk) must not be empty")
        target.check_fits(len(target.encode_prompt(self.instruction)), self.chunk_tokens)  # one sample = one forward


def corpus_files(paths: list[str | Path]) -> list[Path]:
    """The text files named by `paths` (directories: every *.py/*.txt/*.md/*.rst below, sorted)."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files.extend(sorted(f for f in path.rglob("*") if f.is_file() and f.suffix in TEXT_SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"corpus path {raw} does not exist")
    if not files:
        raise ValueError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {', '.join(map(str, paths))}")
    return files


def corpus_chunks(tokenizer, files: list[Path], settings: CorpusSettings) -> list[list[int]]:
    """Every file tokenised (no special tokens) and cut into `chunk_tokens` pieces, shuffled by the
    seed (so the first shards already mix many files), at most `max_chunks` of them."""
    chunks: list[list[int]] = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary or unreadable: not text for this purpose
        ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text.strip() else []
        chunks.extend(ids[i : i + settings.chunk_tokens] for i in range(0, len(ids), settings.chunk_tokens))
    chunks = [chunk for chunk in chunks if len(chunk) >= MIN_CHUNK_TOKENS]
    random.Random(settings.seed).shuffle(chunks)
    if settings.max_chunks is not None:
        chunks = chunks[: settings.max_chunks]
    if not chunks:
        raise ValueError(f"the corpus has no piece of at least {MIN_CHUNK_TOKENS} tokens")
    return chunks


def _corpus_digest(chunks: list[list[int]]) -> str:
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(torch.tensor(chunk, dtype=torch.int32).numpy().tobytes())
        digest.update(b"|")
    return digest.hexdigest()


def _teacher_forced_shard(target, prompt_ids: list[int], chunks: list[list[int]], settings: CorpusSettings) -> list[Sample]:
    """prompt + chunk for every chunk, run through the target in batches of equal length (no padding)."""
    samples: dict[int, Sample] = {}
    by_length: dict[int, list[int]] = {}
    for index, chunk in enumerate(chunks):
        by_length.setdefault(len(chunk), []).append(index)
    for indices in by_length.values():
        for start in range(0, len(indices), settings.batch_size):
            group = indices[start : start + settings.batch_size]
            tokens = torch.tensor([prompt_ids + chunks[i] for i in group], dtype=torch.long)  # [B, T]
            batch, length = tokens.shape
            cache = target.new_cache(batch, length)
            positions = torch.arange(length)[None].expand(batch, length)  # [B, T]
            with torch.inference_mode():
                logits, hiddens = target.forward(tokens, positions, cache, hidden_layers=tuple(settings.layers))
            next_ids = logits.argmax(-1).cpu()  # [B, T]
            for row, index in enumerate(group):
                hidden = {layer: hiddens[layer][row].to("cpu", torch.float16) for layer in settings.layers}  # {layer: [T, H]}
                samples[index] = Sample(tokens[row], hidden, len(prompt_ids), next_ids[row], teacher_forced=True)
    return [samples[index] for index in range(len(chunks))]



class TextCorpus:
    """Text files cut into chunks (`corpus_chunks`), each answering the instruction."""

    unit = "chunk"
    generated_text_licence = "no generated text: the answers are the corpus files' own text"

    def __init__(self, target, paths: list[str | Path], settings: CorpusSettings):
        self.target, self.settings, self.paths = target, settings, paths
        self.files = corpus_files(paths)
        self.chunks = corpus_chunks(target.tokenizer, self.files, settings)
        self.prompt_ids = target.encode_prompt(settings.instruction)

    def __len__(self) -> int:
        return len(self.chunks)

    def digest(self) -> str:
        return _corpus_digest(self.chunks)

    def sources(self) -> dict:
        roots = sorted({str(Path(p).resolve() if Path(p).is_dir() else Path(p).resolve().parent) for p in self.paths})
        return {"corpus": {"description": f"{len(self.files)} text files under {', '.join(roots)}, teacher-forced",
                           "licence": self.settings.licence or NOT_STATED, "chunks": len(self.chunks)}}

    def describe(self) -> tuple[str, int]:
        tokens = sum(len(chunk) + len(self.prompt_ids) for chunk in self.chunks)
        return (f"{len(self.chunks)} chunks of <= {self.settings.chunk_tokens} tokens from {len(self.files)} files "
                f"({tokens} tokens with the instruction)"), tokens

    def make_shard(self, indices: list[int]) -> tuple[list[Sample], list[bool]]:
        chunks = [self.chunks[i] for i in indices]
        return _teacher_forced_shard(self.target, self.prompt_ids, chunks, self.settings), [False] * len(indices)


# ----------------------------------------------------------------------------- conversations
CONVERSATIONS_SOURCE = "sharegpt-conversations"  # the samples' source (per-source evaluation; manifest "sources")


def conversation_tokens(tokenizer, messages: list[dict], max_length: int) -> tuple[list[int], list[bool]] | None:
    """(token ids of the conversation under the chat template, cut at max_length; per token: part of
    an assistant reply), or None when the template does not render the conversation's prefixes as
    prefixes of the whole (then no span is sure).

    An assistant reply spans from the end of the template over the turns before it with the
    generation prompt to the end of the template over the turns up to it (its end-of-turn marker
    included: the drafter must learn where the target stops)."""
    def render(turns, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(list(turns), tokenize=False, add_generation_prompt=generation_prompt)

    text = render(messages, False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if not (text.startswith(before) and text.startswith(through)):
            return None
        spans.append((len(before), len(through)))
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoding["input_ids"][:max_length], encoding["offset_mapping"][:max_length]
    return list(ids), [any(start <= first < end for start, end in spans) for first, _ in offsets]


class ConversationCorpus:
    """ShareGPT conversations (both sides of the split, each sample flagged), shuffled by the seed."""

    unit = "conversation"
    generated_text_licence = ("no generated text in the samples' tokens (the conversations' own text); the labels are "
                              "the target's predictions: its licence applies to them")

    def __init__(self, target, settings: CorpusSettings):
        if not getattr(target.tokenizer, "is_fast", False) or not getattr(target.tokenizer, "chat_template", None):
            raise ValueError("teacher-forced conversations need a target with a chat template and a fast tokenizer "
                             "(token offsets mark the assistant replies)")
        self.target, self.settings = target, settings
        conversations, self.stats = sharegpt.load_conversations(settings.conversations)
        order = list(range(len(conversations)))
        random.Random(settings.seed).shuffle(order)
        self.conversations, self.tokens, self.assistant = [], [], []
        self.skipped = {"template": 0, "no_reply_within_max_length": 0}
        for index in order:  # tokenised up front: the shards' contents, and their digest, are fixed before any is written
            if settings.max_chunks is not None and len(self.conversations) >= settings.max_chunks:
                break
            encoded = conversation_tokens(target.tokenizer, list(conversations[index].messages), settings.max_length)
            if encoded is None or not any(encoded[1][1:]):  # no label to learn before the cut
                self.skipped["template" if encoded is None else "no_reply_within_max_length"] += 1
                continue
            self.conversations.append(conversations[index])
            self.tokens.append(torch.tensor(encoded[0], dtype=torch.int32))  # [T]
            self.assistant.append(torch.tensor(encoded[1], dtype=torch.bool))  # [T]
        if not self.conversations:
            raise ValueError(f"no usable conversation in {settings.conversations} ({self.stats.describe()})")

    def __len__(self) -> int:
        return len(self.conversations)

    def digest(self) -> str:
        digest = hashlib.sha256()
        for tokens, assistant in zip(self.tokens, self.assistant):
            digest.update(tokens.numpy().tobytes() + assistant.numpy().tobytes() + b"|")
        return digest.hexdigest()

    def sources(self) -> dict:
        held_out = sum(sharegpt.is_held_out(c.first_user_turn) for c in self.conversations)
        from_package = self.settings.conversations == sharegpt.SOURCE_NAME
        return {CONVERSATIONS_SOURCE: {
            "description": (f"ShareGPT V3 conversations ({sharegpt.PACKAGE} {sharegpt.PACKAGE_VERSION})" if from_package
                            else f"ShareGPT-format conversations from {Path(self.settings.conversations).resolve()}")
                           + f", teacher-forced under the target's chat template, cut at {self.settings.max_length} tokens",
            "licence": sharegpt.package_licence() if from_package else self.settings.licence or NOT_STATED,
            "conversations": len(self.conversations), "held_out_conversations": held_out,
            "held_out_rule": f"sha256 of the first user turn: {sharegpt.HELD_OUT_FRACTION:.0%} held out",
            "skipped": self.skipped, "read": asdict(self.stats)}}

    def describe(self) -> tuple[str, int]:
        tokens = sum(len(t) for t in self.tokens)
        return (f"{self.stats.describe()}; {len(self)} conversations used (left out: {self.skipped['template']} the "
                f"template cannot split, {self.skipped['no_reply_within_max_length']} with no reply within max_length), "
                f"{tokens} tokens, {sum(int(a.sum()) for a in self.assistant)} of them assistant tokens"), tokens

    def make_shard(self, indices: list[int]) -> tuple[list[Sample], list[bool]]:
        return [self._sample(i) for i in indices], [False] * len(indices)

    def _sample(self, index: int) -> Sample:
        """One prefill over the conversation, in pieces of chunk_tokens through the KV cache."""
        tokens, assistant = self.tokens[index].long(), self.assistant[index]  # [T], [T]
        layers = tuple(self.settings.layers)
        cache = self.target.new_cache(1, len(tokens))
        next_ids, hidden = [], {layer: [] for layer in layers}
        with torch.inference_mode():
            for start in range(0, len(tokens), self.settings.chunk_tokens):
                piece = tokens[None, start : start + self.settings.chunk_tokens]  # [1, C]
                positions = torch.arange(start, start + piece.shape[1])[None]  # [1, C]
                logits, hiddens = self.target.forward(piece, positions, cache, hidden_layers=layers)  # [1, C, V]
                next_ids.append(logits[0].argmax(-1).cpu())  # [C]
                for layer in layers:
                    hidden[layer].append(hiddens[layer][0].to("cpu", torch.float16))  # [C, H]
        first_reply = int(assistant.nonzero()[0])
        return Sample(tokens, {layer: torch.cat(rows) for layer, rows in hidden.items()}, first_reply, torch.cat(next_ids),
                      teacher_forced=True, source=CONVERSATIONS_SOURCE, supervised=assistant,
                      held_out=sharegpt.is_held_out(self.conversations[index].first_user_turn))


# ----------------------------------------------------------------------------- the builder
def _open_manifest(target, out_dir: Path, settings: CorpusSettings, corpus) -> dict:
    """The directory's manifest (checked: same kind, corpus and settings), or a new one."""
    num_shards = -(-len(corpus) // settings.shard_size)
    if (out_dir / MANIFEST_FILE).exists():
        manifest = read_manifest(out_dir)
        check_target_matches(manifest, target, f"data in {out_dir}")
        if manifest["settings"].get("licence") == _OLD_UNSTATED_LICENCE:
            manifest["settings"]["licence"] = ""  # rewritten so with the next finished shard
        if manifest["kind"] != TEACHER_FORCED or manifest["settings"] != asdict(settings):
            raise ValueError(
                f"{out_dir} already holds other data (another kind, corpus or settings); rerun with the same files and "
                "settings to resume, or choose a new --out"
            )
        return manifest
    open_output_dir(out_dir, "training-data")
    manifest = _new_manifest(target, settings, TEACHER_FORCED, corpus.sources(), corpus.generated_text_licence,
                             len(corpus), num_shards)
    manifest["corpus_source"] = next(iter(manifest["sources"]))  # the samples' source name (per-source evaluation)
    _write_json_atomic(out_dir / MANIFEST_FILE, manifest)
    return manifest


def build_corpus_dataset(
    target,
    out_dir: str | Path,
    paths: list[str | Path] | None,
    settings: CorpusSettings | None = None,
    progress: bool = True,
    stop_after_shards: int | None = None,
    log=print,
) -> dict:
    """Teacher-forced data in `out_dir` (or resume it) from text files `paths`, or from the
    conversations `settings.conversations` names (then `paths` must be empty); returns the manifest."""
    settings = settings or CorpusSettings()
    if bool(paths) == bool(settings.conversations):
        raise ValueError("teacher-forced data comes from text files (--corpus) or conversations (--conversations): "
                         "give exactly one")
    settings.validate(target)
    out_dir = check_output_dir(out_dir, "training-data")
    corpus = ConversationCorpus(target, settings) if settings.conversations else TextCorpus(target, paths, settings)
    settings.corpus_digest = corpus.digest()
    manifest = _open_manifest(target, out_dir, settings, corpus)
    description, tokens = corpus.describe()
    log(f"teacher-forced data: {description}, layers {settings.layers}: about "
        f"{tokens * (2 * target.hidden_size * len(settings.layers) + 8) / 2**20:.1f} MiB; "
        f"{len(manifest['shards'])} of {manifest['num_shards']} shards already done")
    return _fill_shards(out_dir, manifest, len(corpus), settings.shard_size, settings.layers, corpus.make_shard,
                        "teacher-forced", corpus.unit, progress, stop_after_shards, log)
