"""Prompt kinds with an unbounded supply: the task kinds users send (those Spec-Bench reports:
conversation, translation, summarisation, QA, maths, answering from given passages) plus code.

A kind is a function from a random generator to one user message; `specdec.train.prompts`
mixes kinds and keeps the prompts distinct. None of them reads the Spec-Bench questions (the
`sharegpt` kind, real user turns from an installed package, reads them only to leave them out).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .chat import code_prompt, conversation_prompt, qa_prompt
from .maths import maths_prompt
from .reading import rag_prompt, summarization_prompt, translation_prompt
from .. import sharegpt as sharegpt_source
from . import sharegpt

PROJECT_LICENCE = "same as specdec (project code)"
PSF_AND_PROJECT = ("templates: same as specdec (project code); passages from the Python language reference "
                   "(pydoc_data.topics): Python Software Foundation License (PSF-2.0)")


@dataclass(frozen=True)
class PromptKind:
    name: str
    description: str
    licence: str
    make: Callable[[random.Random], str]  # one user message from the generator's next draws
    prepare: Callable[[], None] | None = None  # reads what the kind needs (a clear error when missing), before a job writes


KINDS: dict[str, PromptKind] = {
    kind.name: kind
    for kind in (
        PromptKind("conversation", "writing, role-play, discussion, rewriting, reasoning and extraction requests from "
                   "templates x topics", PROJECT_LICENCE, conversation_prompt),
        PromptKind("translation", "English sentences (everyday templates, the Python reference, template news) into one "
                   "of 16 languages", PSF_AND_PROJECT, translation_prompt),
        PromptKind("summarization", "summarise a given passage (Python reference sections, template news articles)",
                   PSF_AND_PROJECT, summarization_prompt),
        PromptKind("qa", "factual questions from templates x entity lists (countries, elements, animals, events, ...)",
                   PROJECT_LICENCE, qa_prompt),
        PromptKind("math", "word problems and arithmetic with random numbers", PROJECT_LICENCE, maths_prompt),
        PromptKind("rag", "2-4 given passages and a question one of them answers", PSF_AND_PROJECT, rag_prompt),
        PromptKind("code", "programming requests: task x language x template", PROJECT_LICENCE, code_prompt),
        PromptKind(sharegpt_source.SOURCE_NAME, f"first user turns of ShareGPT V3 conversations (the "
                   f"{sharegpt_source.PACKAGE} package; up to {sharegpt.MAX_PROMPT_CHARS} characters, none a Spec-Bench "
                   "question)", sharegpt_source.package_licence(), sharegpt.sharegpt_prompt, sharegpt.prepare),
    )
}
