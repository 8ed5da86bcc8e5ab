"""`specdec bench`: every method on every selected Spec-Bench question, on one target, in one run.

Order of work:
    1. load questions (Spec-Bench jsonl) and pick `limit_per_kind` per task kind (or all: --full)
    2. phase 1, the specdec methods (`plain` first: it is the speed baseline AND the reference
       output): build each and run one untimed warm-up, then question by question every method
       in turn (interleaved, so machine drift hits all alike; both turns for multi-turn
       questions; turn 2 follows the method's own turn-1 answer, as in Spec-Bench); with
       --repeats N each question runs N rounds, the methods' order reversed every other round,
       each round on a freshly built method (nothing learnt in an earlier round of the same
       question carries over: with repeats no method learns across questions either), and a
       turn's time is the median of its N runs (every run's output is checked).
       Peers whose copy of the target is held beside it (llama.cpp on the GGUF file, or transformers'
       when the target already is a transformers model) run in phase 1 too, interleaved with them
    3. free them; phase 2, the other peers, one runtime at a time: load its copy of the target (a
       transformers model for `hf-*`, vLLM's worker for `vllm-*`), run its peers interleaved the
       same way (a runtime whose methods each hold an engine, vLLM's: one method at a time, its
       reference first), free it
    4. greedy runs: every output is compared with its method's reference (plain decoding; for
       llama-lookup llama.cpp's own plain decoding), question by question and turn by turn; a
       specdec method that differs fails the run (exit code 1), a peer only warns
    5. results.json (with the command that reproduces the run and the machine: environment.py),
       results.md and PNG plots in --out; the Markdown table is printed
"""

from __future__ import annotations

import gc
import inspect
import statistics
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from .methods import (METHODS, BenchMethod, MethodEntry, MethodOutput, MethodUnavailable, PeerRuntime, PeerSource,
                      register_method_factory)
from . import peers as _peers  # noqa: F401  (registers the hf-* and llama-* methods)
from . import peers_vllm as _peers_vllm  # noqa: F401  (registers the vllm-* methods: vLLM in its own venv)
from .environment import bench_command, machine_record
from .questions import TASK_KINDS, Question, default_questions_path, load_questions, select_questions
from .report import BASELINE, method_summary_rows, write_reports
from ..budget import budget_policy_for, parse_gamma
from ..checks import check_int
from ..files import check_output_dir
from ..loop import run as run_loop
from ..models.registry import DEFAULT_MODEL
from ..sampling import SamplingParams

DEFAULT_METHODS = "plain,pld,suffix,lookahead,small-model,hf-plain,hf-assisted,hf-pld"  # llama-*: opt in (an extra)
QUICK_LIMIT_PER_KIND = 3
DEFAULT_MAX_NEW_TOKENS = 128
WARMUP_TOKENS = 16
# target -> its same-tokenizer draft model (docs/models.md): used by small-model and hf-assisted
DEFAULT_DRAFT_FOR_TARGET = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}


@dataclass
class BenchConfig:
    methods: list[str] = field(default_factory=lambda: DEFAULT_METHODS.split(","))
    target: str = DEFAULT_MODEL  # registry name / HF dir / .gguf (ignored when a loaded target is passed)
    draft_model: str | None = None  # None = DEFAULT_DRAFT_FOR_TARGET[target], else no draft model
    questions_path: str | None = None  # None = default_questions_path()
    task_kinds: list[str] | None = None  # None = all six
    limit_per_kind: int | None = QUICK_LIMIT_PER_KIND  # None = every question
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    gamma: str | int = "auto"  # "auto" = cost-model budget per step, or a fixed draft length / node budget
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    weights: str | None = None  # load_target's weights: None (as stored), "gguf", "gguf-a8" or "fp32"
    out_dir: str | None = None  # None = runs/bench-<timestamp>
    warmup: bool = True
    repeats: int = 1  # rounds per question; a turn's seconds = the median over the rounds
    progress: bool = True

    def sampling(self) -> SamplingParams:
        return SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)


@dataclass
class MethodSpec:
    label: str  # as written: "pld:max_ngram=3" (the name the results use)
    name: str  # "pld"
    options: dict[str, str]  # raw option strings

    @classmethod
    def parse(cls, text: str) -> MethodSpec:
        """`name` or `name:key=value:key=value`."""
        text = text.strip()
        name, *pairs = text.split(":")
        if not name:
            raise ValueError(f"method {text!r} has no name; write NAME or NAME:KEY=VALUE:KEY=VALUE")
        options = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"method {text!r}: option {pair!r} is not KEY=VALUE")
            options[key.replace("-", "_")] = value
        return cls(text, name, options)


@dataclass
class BenchResult:
    exit_code: int  # 0 = ok, 1 = a specdec method's greedy output differed from plain decoding, or a method raised
    out_dir: Path
    rows: list[dict]
    methods: list[dict]  # per method: label, status ("ok" | "n/a" | "error"), reason, exact, peer, description
    summary: dict
    mismatches: list[dict]
    markdown: str


# ============================================================================ specdec methods


class SpecdecMethod(BenchMethod):
    """specdec's loop with a drafter (None = plain decoding); the budget policy is built once."""

    def __init__(self, target, drafter, gamma: str | int, description: str):
        self.target, self.drafter, self.description = target, drafter, description
        self.policy = budget_policy_for(target, drafter, gamma)  # "auto" measures the cost table once (cached on disk)

    def generate(self, prompt_ids, max_new_tokens, sampling) -> MethodOutput:
        start = time.perf_counter()
        generation = run_loop(self.target, [list(prompt_ids)], self.drafter, max_new_tokens, sampling, (), self.policy).finish()[0]
        generation.stats.time_total_s += time.perf_counter() - start
        return MethodOutput(generation.tokens, generation.stats)

    def close(self) -> None:
        self.target = self.drafter = self.policy = None


def _build_plain(target, options: dict, config) -> BenchMethod:
    if options:
        raise ValueError(f"method 'plain' takes no options, got {sorted(options)}")
    return SpecdecMethod(target, None, config.gamma, "specdec plain decoding (baseline)")


register_method_factory(BASELINE, _build_plain, help="specdec plain decoding: the baseline and reference output")


def _drafter_entry(name: str) -> MethodEntry | None:
    """A registered specdec drafter as a bench method, or None when there is no such drafter."""
    from ..drafters import registered_drafters

    drafter_class = registered_drafters().get(name)
    if drafter_class is None:
        return None

    def build(target, options: dict, config) -> BenchMethod:
        from ..drafters import drafter_options, make_drafter

        options = dict(options)
        try:
            # `gamma` is the run's (--gamma) unless the method sets its own: one table can show a drafter
            # under the cost model beside the same drafter at a fixed length
            gamma = parse_gamma(options.pop("gamma")) if "gamma" in options else config.gamma
            typed = drafter_options(name, [f"{key}={value}" for key, value in options.items()])
        except ValueError as error:
            raise ValueError(f"method {name!r}: {error}") from None
        params = inspect.signature(drafter_class.__init__).parameters
        # model-based drafters: the run's draft model, unless the method names its own
        if "draft_model" in params and "draft_model" not in typed and "draft_target" not in typed:
            if not config.draft_model:
                raise MethodUnavailable(f"no draft model for this target (pass --draft-model NAME or {name}:draft_model=NAME)")
            typed["draft_model"] = config.draft_model
        try:
            drafter = make_drafter(name, target, **typed)
        except (ValueError, FileNotFoundError, NotImplementedError) as error:
            raise MethodUnavailable(f"{type(error).__name__}: {error}") from None
        summary = (drafter_class.__doc__ or name).strip().splitlines()[0]
        shown = [f"{k}={v}" for k, v in typed.items()] + ([f"gamma={gamma}"] if gamma != config.gamma else [])
        settings = ", ".join(shown)
        return SpecdecMethod(target, drafter, gamma, f"{summary}{f' ({settings})' if settings else ''}")

    return MethodEntry(build, help=(drafter_class.__doc__ or "").strip())


def resolve_method(name: str) -> MethodEntry:
    """Bench registry first (plain, peers, registered callables), then specdec drafters."""
    entry = METHODS.get(name) or _drafter_entry(name)
    if entry is None:
        from ..drafters import listed_drafters

        known = sorted(set(METHODS) | set(listed_drafters()))
        raise ValueError(f"unknown method {name!r}; available: {', '.join(known)}")
    return entry


# ============================================================================ running


def _add_references(specs: list[MethodSpec], entries: dict[str, MethodEntry]) -> None:
    """Add every method's reference (llama-lookup's is llama-plain) that the run does not list."""
    index = 0
    while index < len(specs):
        reference = entries[specs[index].label].reference
        if reference not in {spec.name for spec in specs}:
            added = MethodSpec.parse(reference)
            specs.append(added)
            entries[added.label] = resolve_method(added.name)
        index += 1


def _reference_labels(specs: list[MethodSpec], entries: dict[str, MethodEntry]) -> dict[str, str]:
    """method label -> the label of the method its greedy output is compared with."""
    first_with_name: dict[str, str] = {}
    for spec in specs:
        first_with_name.setdefault(spec.name, spec.label)
    return {spec.label: first_with_name[entries[spec.label].reference] for spec in specs}


def _peer_groups(specs: list[MethodSpec], entries: dict[str, MethodEntry], target) -> list[tuple]:
    """[(runtime, its peer specs)] in run order; runtimes that reuse the benchmark's target go first
    (while it is still loaded)."""
    groups: dict = {}
    for spec in specs:
        runtime = entries[spec.label].runtime
        if runtime is not None:
            groups.setdefault(runtime, []).append(spec)
    return sorted(groups.items(), key=lambda item: not item[0].reuses(target))


def _method_batches(runtime: PeerRuntime, group: list[MethodSpec], entries: dict[str, MethodEntry]) -> list[list[MethodSpec]]:
    """The peer methods of one runtime as they run: all together (question by question in turn), or,
    for a runtime whose methods each hold an engine, one at a time with the references first (their
    outputs are what the others are compared with)."""
    if runtime.methods_at_once:
        return [group]
    references = {entries[spec.label].reference for spec in group}
    return [[spec] for spec in sorted(group, key=lambda spec: spec.label not in references)]


def _phase_one(run: _BenchRun, specs: list[MethodSpec], entries: dict[str, MethodEntry], target, source: PeerSource,
               config: BenchConfig) -> list[tuple]:
    """Runs specdec's methods with the peers whose copy of the target is held beside it, interleaved;
    returns the other peer runtimes [(runtime, specs)], which run after (their copies are freed here)."""
    phase_one = [(spec, target) for spec in specs if not entries[spec.label].peer]  # plain first: the reference
    later = []
    for runtime, group in _peer_groups(specs, entries, target):
        if not runtime.methods_at_once or not (runtime.reuses(target) or runtime.beside_target):
            later.append((runtime, group))
            continue
        try:
            runtime_target = target if runtime.reuses(target) else runtime.load(source, config)
        except MethodUnavailable as why:
            run.unavailable(group, entries, str(why))
            continue
        phase_one += [(spec, runtime_target) for spec in group]
    run.methods_on(phase_one, entries)
    return later


def run_benchmark(config: BenchConfig, target=None) -> BenchResult:
    """Run the benchmark; pass an already loaded `target` to skip loading `config.target`."""
    specs = [MethodSpec.parse(text) for text in config.methods if text.strip()]
    if BASELINE not in [spec.label for spec in specs]:
        specs.insert(0, MethodSpec.parse(BASELINE))  # the baseline and reference output are always needed
    labels = [spec.label for spec in specs]
    if len(set(labels)) != len(labels):
        raise ValueError(f"a method is listed twice: {labels}")
    if config.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {config.max_new_tokens}")
    check_int("repeats", config.repeats, 1, 100)
    parse_gamma(config.gamma)
    entries = {spec.label: resolve_method(spec.name) for spec in specs}  # unknown names fail before loading
    _add_references(specs, entries)
    references = {entry.reference for entry in entries.values()}
    # plain first, then specdec methods, then peers; references before the methods compared with them
    specs.sort(key=lambda spec: (entries[spec.label].peer, spec.name not in references))
    order = {spec.label: index for index, spec in enumerate(specs)}
    sampling = config.sampling()  # validates temperature / top-k / top-p
    questions_path = Path(config.questions_path) if config.questions_path else default_questions_path()
    questions = select_questions(load_questions(questions_path), config.limit_per_kind, config.task_kinds)
    out_dir = Path(config.out_dir) if config.out_dir else Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    check_output_dir(out_dir, "bench")  # before the model loads: never among files specdec did not write
    run = _BenchRun(config, questions, sampling, _reference_labels(specs, entries))
    specs = run.drop_missing_runtimes(specs, entries)  # a peer library not installed: say so now, run the rest

    owns_target = target is None
    if owns_target:
        from ..api import load_target

        target = load_target(config.target, dtype=config.dtype, progress=config.progress, weights=config.weights)
    command = bench_command(config, None if owns_target else str(target.name))  # as given, before defaults are filled in
    linear_backend = getattr(target, "linear_backend", None)
    target.check_fits(1, config.max_new_tokens)  # the size rule, before any method runs (each prompt is checked too)
    if config.draft_model is None:  # a copy: the caller's config is left as given
        config = replace(config, draft_model=DEFAULT_DRAFT_FOR_TARGET.get(config.target if owns_target else str(target.name)))
    run.config = config

    model_dir, target_name = getattr(target, "model_dir", None), str(target.name)
    source = PeerSource(name=target_name, model_dir=model_dir, tokenizer=target.tokenizer, vocab_size=target.vocab_size,
                        eos_token_ids=list(target.eos_token_ids))
    for runtime, group in _phase_one(run, specs, entries, target, source, config):  # then the peers run after it
        if owns_target:
            target = None  # never hold the native copy and a peer's copy of a large target together
            gc.collect()
        try:
            peer_target = runtime.load(source, config)
        except MethodUnavailable as why:
            run.unavailable(group, entries, str(why))
            continue
        try:
            for batch in _method_batches(runtime, group, entries):
                run.methods_on([(spec, peer_target) for spec in batch], entries)
        finally:
            peer_target = None
            gc.collect()
    run.methods.sort(key=lambda record: order[record["label"]])

    config_record = {
        **asdict(config),
        "target_name": target_name,
        "model_dir": str(model_dir) if model_dir else None,
        "questions_path": str(questions_path),
        "questions": len(questions),
        "equality_checked": sampling.greedy,
        "command": command,
        **machine_record(linear_backend),
    }
    summary = method_summary_rows(run.rows, run.methods, [k for k in TASK_KINDS if any(q.task_kind == k for q in questions)])
    markdown = write_reports(out_dir, config_record, run.rows, run.methods, summary, run.mismatches)
    failed = [m for m in run.mismatches if m["exact"]]
    if failed:
        print(f"FAILED: {len(failed)} output(s) of specdec methods differ from their reference (see above)", file=sys.stderr)
    errors = [m["label"] for m in run.methods if m["status"] == "error"]
    if errors:
        print(f"FAILED: method(s) {', '.join(errors)} raised an error (see above)", file=sys.stderr)
    return BenchResult(1 if failed or errors else 0, out_dir, run.rows, run.methods, summary, run.mismatches, markdown)


class _BenchRun:
    """One benchmark run: runs the methods question by question and keeps its per-turn rows,
    method records and mismatches (loop.BatchRun is one batch of prompts through the decoding loop)."""

    def __init__(self, config: BenchConfig, questions: list[Question], sampling: SamplingParams,
                 reference_of: dict[str, str]):
        self.config, self.questions, self.sampling = config, questions, sampling
        self.reference_of = reference_of  # method label -> its reference's label
        self.rows: list[dict] = []
        self.methods: list[dict] = []
        self.mismatches: list[dict] = []
        self.outputs: dict[tuple, list[int]] = {}  # (method label, question_id, turn) -> its tokens (greedy)

    def unavailable(self, specs: list[MethodSpec], entries: dict[str, MethodEntry], reason: str) -> None:
        """Record methods that cannot run here, with ONE line for all of them (they share the reason)."""
        print(f"n/a: {', '.join(spec.label for spec in specs)}: {reason}", file=sys.stderr)
        for spec in specs:
            entry = entries[spec.label]
            self.methods.append(dict(label=spec.label, status="n/a", reason=reason, exact=not entry.peer,
                                     peer=entry.peer, reference=self.reference_of[spec.label],
                                     description=entry.help.splitlines()[0] if entry.help else ""))

    def drop_missing_runtimes(self, specs: list[MethodSpec], entries: dict[str, MethodEntry]) -> list[MethodSpec]:
        """Report the peers whose runtime is not installed as n/a (one line per runtime); the rest run."""
        for runtime, group in _peer_groups(specs, entries, None):
            reason = runtime.missing()
            if reason:
                self.unavailable(group, entries, reason)
        reported = {record["label"] for record in self.methods}
        return [spec for spec in specs if spec.label not in reported]

    def methods_on(self, runs: list[tuple[MethodSpec, object]], entries: dict[str, MethodEntry]) -> None:
        """Run methods, each on its target (the bench's, or a peer's copy held beside it), INTERLEAVED:
        every method answers question 1, then every method answers question 2, ... so slow drift of a noisy machine (another tenant,
        thermal state) lands on all methods alike instead of on whichever ran during it. With
        repeats, a question runs in rounds, every other round in reverse order (the method that
        ran first runs last), and its rows take the median time of the rounds."""
        running: list[list] = []  # [spec, record, method, its target]
        try:
            for spec, target in runs:
                built = self._build(spec, entries[spec.label], target)
                if built is not None:
                    running.append([spec, *built, target])
            total = len(running) * sum(len(q.turns) for q in self.questions) * self.config.repeats
            with _progress(self.config.progress, "bench", total) as advance:
                for question in self.questions:
                    rounds: dict[str, list[list[tuple]]] = {spec.label: [] for spec, *_ in running}
                    for round_index in range(self.config.repeats):
                        for slot in (running if round_index % 2 == 0 else running[::-1]):
                            spec, record, method, target = slot
                            if record["status"] != "ok":
                                continue
                            try:
                                if self.config.repeats > 1:  # every round as the first: a fresh method
                                    method = slot[2] = self._fresh(spec, entries[spec.label], method, target)
                                rounds[spec.label].append(self._question(method, target, question, advance))
                            except Exception as error:  # one broken method must not lose the others' results
                                self._failed(record, error)
                    for spec, record, method, _ in running:  # references first: their rows are what others are checked against
                        if record["status"] == "ok":
                            self._rows(spec.label, method, question, rounds[spec.label])
        finally:
            for _, _, method, _ in running:
                method.close()
            running.clear()
            gc.collect()

    def _build(self, spec: MethodSpec, entry: MethodEntry, target) -> tuple[dict, BenchMethod] | None:
        """Build one method and run its untimed warm-up; None when it is unavailable here."""
        try:
            method = entry.build(target, dict(spec.options), self.config)
        except MethodUnavailable as why:
            self.unavailable([spec], {spec.label: entry}, str(why))
            return None
        record = dict(label=spec.label, status="ok", reason=None, exact=method.exact, peer=entry.peer,
                      reference=self.reference_of[spec.label], description=method.description)
        self.methods.append(record)
        try:
            self._warm_up(method, target)
        except Exception as error:
            self._failed(record, error)
        return record, method

    def _warm_up(self, method: BenchMethod, target) -> None:
        if self.config.warmup:  # first calls pay for lazy init / allocator growth: not timed
            first = target.encode_prompt([{"role": "user", "content": self.questions[0].turns[0]}])
            method.generate(first, min(WARMUP_TOKENS, self.config.max_new_tokens), self.sampling)

    def _fresh(self, spec: MethodSpec, entry: MethodEntry, method: BenchMethod, target) -> BenchMethod:
        """A new, warmed-up instance of a method in place of `method` (closed): a round of --repeats
        starts from nothing the method learnt in an earlier round of the same question (suffix's tree
        of earlier answers, auto's and the cost model's acceptance would otherwise have seen it)."""
        method.close()
        method = entry.build(target, dict(spec.options), self.config)
        self._warm_up(method, target)
        return method

    @staticmethod
    def _failed(record: dict, error: Exception) -> None:
        traceback.print_exc()
        record.update(status="error", reason=f"{type(error).__name__}: {error}")
        print(f"ERROR: method {record['label']!r} failed: {record['reason']}", file=sys.stderr)

    def _question(self, method: BenchMethod, target, question: Question, advance) -> list[tuple]:
        """One run of a question: (prompt ids, output, seconds) per turn."""
        messages: list[dict] = []
        turns = []
        for text in question.turns:
            messages.append({"role": "user", "content": text})
            prompt_ids = target.encode_prompt(list(messages))
            start = time.perf_counter()
            output = method.generate(prompt_ids, self.config.max_new_tokens, self.sampling)
            turns.append((prompt_ids, output, time.perf_counter() - start))
            # the next turn follows this method's own answer (Spec-Bench)
            messages.append({"role": "assistant", "content": target.decode(output.tokens)})
            advance()
        return turns

    def _rows(self, label: str, method: BenchMethod, question: Question, rounds: list[list[tuple]]) -> None:
        """One row per turn from a question's rounds: the first round's output and statistics, the
        median of the rounds' seconds; every later round's output is checked like the first."""
        for turn_index, (prompt_ids, output, _) in enumerate(rounds[0]):
            seconds = [turns[turn_index][2] for turns in rounds]
            row = self._row(label, method, question, turn_index + 1, prompt_ids, output, statistics.median(seconds))
            if len(seconds) > 1:
                row["seconds_per_round"] = seconds
            for later in rounds[1:]:
                if list(later[turn_index][1].tokens) != row["tokens"]:  # checked against the reference like the first
                    self._row(label, method, question, turn_index + 1, *later[turn_index])
            self.rows.append(row)

    def _row(self, label, method, question: Question, turn, prompt_ids, output: MethodOutput, seconds) -> dict:
        tokens = list(output.tokens)
        stats = output.stats
        if stats is not None:
            steps, step_tokens, tau = stats.steps, stats.step_tokens, (stats.tau if stats.steps else None)
        elif output.target_forwards:
            steps, step_tokens, tau = output.target_forwards, len(tokens), len(tokens) / output.target_forwards
        else:
            steps = step_tokens = tau = None
        row = dict(
            method=label, question_id=question.question_id, category=question.category,
            task_kind=question.task_kind, turn=turn, prompt_tokens=len(prompt_ids), num_tokens=len(tokens),
            seconds=seconds, tokens_per_s=len(tokens) / seconds if seconds > 0 else None, tau=tau,
            tau_steps=steps, tau_tokens=step_tokens, target_forwards=output.target_forwards,
            stats=stats.to_dict() if stats is not None else None, tokens=tokens,
            reference=self.reference_of[label], matches_plain=None, first_mismatch=None,
        )
        return self._check(row, method.exact)

    def _check(self, row: dict, exact: bool) -> dict:
        """Greedy: compare with the reference method's tokens for the same question and turn
        (`matches_plain`: plain decoding's for most methods, llama-plain's for llama-lookup)."""
        if not self.sampling.greedy:
            return row
        label, reference_label = row["method"], row["reference"]
        key = (label, row["question_id"], row["turn"])
        self.outputs.setdefault(key, row["tokens"])  # a method's first round: the answer its next turn follows
        if label == reference_label:
            if self.outputs[key] == row["tokens"]:
                row["matches_plain"] = True
                return row
            reference = self.outputs[key]  # a reference whose rounds disagree: compared with its own first
        else:
            reference = self.outputs.get((reference_label, row["question_id"], row["turn"]))
        if reference is None:
            return row
        position = _first_difference(reference, row["tokens"])
        row["matches_plain"] = position is None
        if position is None:
            return row
        row["first_mismatch"] = position
        expected = reference[position] if position < len(reference) else "<end>"
        got = row["tokens"][position] if position < len(row["tokens"]) else "<end>"
        self.mismatches.append(dict(method=label, reference=reference_label, question_id=row["question_id"],
                                    turn=row["turn"], position=position, plain=expected, got=got, exact=exact))
        level = "MISMATCH" if exact else f"WARNING (peer differs from {reference_label})"
        print(f"{level}: method {label!r} question {row['question_id']} ({row['category']}) turn {row['turn']}: "
              f"first difference at output position {position}: {reference_label} {expected} vs {got}", file=sys.stderr)
        return row


def _first_difference(expected: list[int], got: list[int]) -> int | None:
    for position, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return position
    return None if len(expected) == len(got) else min(len(expected), len(got))


class _progress:
    """A rich progress bar for one method (no-op when disabled); yields `advance()`."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total

    def __enter__(self):
        if not self.enabled:
            return lambda: None
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                            console=Console(stderr=True))
        self.bar.__enter__()
        task = self.bar.add_task(self.label, total=self.total)
        return lambda: self.bar.advance(task)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False
