"""Prompts over a given text: translate it, summarise it, answer from passages (retrieval-style)."""

from __future__ import annotations

import random

from .passages import (FIRST_NAMES, TOWNS, WEEKDAYS, Passage, any_passage, news_passage, passage_sentences,
                       reference_passage)

TARGET_LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Dutch", "Polish", "Russian", "Chinese",
                    "Japanese", "Korean", "Arabic", "Turkish", "Swedish", "Hindi", "Vietnamese")
TRANSLATE_TEMPLATES = (
    "Translate English to {language}: {text}", "Translate the following text into {language}:\n\n{text}",
    "How would you say this in {language}? \"{text}\"", "Please translate into {language}, keeping the tone: {text}",
    "Give the {language} translation of: {text}", "Translate to {language} and explain any tricky words:\n\n{text}",
)
SUBJECTS = ("My neighbour", "The new teacher", "Our team", "My little brother", "The old fisherman", "The mayor",
            "A tourist from abroad", "The nurse on night duty", "Her grandparents", "The bus driver", "Everyone at the party")
ACTIONS = ("bought fresh bread at the market", "missed the last train home", "planted tomatoes in the garden",
           "finished the report just before the deadline", "found a lost dog near the station",
           "cooked dinner for twelve people", "learned to swim at the age of sixty", "forgot the keys at the office",
           "painted the kitchen a bright yellow", "won a prize at the village fair", "waited an hour for the doctor",
           "read three books during the holiday", "fixed the broken bicycle", "sang at the wedding")
WHEN = ("yesterday", "last week", "on {weekday} morning", "before the storm", "after work", "during the summer",
        "in {town}", "while it was raining", "for the first time", "without telling anyone")
FOLLOW_UPS = ("", " Nobody had expected it.", " It was a long day.", " Everyone laughed about it later.",
              " The weather was perfect.", " We will talk about it tomorrow.", " I am still surprised.")


def everyday_text(rng: random.Random) -> str:
    when = rng.choice(WHEN).format(weekday=rng.choice(WEEKDAYS), town=rng.choice(TOWNS))
    text = f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {when}.{rng.choice(FOLLOW_UPS)}"
    if rng.random() < 0.3:
        text += f" {rng.choice(FIRST_NAMES)} says it was {rng.choice(('wonderful', 'exhausting', 'a mistake', 'worth it'))}."
    return text


def translation_prompt(rng: random.Random) -> str:
    draw = rng.random()
    if draw < 0.45:
        text = everyday_text(rng)
    else:  # one to three consecutive sentences of a reference section or a news article
        passage = reference_passage(rng, 200, 1200) if draw < 0.75 else news_passage(rng)
        sentences = passage_sentences(passage)
        if not sentences:
            text = everyday_text(rng)
        else:
            start = rng.randrange(len(sentences))
            text = " ".join(sentences[start : start + rng.randint(1, 3)])
    return rng.choice(TRANSLATE_TEMPLATES).format(language=rng.choice(TARGET_LANGUAGES), text=text)


SUMMARY_TEMPLATES = (
    "Summarize: {text}", "Summarise the following text in two or three sentences.\n\n{text}",
    "{text}\n\nWrite a one-paragraph summary of the text above.", "Give me the key points of this as a bulleted list:\n\n{text}",
    "Write a headline and a one-sentence summary for this:\n\n{text}",
    "Summarise this for {audience}:\n\n{text}", "TL;DR of the following, please:\n\n{text}",
    "Read this and tell me the three most important points:\n\n{text}", "{text}\n\nSummarize the above in one sentence.",
    "Can you shorten this to about a third of its length without losing the key facts?\n\n{text}",
)
SUMMARY_AUDIENCES = ("a busy reader", "a child", "someone new to the subject", "a newsletter", "a manager",
                     "a slide in a presentation")


def summarization_task(rng: random.Random) -> tuple[Passage, str]:
    """(passage, prompt): a summary request around a reference window (1,200-4,000 characters) or a news article."""
    passage = reference_passage(rng, 1200, 4000) if rng.random() < 0.5 else news_passage(rng)
    return passage, rng.choice(SUMMARY_TEMPLATES).format(text=passage.text, audience=rng.choice(SUMMARY_AUDIENCES))


def summarization_prompt(rng: random.Random) -> str:
    return summarization_task(rng)[1]


TITLE_QUESTIONS = ("What do the passages say about {title}?", "According to the text, how does {title} work?",
                   "Explain {title} using only the information given.", "What rules for {title} does the text describe?",
                   "Which details about {title} are mentioned above?")
RAG_LAYOUTS = (
    "Answer the question using only the passages below.\n\n{passages}\n\nQuestion: {question}",
    "{passages}\n\nBased on the passages above, {question_lower}",
    "Here are some documents:\n\n{passages}\n\n{question} Cite the passage you used.",
    "Context:\n{passages}\n\nUsing the context, answer: {question} If the context does not say, say so.",
)


def rag_task(rng: random.Random) -> tuple[list[Passage], Passage, str, str]:
    """(passages, the one asked about, question, prompt): 2-4 passages and a question about one of them."""
    passages = [any_passage(rng, 300, 1000) for _ in range(rng.randint(2, 4))]
    gold = rng.choice(passages)
    if gold.questions:
        question = rng.choice(gold.questions)
    else:
        question = rng.choice(TITLE_QUESTIONS).format(title=gold.title)
    blocks = "\n\n".join(f"Passage {i + 1} ({p.title}):\n{p.text}" for i, p in enumerate(passages))
    layout = rng.choice(RAG_LAYOUTS)
    prompt = layout.format(passages=blocks, question=question, question_lower=question[0].lower() + question[1:])
    return passages, gold, question, prompt


def rag_prompt(rng: random.Random) -> str:
    return rag_task(rng)[3]

