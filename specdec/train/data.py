"""Training data for draft heads: token ids + the target's hidden states + its own top-1 choices.

Two kinds, one shard format (the trainer reads both):

* self-distilled (`build_dataset`, `specdec train data`): the target answers offline prompts;
* teacher-forced (`specdec.train.teacher_forced`, `specdec train data --corpus FILES` or
  `--conversations sharegpt`): text from files cut into chunks and put in an assistant turn, or
  whole conversations under the target's chat template; target forwards only, no decoding, so it
  yields many times more tokens per CPU minute. The labels are still the target's own top-1
  choices (never the corpus's tokens); the trainer keeps only rows whose context follows the
  target's greedy path (batches.label_rows), which is exactly the situation a draft is judged in,
  and, in conversations, only rows whose label is an assistant token.

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
                             the label every head type learns, see specdec.heads.LABEL_CONVENTION);
                             conversations also: assistant uint8 [N] (1 = the token is part of an
                             assistant reply: the only label positions the loss uses), held_out uint8 [n]
                             (the conversation's side of the split, sharegpt.is_held_out)
    manifest.json            target (name + fingerprint), settings, sources + licences, finished shards

The manifest's "kind" says which ("self-distilled" or "teacher-forced"); its "throughput" the
supervised positions (label rows the loss may use) per CPU-minute and per minute of the shards
written. Resumable: every shard
and the manifest are written to a temp file and renamed; a rerun with the same settings skips the
shards the manifest lists as finished.
Each prompt's decoding (greedy or sampled, and the sampling seed) is a function of (seed, prompt
index), so an interrupted and resumed job writes the same shards as an uninterrupted one.
"""

from __future__ import annotations

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
from . import sharegpt
from .prompts import (DEFAULT_MIX, GENERATED_TEXT_LICENCE, SOURCES, PromptItem, PromptLog, PromptSupply, check_mix,
                      describe_mix, prepare_mix)

DATA_FORMAT = "specdec-selfdistill"
DATA_VERSION = 1
MANIFEST_FILE = "manifest.json"
PROMPTS_FILE = "prompts.jsonl"
HIDDEN_KEY = "hidden.{layer}"
TARGET_NEXT_KEY = "target_next"
ASSISTANT_KEY, HELD_OUT_KEY = "assistant", "held_out"
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
        if prompts is None:
            prepare_mix(settings.prompt_weights)
        stored = _read_prompts(out_dir / PROMPTS_FILE)
        if prompts is not None and _prompts_text(prompts[: len(stored)]) != _prompts_text(stored):
            raise ValueError(f"{out_dir} already holds data for different prompts; choose a new --out")
        return manifest
    if settings.prompt_weights is None:
        settings.prompt_weights = dict(DEFAULT_MIX)
    check_mix(settings.prompt_weights)
    if prompts is None:
        prepare_mix(settings.prompt_weights)
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
    teacher_forced: bool = False  # the answer is corpus text, not the target's own (training only unless held_out)
    source: str = ""  # the prompt's source (prompts.jsonl; "corpus" for teacher-forced text): per-source eval
    supervised: torch.Tensor | None = None  # [T] bool: tokens that may be labels (assistant replies); None = the answer
    held_out: bool | None = None  # the sample's side of a split fixed by its source (ShareGPT); None = the trainer's
    # [T] float32: logsumexp of the target's logits over the whole vocabulary at each position (NaN where no label
    # reads it); set by the trainer for drafters whose loss reads the target's distribution on a draft vocabulary
    target_log_normaliser: torch.Tensor | None = None

    def supervised_positions(self) -> int:
        """Label positions the loss may use: the answer's tokens, or the assistant tokens after the first one."""
        if self.supervised is None:
            return len(self.tokens) - self.num_prompt_tokens
        return int(self.supervised[self.num_prompt_tokens :].sum())


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
    """One shard file (format: the module doc) and its manifest entry."""
    offsets = torch.tensor([0] + [len(sample.tokens) for sample in samples]).cumsum(0)  # [n + 1]
    tensors = {
        "tokens": torch.cat([sample.tokens for sample in samples]).to(torch.int32),  # [N]
        TARGET_NEXT_KEY: torch.cat([sample.target_next for sample in samples]).to(torch.int32),  # [N]
        "offsets": offsets,
        "prompt_lengths": torch.tensor([sample.num_prompt_tokens for sample in samples], dtype=torch.long),
        "sampled": torch.tensor(sampled, dtype=torch.uint8),
        "prompt_index": torch.tensor(prompt_indices, dtype=torch.long),
    }
    if samples[0].supervised is not None:  # conversations: one data source, every sample has both
        tensors[ASSISTANT_KEY] = torch.cat([sample.supervised for sample in samples]).to(torch.uint8)  # [N]
        tensors[HELD_OUT_KEY] = torch.tensor([bool(sample.held_out) for sample in samples], dtype=torch.uint8)  # [n]
    for layer in layers:
        tensors[HIDDEN_KEY.format(layer=layer)] = torch.cat([sample.hidden[layer] for sample in samples]).contiguous()  # [N, H]
    save_safetensors(path, tensors)
    answer_tokens = sum(len(sample.tokens) - sample.num_prompt_tokens for sample in samples)
    return {"file": path.name, "samples": len(samples), "tokens": int(offsets[-1]), "answer_tokens": answer_tokens,
            "supervised_positions": sum(sample.supervised_positions() for sample in samples), "bytes": path.stat().st_size}


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
                            "self-distill", "prompt", progress, stop_after_shards, log)
    finally:
        prompt_log.close()


def _fill_shards(out_dir: Path, manifest: dict, num_items: int, shard_size: int, layers: list[int], make_shard,
                 desc: str, unit: str, progress: bool, stop_after_shards: int | None, log=print) -> dict:
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
        wall, cpu = time.perf_counter(), time.process_time()  # process time: every thread's CPU seconds
        samples, sampled = make_shard(indices)
        bar.update(len(indices))
        entry = _write_shard(out_dir / shard_name(shard), samples, indices, sampled, layers)
        entry.update(wall_s=round(time.perf_counter() - wall, 3), cpu_s=round(time.process_time() - cpu, 3))
        manifest["shards"][str(shard)] = entry
        manifest["complete"] = len(manifest["shards"]) == manifest["num_shards"]
        manifest["throughput"] = throughput(manifest)
        _write_json_atomic(out_dir / MANIFEST_FILE, manifest)
        written += 1
    bar.close()
    if written:
        rate = manifest["throughput"]
        log(f"{rate['supervised_positions']} supervised positions in {rate['wall_s']:.1f} s ({rate['cpu_s']:.1f} CPU-s): "
            f"{rate['positions_per_cpu_minute']:.0f} per CPU-minute, {rate['positions_per_minute']:.0f} per minute")
    return manifest


def throughput(manifest: dict) -> dict:
    """Supervised positions (label rows the loss may use) per CPU-minute and per minute over the
    finished shards that were timed."""
    timed = [entry for entry in manifest["shards"].values() if "cpu_s" in entry]
    positions = sum(entry["supervised_positions"] for entry in timed)
    wall_s, cpu_s = sum(entry["wall_s"] for entry in timed), sum(entry["cpu_s"] for entry in timed)
    return {"supervised_positions": positions, "wall_s": round(wall_s, 3), "cpu_s": round(cpu_s, 3),
            "positions_per_cpu_minute": round(60 * positions / max(cpu_s, 1e-9), 1),
            "positions_per_minute": round(60 * positions / max(wall_s, 1e-9), 1)}


# ----------------------------------------------------------------------------- reading
def _prompt_of(prompts: list[PromptItem], shard_tensors: dict, row: int) -> PromptItem | None:
    """The prompt of a shard's row-th sample (None when the data has no prompts file)."""
    return prompts[int(shard_tensors["prompt_index"][row])] if prompts else None


def _fixed_side(prompt: PromptItem | None, shard_tensors: dict, row: int) -> bool | None:
    """A sample's held-out side when its source fixes it: ShareGPT conversations (the shard's flag)
    and answers to ShareGPT user turns (the same rule on the prompt); None = the trainer's split."""
    if HELD_OUT_KEY in shard_tensors:
        return bool(shard_tensors[HELD_OUT_KEY][row])
    if prompt is not None and prompt.source == sharegpt.SOURCE_NAME:
        return sharegpt.is_held_out(prompt.text)
    return None


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
    prompts = _read_prompts(prompts_file) if prompts_file.is_file() else []
    samples: list[Sample] = []
    for shard in sorted(manifest["shards"], key=int):
        path = directory / manifest["shards"][shard]["file"]
        tensors = load_weights(path)
        offsets = tensors["offsets"].tolist()
        for i, (start, stop) in enumerate(zip(offsets, offsets[1:])):
            prompt = _prompt_of(prompts, tensors, i)
            samples.append(Sample(
                tokens=tensors["tokens"][start:stop].long(),
                hidden={layer: tensors[HIDDEN_KEY.format(layer=layer)][start:stop] for layer in layers},
                num_prompt_tokens=int(tensors["prompt_lengths"][i]),
                target_next=tensors[TARGET_NEXT_KEY][start:stop].long(),
                teacher_forced=teacher_forced,
                source=manifest.get("corpus_source", "corpus") if teacher_forced else (prompt.source if prompt else ""),
                supervised=tensors[ASSISTANT_KEY][start:stop].bool() if ASSISTANT_KEY in tensors else None,
                held_out=_fixed_side(prompt, tensors, i),
            ))
    if not samples:
        raise ValueError(f"data in {directory} has no finished shards yet; run (or resume) `specdec train data`")
    return manifest, samples
