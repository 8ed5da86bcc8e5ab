"""Passages for the summarisation, retrieval (answer from given passages) and translation kinds.

Two local sources, both available wherever Python runs, no network:

* the Python language reference as `pydoc` ships it (`pydoc_data.topics`, PSF licence), cut into
  sections (a heading and its prose paragraphs; grammar and code blocks dropped);
* short local-news articles composed from templates written for specdec (fictional towns and
  people, random numbers), each with questions its text answers.

Windows of consecutive paragraphs at a random start and length make many distinct passages out
of one section; which one a prompt gets is decided by the prompt's own random generator.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass

HEADING_UNDERLINE = re.compile(r"^[*=\-~^]{3,}$")


@dataclass(frozen=True)
class Passage:
    title: str
    text: str  # paragraphs separated by blank lines
    questions: tuple[str, ...] = ()  # questions the text answers (empty: ask about the title)


@dataclass(frozen=True)
class Section:
    title: str
    paragraphs: tuple[str, ...]


def _is_prose(paragraph: str) -> bool:
    letters = sum(ch.isalpha() or ch.isspace() for ch in paragraph)
    return len(paragraph) >= 60 and letters >= 0.75 * len(paragraph) and "::=" not in paragraph and ">>>" not in paragraph


@functools.cache
def python_reference_sections() -> tuple[Section, ...]:
    """The language reference's sections (heading + prose paragraphs, wrapped lines joined)."""
    import pydoc_data.topics

    sections: list[Section] = []
    for topic in pydoc_data.topics.topics.values():
        title, paragraphs = None, []
        for block in topic.split("\n\n"):
            lines = [line for line in block.split("\n") if line.strip()]
            if len(lines) >= 2 and HEADING_UNDERLINE.match(lines[-1].strip()):  # a heading starts a section
                if title and paragraphs:
                    sections.append(Section(title, tuple(paragraphs)))
                title, paragraphs = " ".join(line.strip() for line in lines[:-1]), []
                continue
            if not lines or all(line.startswith("   ") for line in lines):  # code, grammar, indented examples
                continue
            text = " ".join(line.strip() for line in lines)
            if _is_prose(text):
                paragraphs.append(text)
        if title and paragraphs:
            sections.append(Section(title, tuple(paragraphs)))
    return tuple(sections)


def reference_passage(rng: random.Random, min_chars: int, max_chars: int) -> Passage:
    """Consecutive paragraphs of one reference section, about min_chars..max_chars long."""
    sections = python_reference_sections()
    while True:
        section = rng.choice(sections)
        if sum(len(p) for p in section.paragraphs) < min_chars:
            continue  # too short for this window: another section
        want = rng.randint(min_chars, max_chars)
        start = rng.randrange(len(section.paragraphs))
        while start > 0 and sum(len(p) for p in section.paragraphs[start:]) < min_chars:
            start -= 1
        chosen: list[str] = []
        for paragraph in section.paragraphs[start:]:
            so_far = sum(len(p) for p in chosen)
            if so_far >= min_chars and so_far + len(paragraph) > want + 200:
                break
            chosen.append(paragraph)
            if sum(len(p) for p in chosen) >= want:
                break
        return Passage(section.title, "\n\n".join(chosen))


# ----------------------------------------------------------------------------- template news
TOWNS = ("Millbrook", "Ashford Vale", "Kingsmere", "Oakridge", "Port Elwin", "Harrowgate", "Dunmore", "Westhaven",
         "Brackenfield", "Lindale", "Stonebridge", "Marlow Cross", "Fernhill", "Eastcombe", "Redwater", "Thornbury")
FIRST_NAMES = ("Maria", "James", "Aisha", "Tomasz", "Chen", "Olivia", "Rahul", "Sofia", "Daniel", "Amara", "Lukas",
               "Yuki", "Fatima", "George", "Elena", "Samuel", "Priya", "Noah", "Ingrid", "Mateo", "Hannah", "Kwame")
LAST_NAMES = ("Okafor", "Lindqvist", "Patel", "Moreau", "Kowalski", "Nakamura", "Garcia", "O'Brien", "Schmidt", "Haddad",
              "Rossi", "Mensah", "Novak", "Fischer", "Alvarez", "Campbell", "Ibrahim", "Larsen", "Dubois", "Tanaka")
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = ("January", "February", "March", "April", "May", "June", "July", "August", "September", "October", "November",
          "December")
PROJECTS = ("a new footbridge over the river", "a public swimming pool", "a cycle path to the railway station",
            "the restoration of the old market hall", "a community solar farm", "a new primary school",
            "a flood barrier along the harbour", "a covered farmers' market", "a youth sports centre")
BUSINESSES = ("bakery chain", "bicycle maker", "software company", "furniture workshop", "brewery", "battery recycler",
              "organic dairy", "shipping firm", "textile mill")
EVENTS = ("music festival", "food fair", "half marathon", "book festival", "science fair", "kite-flying contest",
          "classic car show", "open-air theatre season")


def person(rng: random.Random) -> str:
    return f"{rng.choice(FIRST_NAMES)} {rng.choice(LAST_NAMES)}"


def _council_story(rng: random.Random) -> Passage:
    town, project, mayor, critic = rng.choice(TOWNS), rng.choice(PROJECTS), person(rng), person(rng)
    cost, votes_for, votes_against = rng.randint(2, 95) / 10, rng.randint(7, 15), rng.randint(1, 6)
    year, month = rng.randint(2026, 2031), rng.choice(MONTHS)
    paragraphs = [
        f"{town} council voted {votes_for} to {votes_against} on {rng.choice(WEEKDAYS)} evening to approve {project}, "
        f"ending a debate that had divided residents for {rng.randint(2, 9)} years.",
        f"The project is expected to cost {cost:.1f} million pounds, of which "
        f"{rng.randint(20, 80)} percent will come from a regional grant. Work is due to start in {month} {year}.",
        f"Mayor {mayor} said the decision was \"{rng.choice(('long overdue', 'a good day for the town', 'the fairest compromise on the table'))}\" "
        "and promised that local firms would be invited to bid for the contracts.",
        f"Not everyone is convinced. {critic}, who leads a residents' group, warned that "
        f"{rng.choice(('the budget was likely to rise', 'parking near the site would become impossible', 'older residents had not been consulted'))} "
        f"and said the group would {rng.choice(('ask for an independent review', 'keep campaigning', 'watch the spending closely'))}.",
        f"A public meeting about the plans will be held at the town library on {rng.choice(WEEKDAYS)}, "
        f"{rng.randint(1, 28)} {rng.choice(MONTHS)}, at {rng.randint(5, 8)} pm.",
    ]
    questions = (f"How much is the project in {town} expected to cost?", "How did the council vote?",
                 "Who leads the residents' group, and what did they warn about?", "When is work due to start?")
    return Passage(f"{town} approves {project.split(' ', 1)[1]}", "\n\n".join(paragraphs), questions)


def _business_story(rng: random.Random) -> Passage:
    town, business, founder = rng.choice(TOWNS), rng.choice(BUSINESSES), person(rng)
    jobs, founded, investment = rng.randint(12, 400), rng.randint(1952, 2019), rng.randint(3, 60)
    paragraphs = [
        f"A {business} founded in {town} in {founded} will open a second site on the edge of the town, "
        f"creating {jobs} jobs over the next {rng.randint(2, 5)} years.",
        f"The company, which now employs {rng.randint(20, 900)} people, said it would invest {investment} million pounds in the "
        f"new building and its equipment. Its sales grew by {rng.randint(4, 60)} percent last year.",
        f"Chief executive {founder} said demand had \"{rng.choice(('outgrown our old workshop', 'doubled since the pandemic', 'surprised even us'))}\". "
        f"The firm plans to {rng.choice(('train apprentices from the local college', 'run its machines on solar power', 'open a visitor centre'))}.",
        f"Local business leaders welcomed the news, although {rng.choice(('some neighbours', 'the farmers next to the site', 'a cycling group'))} "
        f"raised concerns about {rng.choice(('lorry traffic', 'noise at night', 'the loss of green fields'))}.",
    ]
    questions = ("How many jobs will the new site create?", "Who is the chief executive, and what did they say?",
                 "How much will the company invest?", "What concerns were raised about the plans?")
    return Passage(f"{business.capitalize()} to expand in {town}", "\n\n".join(paragraphs), questions)


def _event_story(rng: random.Random) -> Passage:
    town, event, organiser = rng.choice(TOWNS), rng.choice(EVENTS), person(rng)
    visitors, edition, price = rng.randint(800, 45000), rng.randint(2, 40), rng.randint(3, 60)
    paragraphs = [
        f"The {edition}th {town} {event} drew about {visitors:,} visitors over the weekend, "
        f"{rng.choice(('a record for the event', 'slightly fewer than last year', 'despite heavy rain on Saturday'))}.",
        f"Tickets cost {price} pounds for adults, and children under {rng.randint(5, 16)} went free. "
        f"Organiser {organiser} said {rng.randint(40, 400)} volunteers had helped to run it.",
        f"Highlights included {rng.choice(('a performance by a local youth choir', 'a parade through the old town', 'a competition for home-made cakes', 'a talk by a retired astronaut'))} "
        f"and {rng.choice(('fireworks over the harbour', 'a charity auction', 'workshops for children', 'a late-night lantern walk'))}.",
        f"Money raised will go to {rng.choice(('the local hospice', 'the town food bank', 'repairs to the church roof', 'the primary school library'))}; "
        f"the organisers expect to announce the total in {rng.choice(MONTHS)}.",
    ]
    questions = ("How many people visited the event?", "How much did adult tickets cost?",
                 "Who organised the event and how many volunteers helped?", "Where will the money raised go?")
    return Passage(f"{town} {event} draws crowds", "\n\n".join(paragraphs), questions)


NEWS_STORIES = (_council_story, _business_story, _event_story)


def news_passage(rng: random.Random) -> Passage:
    return rng.choice(NEWS_STORIES)(rng)


def any_passage(rng: random.Random, min_chars: int, max_chars: int) -> Passage:
    """A reference window (2 in 3) or a news article."""
    return reference_passage(rng, min_chars, max_chars) if rng.random() < 2 / 3 else news_passage(rng)


SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"])")


def passage_sentences(passage: Passage, min_chars: int = 30, max_chars: int = 240) -> list[str]:
    """The prose sentences of a passage (no code-like ones), for translation prompts."""
    sentences = [s.strip() for paragraph in passage.text.split("\n\n") for s in SENTENCE_END.split(paragraph)]
    return [s for s in sentences if min_chars <= len(s) <= max_chars and not re.search(r"[()\[\]{}=_*]|\"\w+\.", s)]
