"""Spec-Bench questions: loading the jsonl, grouping categories into task kinds, picking a subset.

Format (one JSON object per line, as in Spec-Bench / MT-bench):
    {"question_id": 81, "category": "writing", "turns": ["first user turn", "second user turn"]}

Spec-Bench reports six task kinds. The eight MT-bench categories together form the
"multi-turn conversation" kind (their questions have two turns); the other kinds are one
category each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MULTI_TURN = "multi_turn"
MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")

# category -> task kind (a table, not an if/elif chain)
TASK_KIND_OF_CATEGORY: dict[str, str] = {
    **{category: MULTI_TURN for category in MT_BENCH_CATEGORIES},
    "translation": "translation",
    "summarization": "summarization",
    "qa": "qa",
    "math_reasoning": "math_reasoning",
    "rag": "rag",
}

# task kind -> column title (Spec-Bench's order)
TASK_KIND_TITLES: dict[str, str] = {
    MULTI_TURN: "Multi-turn Conversation",
    "translation": "Translation",
    "summarization": "Summarization",
    "qa": "QA",
    "math_reasoning": "Math Reasoning",
    "rag": "RAG",
}
TASK_KINDS: tuple[str, ...] = tuple(TASK_KIND_TITLES)


@dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: tuple[str, ...]  # user turns; turn i+1 is asked after the model's own answer to turn i

    @property
    def task_kind(self) -> str:
        return TASK_KIND_OF_CATEGORY[self.category]


def default_questions_path() -> Path:
    """The development set shipped as package data: 240 Spec-Bench questions, half of every
    category (licence and attribution in data/NOTICE). `--questions FILE` reads any other."""
    return Path(__file__).parent / "data" / "questions.jsonl"


def load_questions(path: str | Path) -> list[Question]:
    """Read a Spec-Bench jsonl file; every line needs question_id, a known category and >= 1 turn."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"questions file {path} not found (pass --questions PATH to a Spec-Bench jsonl)")
    questions = []
    for line_number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}: not JSON ({error})") from None
        missing = [key for key in ("question_id", "category", "turns") if key not in record]
        if missing:
            raise ValueError(f"{where}: missing {missing}; each line needs question_id, category, turns")
        category = record["category"]
        if category not in TASK_KIND_OF_CATEGORY:
            raise ValueError(f"{where}: unknown category {category!r}; allowed: {', '.join(TASK_KIND_OF_CATEGORY)}")
        turns = record["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise ValueError(f"{where}: turns must be a non-empty list of non-empty strings")
        questions.append(Question(record["question_id"], category, tuple(turns)))
    if not questions:
        raise ValueError(f"{path} holds no questions")
    return questions


def select_questions(
    questions: Sequence[Question], limit_per_kind: int | None = None, kinds: Sequence[str] | None = None
) -> list[Question]:
    """The first `limit_per_kind` questions of each task kind (None = all), grouped by kind in
    Spec-Bench's order. Within the multi-turn kind the pick goes round-robin over the MT-bench
    categories (writing, roleplay, reasoning, ...), so a small limit still mixes categories."""
    if limit_per_kind is not None and limit_per_kind < 1:
        raise ValueError(f"limit per task kind must be >= 1 (or None for all), got {limit_per_kind}")
    wanted = list(kinds) if kinds else list(TASK_KINDS)
    unknown = [kind for kind in wanted if kind not in TASK_KIND_TITLES]
    if unknown:
        raise ValueError(f"unknown task kind(s) {unknown}; allowed: {', '.join(TASK_KINDS)}")
    selected: list[Question] = []
    for kind in TASK_KINDS:
        if kind not in wanted:
            continue
        of_kind = _round_robin_by_category([q for q in questions if q.task_kind == kind])
        selected.extend(of_kind if limit_per_kind is None else of_kind[:limit_per_kind])
    if not selected:
        raise ValueError(f"no questions of task kind(s) {wanted} in the questions file")
    return selected


def _round_robin_by_category(questions: list[Question]) -> list[Question]:
    """Interleave categories (first of each, then second of each, ...) keeping file order inside each."""
    by_category: dict[str, list[Question]] = {}
    for question in questions:
        by_category.setdefault(question.category, []).append(question)
    queues = list(by_category.values())
    ordered = []
    for index in range(max((len(q) for q in queues), default=0)):
        ordered.extend(queue[index] for queue in queues if index < len(queue))
    return ordered
