"""Benchmark summary (per method x task kind), results.json, results.md and PNG plots.

Metrics (Spec-Bench):
  * tokens/s of a question = its generated tokens / its wall time, over all its turns; a task kind's
    tokens/s is the mean over its questions, "overall" the mean over every question;
  * speedup = a method's mean tokens/s / plain decoding's mean tokens/s in the SAME run
    (per task kind, and overall);
  * tau = tokens emitted per verify step, pooled over the questions (SpecStats: accepted + bonus);
    for peers, tokens per target forward (transformers forward calls, llama.cpp eval calls);
  * output check: each method's greedy output vs its reference's (plain decoding; for llama-lookup
    llama.cpp's own plain decoding), question by question and turn by turn.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

from .questions import TASK_KIND_TITLES
from ..files import open_output_dir
from ..stats import SpecStats

BASELINE = "plain"
OVERALL = "overall"
PLOT_FILES = ("speedup.png", "tau_histogram.png", "latency_split.png")


# ============================================================================ summary


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _question_speeds(rows: Sequence[dict]) -> dict[tuple, float]:
    """(task kind, question id) -> tokens/s over all turns of that question."""
    tokens: dict[tuple, int] = {}
    seconds: dict[tuple, float] = {}
    for row in rows:
        key = (row["task_kind"], row["question_id"])
        tokens[key] = tokens.get(key, 0) + row["num_tokens"]
        seconds[key] = seconds.get(key, 0.0) + row["seconds"]
    return {key: tokens[key] / seconds[key] for key in tokens if seconds[key] > 0}


def _draft_sizes(rows: Sequence[dict]) -> dict:
    """What was verified, pooled over rows with SpecStats: draft nodes per drafting step (the size
    --gamma or the cost model chose; a tree counts every node), the share of verify steps that
    drafted at all (the rest were plain decoding steps) and the deepest drafted position's mean."""
    stats = [row["stats"] for row in rows if row.get("stats")]
    steps = sum(s["steps"] for s in stats)
    drafting = sum((s["proposed_at_depth"] or [0])[0] for s in stats)  # steps that drafted depth 1
    nodes = sum(s["drafted_tokens"] for s in stats)
    depths = sum(sum(s["proposed_at_depth"]) for s in stats)  # sum over drafting steps of their depth
    return {
        "nodes_per_drafting_step": nodes / drafting if drafting else None,
        "depth_per_drafting_step": depths / drafting if drafting else None,
        "drafting_share": drafting / steps if steps else None,
    }


def _by_source(rows: Sequence[dict]) -> dict[str, list[int]]:
    """[accepted, drafted] nodes per source, pooled over the rows whose drafts name their sources
    (the hybrid drafter's sources, the auto drafter's methods)."""
    pooled: dict[str, list[int]] = {}
    for row in rows:
        stats = row.get("stats") or {}
        for name, drafted in stats.get("drafted_by_source", {}).items():
            counts = pooled.setdefault(name, [0, 0])
            counts[0] += stats.get("accepted_by_source", {}).get(name, 0)
            counts[1] += drafted
    return dict(sorted(pooled.items()))


def _cell(rows: Sequence[dict]) -> dict:
    """tokens/s (mean over questions), pooled tau and draft sizes of some rows of one method."""
    speeds = list(_question_speeds(rows).values())
    steps = [row["tau_steps"] for row in rows if row["tau_steps"]]
    step_tokens = [row["tau_tokens"] for row in rows if row["tau_steps"]]
    return {
        "questions": len({row["question_id"] for row in rows}),
        "tokens_per_s": _mean(speeds),
        "tau": sum(step_tokens) / sum(steps) if steps else None,
        "mean_new_tokens": _mean([row["num_tokens"] for row in rows]),
        "round_spread": _round_spread(rows),
        **_draft_sizes(rows),
        "by_source": _by_source(rows),
    }


def _round_spread(rows: Sequence[dict]) -> float | None:
    """With --repeats: the median over turns of (slowest round / fastest round), how far one timing
    of the same work moved on this machine during the run (1.0 = not at all)."""
    spreads = [max(row["seconds_per_round"]) / min(row["seconds_per_round"]) for row in rows
               if len(row.get("seconds_per_round") or ()) > 1 and min(row["seconds_per_round"]) > 0]
    return statistics.median(spreads) if spreads else None


def _latency_split(rows: Sequence[dict]) -> dict | None:
    """ms per generated token: draft / verify / other (from SpecStats timers), or total for peers."""
    generated = sum(row["num_tokens"] for row in rows)
    wall = sum(row["seconds"] for row in rows)
    if not generated:
        return None
    with_stats = [row["stats"] for row in rows if row["stats"] is not None]
    if len(with_stats) != len(rows):
        return {"total": 1000.0 * wall / generated}
    draft = sum(stats["time_draft_s"] for stats in with_stats)
    verify = sum(stats["time_verify_s"] for stats in with_stats)
    return {
        "draft": 1000.0 * draft / generated,
        "verify": 1000.0 * verify / generated,
        "other": 1000.0 * max(0.0, wall - draft - verify) / generated,
    }


def method_summary_rows(rows: Sequence[dict], methods: Sequence[dict], kinds: Sequence[str]) -> dict:
    """The summary table: per method, per task kind and overall, tokens/s, speedup vs plain and tau."""
    by_method: dict[str, list[dict]] = {}
    for row in rows:
        by_method.setdefault(row["method"], []).append(row)
    baseline_rows = by_method.get(BASELINE, [])
    baseline = {kind: _cell([r for r in baseline_rows if r["task_kind"] == kind]) for kind in kinds}
    baseline[OVERALL] = _cell(baseline_rows)
    summary: dict = {"baseline": BASELINE, "kinds": list(kinds), "methods": {}}
    for info in methods:
        label = info["label"]
        entry = {key: info[key] for key in ("status", "reason", "exact", "peer", "description")}
        entry["reference"] = info.get("reference", BASELINE)
        method_rows = by_method.get(label, [])
        if info["status"] == "ok":
            cells = {kind: _cell([r for r in method_rows if r["task_kind"] == kind]) for kind in kinds}
            cells[OVERALL] = _cell(method_rows)
            for kind, cell in cells.items():
                base = baseline[kind]["tokens_per_s"]
                mine = cell["tokens_per_s"]
                cell["speedup"] = mine / base if mine is not None and base else None
            histogram = SpecStats.combine(
                SpecStats.from_dict(r["stats"]) for r in method_rows if r["stats"] is not None
            ).tau_histogram
            entry.update(
                per_kind={kind: cells[kind] for kind in kinds},
                overall=cells[OVERALL],
                tau_histogram={str(k): v for k, v in sorted(histogram.items())},
                latency_ms_per_token=_latency_split(method_rows),
                checked=sum(1 for r in method_rows if r["matches_plain"] is not None),
                mismatches=sum(1 for r in method_rows if r["matches_plain"] is False),
            )
        summary["methods"][label] = entry
    return summary


# ============================================================================ markdown


def _format_cell(cell: dict) -> str:
    if cell["speedup"] is None:
        return "-"
    tau = "" if cell["tau"] is None else f" (τ {cell['tau']:.2f})"
    return f"{cell['speedup']:.2f}x{tau}"


def _output_check(label: str, entry: dict, greedy: bool) -> str:
    reference = entry["reference"]
    if label == reference:
        return "reference"
    if not greedy:
        return "not checked (sampling)"
    if entry["mismatches"]:
        verdict = "FAIL" if entry["exact"] else "warning"
        return f"{verdict}: {entry['mismatches']}/{entry['checked']} differ from {reference}"
    return f"= {reference} ({entry['checked']} outputs)"


def _speed_vs_own_reference(label: str, entry: dict, methods: dict) -> str | None:
    """'llama-lookup: 0.45x the tokens/s of llama-plain' for a method whose reference is not plain."""
    reference = methods.get(entry["reference"])
    if entry["reference"] in (label, BASELINE) or not reference or reference["status"] != "ok":
        return None
    mine, theirs = entry["overall"]["tokens_per_s"], reference["overall"]["tokens_per_s"]
    if mine is None or not theirs:
        return None
    return f"{label}: {mine / theirs:.2f}x the tokens/s of its reference {entry['reference']} (overall)."


def markdown_title(config: dict) -> str:
    """'specdec bench: TARGET (greedy, max N new tokens, Q questions: L per task kind[, median of R rounds], gamma G)'."""
    greedy = bool(config.get("equality_checked", True))
    sampling = "greedy" if greedy else f"temperature {config.get('temperature')}"
    limit = config.get("limit_per_kind")
    per_kind = "all questions" if limit is None else f"{limit} per task kind"
    repeats = config.get("repeats", 1)
    rounds = f", median of {repeats} rounds" if repeats > 1 else ""
    return (f"specdec bench: {config.get('target_name', '?')} ({sampling}, max {config.get('max_new_tokens')} new "
            f"tokens, {config.get('questions')} questions: {per_kind}{rounds}, gamma {config.get('gamma')})")


def markdown_table(summary: dict, config: dict, title: bool = True) -> str:
    """The run's tables (speedup and τ per task kind, tokens/s, the output check, draft sizes),
    under a `## markdown_title` heading unless title=False."""
    kinds = summary["kinds"]
    greedy = bool(config.get("equality_checked", True))
    lines = [f"## {markdown_title(config)}", ""] if title else []
    lines += [
        "Speedup vs specdec plain decoding in the same run (mean tokens/s per question), τ in parentheses.",
        "",
        "| method | " + " | ".join(TASK_KIND_TITLES[k] for k in kinds) + " | Overall | tokens/s | output vs reference |",
        "|---|" + "---|" * (len(kinds) + 3),
    ]
    notes, own_speed = [], []
    for label, entry in summary["methods"].items():
        if entry["status"] != "ok":
            lines.append(f"| {label} | " + " | ".join("n/a" for _ in kinds) + f" | n/a | n/a | {entry['status']}: {entry['reason']} |")
            continue
        cells = [_format_cell(entry["per_kind"][k]) for k in kinds] + [_format_cell(entry["overall"])]
        speed = entry["overall"]["tokens_per_s"]
        speed_text = "-" if speed is None else f"{speed:.2f}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {speed_text} | {_output_check(label, entry, greedy)} |")
        if entry["peer"]:
            notes.append(label)
        own_speed.append(_speed_vs_own_reference(label, entry, summary["methods"]))
    lines.append("")
    lines.append("τ = mean tokens per verify step (accepted draft tokens + the bonus/correction token).")
    spreads = {label: entry["overall"]["round_spread"] for label, entry in summary["methods"].items()
               if entry["status"] == "ok" and entry["overall"].get("round_spread")}
    if spreads:
        lines.append("How far the same work's time moved between rounds (median over turns of slowest / fastest round; "
                     "differences between methods smaller than this are not measured): "
                     + ", ".join(f"{label} {spread:.2f}x" for label, spread in spreads.items()) + ".")
    lines.extend(_draft_size_table(summary))
    lines.extend(_source_table(summary))
    if notes:
        lines.append(f"For peers ({', '.join(notes)}) τ = tokens per target forward (a transformers forward call, a "
                     "llama.cpp eval call; vLLM's from its spec-decode counters: tokens / (tokens - accepted)); a peer's output differing from its reference is a warning only (another "
                     "library's arithmetic).")
    lines.extend(note for note in own_speed if note)
    return "\n".join(lines)


def _format_size(cell: dict) -> str:
    if cell.get("drafting_share") is None:
        return "-"
    if not cell["drafting_share"]:
        return "0 (no drafts)"
    return (f"{cell['nodes_per_drafting_step']:.1f} / {cell['depth_per_drafting_step']:.1f} "
            f"({100 * cell['drafting_share']:.0f} %)")


def _draft_size_table(summary: dict) -> list[str]:
    """Per method and task kind: draft nodes / depth per drafting step and the share of steps that drafted."""
    kinds = summary["kinds"]
    drafted = {label: entry for label, entry in summary["methods"].items()
               if entry["status"] == "ok" and entry["overall"].get("drafting_share")}
    if not drafted:
        return []
    lines = [
        "",
        "What was verified: draft nodes / depth per drafting step (a tree counts every node; --gamma or the cost "
        "model chose them) and, in parentheses, the share of verify steps that drafted at all.",
        "",
        "| method | " + " | ".join(TASK_KIND_TITLES[k] for k in kinds) + " | Overall |",
        "|---|" + "---|" * (len(kinds) + 1),
    ]
    for label, entry in drafted.items():
        cells = [_format_size(entry["per_kind"][k]) for k in kinds] + [_format_size(entry["overall"])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines + [""]  # a blank line ends the table before any note


def _source_table(summary: dict) -> list[str]:
    """Per method whose nodes name their source (hybrid, auto) and task kind: accepted / drafted nodes per source."""
    kinds = summary["kinds"]
    credited = {label: entry for label, entry in summary["methods"].items()
                if entry["status"] == "ok" and entry["overall"].get("by_source")}
    if not credited:
        return []
    lines = [
        "",
        "Which source drafted what (the hybrid's sources, the methods auto chose): accepted / drafted nodes.",
        "",
        "| method | " + " | ".join(TASK_KIND_TITLES[k] for k in kinds) + " | Overall |",
        "|---|" + "---|" * (len(kinds) + 1),
    ]
    for label, entry in credited.items():
        cells = [entry["per_kind"][k].get("by_source") for k in kinds] + [entry["overall"]["by_source"]]
        text = [", ".join(f"{name} {a}/{d}" for name, (a, d) in cell.items()) if cell else "-" for cell in cells]
        lines.append(f"| {label} | " + " | ".join(text) + " |")
    return lines + [""]


# ============================================================================ plots


def _plot_speedup(summary: dict, path: Path, plt) -> None:
    ok = {label: e for label, e in summary["methods"].items() if e["status"] == "ok"}
    groups = summary["kinds"] + [OVERALL]
    titles = [TASK_KIND_TITLES.get(k, "Overall").replace(" ", "\n", 1) for k in groups]
    width = 0.8 / max(1, len(ok))
    figure, axes = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.5))
    for index, (label, entry) in enumerate(ok.items()):
        cells = [entry["per_kind"][k] if k != OVERALL else entry["overall"] for k in groups]
        values = [c["speedup"] if c["speedup"] is not None else math.nan for c in cells]
        axes.bar([g + (index - (len(ok) - 1) / 2) * width for g in range(len(groups))], values, width, label=label)
    axes.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    axes.set_xticks(range(len(groups)), titles, fontsize=8)
    axes.set_ylabel("speedup vs plain decoding")
    axes.set_title("Speedup per task kind")
    axes.legend(fontsize=7, ncol=min(4, max(1, len(ok))))
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_tau_histogram(summary: dict, path: Path, plt) -> None:
    with_hist = {label: e["tau_histogram"] for label, e in summary["methods"].items()
                 if e["status"] == "ok" and e.get("tau_histogram")}
    figure, axes = plt.subplots(figsize=(8, 4.5))
    if with_hist:
        largest = max(int(k) for hist in with_hist.values() for k in hist)
        width = 0.8 / len(with_hist)
        for index, (label, hist) in enumerate(with_hist.items()):
            total = sum(hist.values())
            fractions = [hist.get(str(k), 0) / total for k in range(1, largest + 1)]
            axes.bar([k + (index - (len(with_hist) - 1) / 2) * width for k in range(1, largest + 1)], fractions,
                     width, label=label)
        axes.set_xticks(range(1, largest + 1))
        axes.legend(fontsize=7)
    else:
        axes.text(0.5, 0.5, "no speculative statistics", ha="center", va="center", transform=axes.transAxes)
    axes.set_xlabel("tokens emitted per verify step (τ of the step)")
    axes.set_ylabel("fraction of steps")
    axes.set_title("τ histogram per method")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def _plot_latency_split(summary: dict, path: Path, plt) -> None:
    splits = {label: e["latency_ms_per_token"] for label, e in summary["methods"].items()
              if e["status"] == "ok" and e.get("latency_ms_per_token")}
    figure, axes = plt.subplots(figsize=(max(6, 1.1 * len(splits) + 2), 4.5))
    labels = list(splits)
    bottoms = [0.0] * len(labels)
    # T_draft / T_verify / other for specdec methods; peers have one unsplit total
    for part, colour in (("draft", "tab:orange"), ("verify", "tab:blue"), ("other", "tab:gray"), ("total", "tab:purple")):
        values = [splits[label].get(part, 0.0) for label in labels]
        if any(values):
            name = "total (not split)" if part == "total" else f"T_{part}" if part != "other" else "other"
            axes.bar(range(len(labels)), values, 0.6, bottom=bottoms, label=name, color=colour)
            bottoms = [b + v for b, v in zip(bottoms, values)]
    axes.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
    axes.set_ylabel("ms per generated token")
    axes.set_title("Latency split per method")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def write_plots(summary: dict, out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    paths = [out_dir / name for name in PLOT_FILES]
    for plot, path in zip((_plot_speedup, _plot_tau_histogram, _plot_latency_split), paths):
        plot(summary, path, plt)
    return paths


# ============================================================================ files


def write_reports(out_dir: Path, config: dict, rows: list[dict], methods: list[dict], summary: dict,
                  mismatches: list[dict]) -> str:
    """results.json, results.md and the plots in `out_dir`; returns the Markdown text."""
    out_dir = open_output_dir(out_dir, "bench")
    document = {"config": config, "methods": methods, "summary": summary, "mismatches": mismatches, "rows": rows}
    (out_dir / "results.json").write_text(json.dumps(document, indent=1, default=str))
    markdown = markdown_table(summary, config)
    if mismatches:
        markdown += "\n\nOutputs that differ from their reference (first differing output position):\n\n"
        markdown += "\n".join(
            f"- {'FAIL' if m['exact'] else 'warning'}: {m['method']} question {m['question_id']} turn {m['turn']} "
            f"position {m['position']}: {m.get('reference', BASELINE)} {m['plain']} vs {m['got']}" for m in mismatches
        )
    (out_dir / "results.md").write_text(markdown + "\n")
    write_plots(summary, out_dir)
    return markdown
