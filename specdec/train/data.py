"""Training data for draft heads: token ids + the target's hidden states + its own top-1 choices.

Two kinds, one shard format (the trainer reads both):

* self-distilled (`build_dataset`, `specdec train data`): the target answers offline prompts;
* teacher-forced (`build_corpus_dataset`, `specdec train data --corpus FILES`): text from files,
  cut into chunks and put in an assistant turn; ONE batched target forward per group of chunks, no
  decoding, so it yields several times more tokens per CPU minute. The labels are still the
  target's own top-1 choices; the trainer keeps only rows whose context follows the target's
  greedy path (trainer.label_rows), which is exactly the situation a draft is judged in.

For every prompt the target writes its OWN answer (its chat template, its own decoding: greedy,
or sampled for a `sampled_fraction` of prompts), a shard's prompts decoded as one batch by the
loop; the hidden states of the chosen layers and the target's top-1 labels are recorded from
those same forwards (the prefill's prompt rows, then each step's row), so there is no second
pass. A sample is prompt + answer without the answer's last token (never fed to the target); the
last row's label is that token's greedy choice. Heads are trained to predict the target's own
tokens from those states (see specdec.heads.LABEL_CONVENTION).

On disk (`out_dir/`):
    specdec.json             marks the directory as specdec's (specdec.files)
    prompts.jsonl            the prompts (text, source) of every shard begun, appended as shards need them
                             (prompts given by the caller: all of them at the start), so a resume uses the same
    shard-00000.safetensors  per shard: tokens int32 [N], offsets int64 [n + 1] (sample i is
                             tokens[offsets[i]:offsets[i + 1]]), prompt_lengths int64 [n],
                             sampled uint8 [n], prompt_index int64 [n], hidden.<layer> float16 [N, H],
                             target_next int32 [N] (the target's top-1 token after each position:
                             the label every head type learns, see specdec.heads.LABEL_CONVENTION)
    manifest.json            target (name + fingerprint), settings, sources + licences, finished shards

The manifest's "kind" says which ("self-distilled" or "teacher-forced"). Resumable: every shard
and the manifest are written to a temp file and renamed; a rerun with the same settings skips the
shards the manifest lists as finished.
Each prompt's decoding (greedy or sampled, and the sampling seed) is a function of (seed, prompt
index), so an interrupted and resumed job writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..draft import Draft
from ..drafters.base import DraftContext, Drafter
from ..sampling import SamplingParams
from ..checks import check_positive_int
from ..files import check_output_dir, open_output_dir, save_safetensors, write_text_atomic
from ..heads import check_target_matches, target_description
from ..heads.checkpoint import load_weights
from .prompts import (DEFAULT_MIX, GENERATED_TEXT_LICENCE, SOURCES, PromptItem, PromptLog, PromptSupply, check_mix,
                      describe_mix)

DATA_FORMAT = "specdec-selfdistill"
DATA_VERSION = 1
MANIFEST_FILE = "manifest.json"
PROMPTS_FILE = "prompts.jsonl"
HIDDEN_KEY = "hidden.{layer}"
TARGET_NEXT_KEY = "target_next"
SELF_DISTILLED, TEACHER_FORCED = "self-distilled", "teacher-forced"


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.safetensors"


@dataclass
class DataSettings:
    """What `build_dataset` generates (all of it is recorded in the manifest and checked on resume)."""

    num_prompts: int = 32
    max_new_tokens: int = 128
    layers: list[int] | None = None  # target hidden layers to store; None = [num_layers - 1, num_layers]
    sampled_fraction: float = 0.3  # share of prompts answered by sampling instead of greedy decoding
    temperature: float = 0.7
    top_p: float = 0.95
    shard_size: int = 16  # prompts per shard
    seed: int = 0
    # prompt kind -> weight (prompts.SOURCES); None: DEFAULT_MIX for new data, the stored mix when resuming
    prompt_weights: dict[str, float] | None = None

    def validate(self, target) -> None:
        for name in ("num_prompts", "max_new_tokens", "shard_size"):
            check_positive_int(name, getattr(self, name))
        if not 0.0 <= self.sampled_fraction <= 1.0:
            raise ValueError(f"sampled_fraction must be in [0, 1], got {self.sampled_fraction!r}")
        self.layers = resolve_layers(self.layers, target)
        SamplingParams(self.temperature, 0, self.top_p)  # raises a clear error for bad values
        target.check_fits(1, self.max_new_tokens)  # before anything is written; each prompt is checked too

    def decoding_for(self, prompt_index: int) -> SamplingParams:
        """Greedy or sampled (with its own seed) for one prompt: a function of (seed, index) only."""
        draw = random.Random(f"{self.seed}:{prompt_index}").random()
        if draw < self.sampled_fraction:
            return SamplingParams(self.temperature, 0, self.top_p, seed=self.seed * 1_000_003 + prompt_index)
        return SamplingParams()


def default_layers(target) -> list[int]:
    """The layers every head type reads: num_layers (Medusa, MTP sequential) and num_layers - 1 (MTP parallel)."""
    return sorted({max(0, target.num_layers - 1), target.num_layers})


def resolve_layers(layers: list[int] | None, target) -> list[int]:
    """`layers` sorted and checked (None: default_layers)."""
    layers = sorted({int(layer) for layer in (default_layers(target) if layers is None else layers)})
    bad = [layer for layer in layers if not 0 <= layer <= target.num_layers]
    if bad or not layers:
        raise ValueError(
            f"layers {bad or layers} out of range: hidden layers are 0 (embeddings) .. {target.num_layers} "
            "(after the final norm)"
        )
    return layers


def _write_json_atomic(path: Path, payload) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2))


def _read_prompts(path: Path) -> list[PromptItem]:
    """The complete lines of a prompts file (a last line a killed job cut short is not one)."""
    return [PromptItem(**json.loads(line)) for line in path.read_text().split("\n")[:-1] if line.strip()]


def _prompts_text(prompts: list[PromptItem]) -> str:
    return "".join(json.dumps(asdict(p)) + "\n" for p in prompts)


def _new_manifest(target, settings, kind: str, sources: dict, generated_text_licence: str, num_items: int,
                  num_shards: int) -> dict:
    return {
        "format": DATA_FORMAT,
        "format_version": DATA_VERSION,
        "kind": kind,
        "target": target_description(target),
        "settings": asdict(settings),
        "hidden_size": target.hidden_size,
        "hidden_dtype": "float16",
        "chat_template": bool(getattr(target.tokenizer, "chat_template", None)),
        "sources": sources,
        "generated_text_licence": generated_text_licence,
        "num_prompts": num_items,
        "num_shards": num_shards,
        "shards": {},
        "complete": False,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def read_manifest(directory: str | Path) -> dict:
    path = Path(directory) / MANIFEST_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no training data ({MANIFEST_FILE} missing); run `specdec train data`")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != DATA_FORMAT or manifest.get("format_version") != DATA_VERSION:
        raise ValueError(f"{path} is not specdec training data v{DATA_VERSION}")
    return manifest


def _open_or_create(target, out_dir: Path, settings: DataSettings, prompts: list[PromptItem] | None) -> dict:
    """The manifest of the data in `out_dir` (checked against `settings`), or a new one; writes
    nothing when the settings are wrong."""
    manifest_path = out_dir / MANIFEST_FILE
    if manifest_path.exists():
        manifest = read_manifest(out_dir)
        check_target_matches(manifest, target, f"data in {out_dir}")
        if settings.prompt_weights is None:  # not asked for: resume with the directory's own mix
            settings.prompt_weights = manifest["settings"].get("prompt_weights")
        if manifest["settings"] != asdict(settings):
            changed = {k: (manifest["settings"].get(k), v) for k, v in asdict(settings).items() if manifest["settings"].get(k) != v}
            raise ValueError(
                f"{out_dir} already holds data made with other settings (existing, requested): {changed}; "
                "rerun with the same settings to resume, or choose a new --out"
            )
        stored = _read_prompts(out_dir / PROMPTS_FILE)
        if prompts is not None and _prompts_text(prompts[: len(stored)]) != _prompts_text(stored):
            raise ValueError(f"{out_dir} already holds data for different prompts; choose a new --out")
        return manifest
    if settings.prompt_weights is None:
        settings.prompt_weights = dict(DEFAULT_MIX)
    check_mix(settings.prompt_weights)
    if prompts is None:
        PromptSupply(settings.prompt_weights, settings.seed).check_holds(settings.num_prompts)
    elif len(prompts) != settings.num_prompts:
        raise ValueError(f"got {len(prompts)} prompts but settings.num_prompts is {settings.num_prompts}")
    open_output_dir(out_dir, "training-data")
    # prompts given by the caller are stored at once; the supply's as the shards need them (PromptLog)
    write_text_atomic(out_dir / PROMPTS_FILE, _prompts_text(prompts or []))
    num_shards = -(-settings.num_prompts // settings.shard_size)
    manifest = _new_manifest(target, settings, SELF_DISTILLED, {}, GENERATED_TEXT_LICENCE, settings.num_prompts, num_shards)
    _write_json_atomic(manifest_path, manifest)
    return manifest


def _count_sources(manifest: dict, prompts: list[PromptItem]) -> None:
    """Add a new shard's prompts to the manifest's sources (what each is, its licence, its prompts)."""
    for prompt in prompts:
        source = SOURCES.get(prompt.source)
        entry = manifest["sources"].setdefault(prompt.source, {
            "description": source.description if source else "given by the caller",
            "licence": source.licence if source else "not recorded", "prompts": 0})
        entry["prompts"] += 1


def answer_bytes_bound(settings: DataSettings, hidden_size: int) -> int:
    """Upper bound on the answers' share of the data: every answer at max_new_tokens, fp16 hidden
    rows + int32 ids + int32 labels (the prompts' rows add to it)."""
    return settings.num_prompts * settings.max_new_tokens * (2 * hidden_size * len(settings.layers) + 8)


@dataclass
class Sample:
    tokens: torch.Tensor  # [T] long: prompt + the target's answer
    hidden: dict[int, torch.Tensor]  # layer -> [T, H] float16
    num_prompt_tokens: int
    target_next: torch.Tensor  # [T] long: the target's top-1 token after position t (its greedy choice for t + 1)
    teacher_forced: bool = False  # the answer is corpus text, not the target's own (training only, never held out)
    source: str = ""  # the prompt's source (prompts.jsonl; "corpus" for teacher-forced text): per-source eval


class _HiddenRecorder(Drafter):
    """Records, per sequence, the target's hidden rows and top-1 choices from the forwards that
    decode the answer (no second pass): it never drafts, asks the loop for `layers` and the
    logits of the rows it feeds. On the native runtime every row is computed independently of the
    others (docs/architecture.md, lossless rules), so these rows are bitwise the rows one forward
    over prompt + answer would give."""

    wants_node_logits = True

    def __init__(self, layers: list[int]):
        self.hidden_layers = tuple(layers)
        self.hidden: list[dict[int, torch.Tensor]] = []  # per forward: layer -> [n, H] float16
        self.target_next: list[torch.Tensor] = []  # per forward: [n] the target's top-1 after each row
        self.ctx: DraftContext | None = None
        self.sequences: list[_HiddenRecorder] = []  # the per-sequence recorders, in prompt order

    def for_sequence(self) -> "_HiddenRecorder":
        recorder = _HiddenRecorder(list(self.hidden_layers))
        self.sequences.append(recorder)
        return recorder

    def propose(self, ctx: DraftContext, budget: int) -> Draft:
        return Draft.empty()

    def on_verified(self, result, ctx: DraftContext) -> None:
        self._record(ctx)

    def on_finished(self, result, ctx: DraftContext) -> None:
        self._record(ctx)

    def _record(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        num_rows = ctx.new_hidden[self.hidden_layers[0]].shape[0]  # the prompt after prefill, then the root
        self.hidden.append({layer: rows.to("cpu", torch.float16) for layer, rows in ctx.new_hidden.items()})
        self.target_next.append(ctx.all_node_logits[:num_rows].argmax(-1).cpu())

    def sample(self) -> Sample:
        """prompt + answer without its last token (never fed to the target, so it has no row); the
        last row's label is that token's greedy choice."""
        hidden = {layer: torch.cat([rows[layer] for rows in self.hidden]) for layer in self.hidden_layers}  # [T, H]
        num_rows = hidden[self.hidden_layers[0]].shape[0]
        tokens = torch.tensor(self.ctx.tokens[:num_rows], dtype=torch.long)  # [T]
        return Sample(tokens, hidden, self.ctx.num_prompt_tokens, torch.cat(self.target_next))


def _answer_shard(target, prompt_ids: list[list[int]], decodings: list[SamplingParams], settings: DataSettings) -> list[Sample]:
    """The target's own answers for one shard, decoded as ONE batch (each row equals the prompt run
    alone; batching is what makes self-distillation affordable on a CPU); the hidden states and
    top-1 labels come from the decoding forwards themselves (`_HiddenRecorder`)."""
    from ..loop import run

    recorder = _HiddenRecorder(list(settings.layers))
    run(target, [list(ids) for ids in prompt_ids], recorder, settings.max_new_tokens, list(decodings)).finish()
    return [sequence.sample() for sequence in recorder.sequences]


def _write_shard(path: Path, samples: list[Sample], prompt_indices: list[int], sampled: list[bool], layers: list[int]) -> dict:
    offsets = torch.tensor([0] + [len(sample.tokens) for sample in samples]).cumsum(0)  # [n + 1]
    tensors = {
        "tokens": torch.cat([sample.tokens for sample in samples]).to(torch.int32),  # [N]
        TARGET_NEXT_KEY: torch.cat([sample.target_next for sample in samples]).to(torch.int32),  # [N]
        "offsets": offsets,
        "prompt_lengths": torch.tensor([sample.num_prompt_tokens for sample in samples], dtype=torch.long),
        "sampled": torch.tensor(sampled, dtype=torch.uint8),
        "prompt_index": torch.tensor(prompt_indices, dtype=torch.long),
    }
    for layer in layers:
        tensors[HIDDEN_KEY.format(layer=layer)] = torch.cat([sample.hidden[layer] for sample in samples]).contiguous()  # [N, H]
    save_safetensors(path, tensors)
    answer_tokens = sum(len(sample.tokens) - sample.num_prompt_tokens for sample in samples)
    return {"file": path.name, "samples": len(samples), "tokens": int(offsets[-1]), "answer_tokens": answer_tokens,
            "bytes": path.stat().st_size}


def build_dataset(
    target,
    out_dir: str | Path,
    settings: DataSettings | None = None,
    prompts: list[PromptItem] | None = None,
    progress: bool = True,
    stop_after_shards: int | None = None,
    log=print,
) -> dict:
    """Generate (or resume) self-distillation data in `out_dir`; returns the manifest.

    `prompts` overrides the offline prompt mix (their count must equal settings.num_prompts).
    The mix's prompts are made as the shards need them (PromptLog): any num_prompts starts at once.
    `stop_after_shards` stops after writing that many NEW shards (an interruption, for tests).
    """
    settings = settings or DataSettings()
    settings.validate(target)
    out_dir = check_output_dir(out_dir, "training-data")
    manifest = _open_or_create(target, out_dir, settings, prompts)
    supply = iter(prompts) if prompts is not None else iter(PromptSupply(settings.prompt_weights, settings.seed))
    prompt_log = PromptLog(out_dir / PROMPTS_FILE, supply)
    done = {int(k) for k, v in manifest["shards"].items() if (out_dir / v["file"]).is_file()}
    log(f"prompt mix, kind share: {describe_mix(settings.prompt_weights)}")
    log(
        f"self-distillation data: {settings.num_prompts} prompts in {manifest['num_shards']} shards, answers up to "
        f"{settings.max_new_tokens} tokens, layers {settings.layers} (fp16, hidden {target.hidden_size}): "
        f"at most {answer_bytes_bound(settings, target.hidden_size) / 2**20:.1f} MiB of answers; "
        f"{len(done)} shards already done"
    )

    def answer(indices: list[int]) -> tuple[list[Sample], list[bool]]:
        items = prompt_log.take(indices[0], indices[-1] + 1)
        prompt_ids = [target.encode_prompt(p.text) for p in items]
        for ids in prompt_ids:  # every answer must fit the context window, before the shard is generated
            target.check_fits(len(ids), settings.max_new_tokens)
        if str(indices[0] // settings.shard_size) not in manifest["shards"]:
            _count_sources(manifest, items)  # saved with the shard's manifest entry
        decodings = [settings.decoding_for(index) for index in indices]
        samples = _answer_shard(target, prompt_ids, decodings, settings)
        return samples, [not decoding.greedy for decoding in decodings]

    try:
        return _fill_shards(out_dir, manifest, settings.num_prompts, settings.shard_size, settings.layers, answer,
                            "self-distill", "prompt", progress, stop_after_shards)
    finally:
        prompt_log.close()


def _fill_shards(out_dir: Path, manifest: dict, num_items: int, shard_size: int, layers: list[int], make_shard,
                 desc: str, unit: str, progress: bool, stop_after_shards: int | None) -> dict:
    """Write every shard the manifest lacks: make_shard(item indices) -> (samples, sampled flags)."""
    from tqdm.auto import tqdm

    done = {int(k) for k, v in manifest["shards"].items() if (out_dir / v["file"]).is_file()}
    written = 0
    bar = tqdm(total=num_items, desc=desc, unit=unit, disable=not progress,
               initial=sum(manifest["shards"][str(i)]["samples"] for i in done))
    for shard in range(manifest["num_shards"]):
        if shard in done:
            continue
        if stop_after_shards is not None and written >= stop_after_shards:
            break
        indices = list(range(shard * shard_size, min(num_items, (shard + 1) * shard_size)))
        samples, sampled = make_shard(indices)
        bar.update(len(indices))
        manifest["shards"][str(shard)] = _write_shard(out_dir / shard_name(shard), samples, indices, sampled, layers)
        manifest["complete"] = len(manifest["shards"]) == manifest["num_shards"]
        _write_json_atomic(out_dir / MANIFEST_FILE, manifest)
        written += 1
    bar.close()
    return manifest


# ----------------------------------------------------------------------------- teacher-forced corpus data
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")
MIN_CHUNK_TOKENS = 16  # a file's last piece shorter than this is dropped


@dataclass
class CorpusSettings:
    """What `build_corpus_dataset` makes (recorded in the manifest and checked on resume)."""

    chunk_tokens: int = 256  # corpus tokens per sample (the answer part)
    max_chunks: int | None = None  # keep this many chunks (after a seeded shuffle); None = all
    layers: list[int] | None = None  # as DataSettings.layers
    instruction: str = "Continue the following text."  # the user turn the chunk answers
    shard_size: int = 64  # chunks per shard
    batch_size: int = 8  # chunks per target forward
    seed: int = 0
    licence: str = "the licence of the given files (not checked by specdec)"
    corpus_digest: str = ""  # sha256 of the chunks' token ids (filled in by build_corpus_dataset)

    def validate(self, target) -> None:
        optional = ("max_chunks",) if self.max_chunks is not None else ()
        for name in ("chunk_tokens", "shard_size", "batch_size", *optional):
            check_positive_int(name, getattr(self, name))
        if self.chunk_tokens < MIN_CHUNK_TOKENS:
            raise ValueError(f"chunk_tokens must be >= {MIN_CHUNK_TOKENS}, got {self.chunk_tokens}")
        if not self.instruction.strip():
            raise ValueError("the instruction (the user turn before each chunk) must not be empty")
        self.layers = resolve_layers(self.layers, target)
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


def build_corpus_dataset(
    target,
    out_dir: str | Path,
    paths: list[str | Path],
    settings: CorpusSettings | None = None,
    progress: bool = True,
    stop_after_shards: int | None = None,
    log=print,
) -> dict:
    """Teacher-forced data from text files in `out_dir` (or resume it); returns the manifest."""
    settings = settings or CorpusSettings()
    settings.validate(target)
    out_dir = check_output_dir(out_dir, "training-data")
    files = corpus_files(paths)
    chunks = corpus_chunks(target.tokenizer, files, settings)
    settings.corpus_digest = _corpus_digest(chunks)
    num_shards = -(-len(chunks) // settings.shard_size)
    manifest_path = out_dir / MANIFEST_FILE
    if manifest_path.exists():
        manifest = read_manifest(out_dir)
        check_target_matches(manifest, target, f"data in {out_dir}")
        if manifest["kind"] != TEACHER_FORCED or manifest["settings"] != asdict(settings):
            raise ValueError(
                f"{out_dir} already holds other data (another kind, corpus or settings); rerun with the same files and "
                "settings to resume, or choose a new --out"
            )
    else:
        open_output_dir(out_dir, "training-data")
        roots = sorted({str(Path(p).resolve() if Path(p).is_dir() else Path(p).resolve().parent) for p in paths})
        sources = {"corpus": {"description": f"{len(files)} text files under {', '.join(roots)}, teacher-forced",
                              "licence": settings.licence, "chunks": len(chunks)}}
        manifest = _new_manifest(target, settings, TEACHER_FORCED, sources,
                                 "no generated text: the answers are the corpus files' own text", len(chunks), num_shards)
        _write_json_atomic(manifest_path, manifest)
    prompt_ids = target.encode_prompt(settings.instruction)
    tokens = sum(len(chunk) + len(prompt_ids) for chunk in chunks)
    log(f"teacher-forced data: {len(chunks)} chunks of <= {settings.chunk_tokens} tokens from {len(files)} files "
        f"({tokens} tokens with the instruction), layers {settings.layers}: about "
        f"{tokens * (2 * target.hidden_size * len(settings.layers) + 8) / 2**20:.1f} MiB; "
        f"{len(manifest['shards'])} of {num_shards} shards already done")

    def forward(indices: list[int]) -> tuple[list[Sample], list[bool]]:
        return _teacher_forced_shard(target, prompt_ids, [chunks[i] for i in indices], settings), [False] * len(indices)

    return _fill_shards(out_dir, manifest, len(chunks), settings.shard_size, settings.layers, forward,
                        "teacher-forced", "chunk", progress, stop_after_shards)


# ----------------------------------------------------------------------------- reading
def _source_of(prompt_sources: list[str], shard_tensors: dict, row: int) -> str:
    """The prompt source of a shard's row-th sample ("" when the data has no prompts file)."""
    return prompt_sources[int(shard_tensors["prompt_index"][row])] if prompt_sources else ""


def load_samples(directory: str | Path, layers: list[int], target=None) -> tuple[dict, list[Sample]]:
    """(manifest, samples of every finished shard in prompt order); checks the target when given."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if target is not None:
        check_target_matches(manifest, target, f"data in {directory}")
    missing = [layer for layer in layers if layer not in manifest["settings"]["layers"]]
    if missing:
        raise ValueError(f"data in {directory} has hidden layers {manifest['settings']['layers']}, but these heads need {missing}")
    teacher_forced = manifest["kind"] == TEACHER_FORCED
    prompts_file = directory / PROMPTS_FILE
    prompt_sources = [item.source for item in _read_prompts(prompts_file)] if prompts_file.is_file() else []
    samples: list[Sample] = []
    for shard in sorted(manifest["shards"], key=int):
        path = directory / manifest["shards"][shard]["file"]
        tensors = load_weights(path)
        offsets = tensors["offsets"].tolist()
        for i, (start, stop) in enumerate(zip(offsets, offsets[1:])):
            samples.append(Sample(
                tokens=tensors["tokens"][start:stop].long(),
                hidden={layer: tensors[HIDDEN_KEY.format(layer=layer)][start:stop] for layer in layers},
                num_prompt_tokens=int(tensors["prompt_lengths"][i]),
                target_next=tensors[TARGET_NEXT_KEY][start:stop].long(),
                teacher_forced=teacher_forced,
                source="corpus" if teacher_forced else _source_of(prompt_sources, tensors, i),
            ))
    if not samples:
        raise ValueError(f"data in {directory} has no finished shards yet; run (or resume) `specdec train data`")
    return manifest, samples
