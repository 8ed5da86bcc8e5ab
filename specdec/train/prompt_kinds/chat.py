"""Conversation openers, factual questions and programming requests from templates x word banks.

Every prompt is a few random choices from these tables, so the number of distinct prompts is the
product of the table sizes (tens of thousands per kind at least; see tests/test_prompts.py).
"""

from __future__ import annotations

import random

from .passages import FIRST_NAMES, TOWNS, person

TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "machine learning", "volcanoes",
    "the immune system", "climate change", "the printing press", "prime numbers", "supply and demand", "plate tectonics",
    "the Roman Empire", "electric cars", "vaccines", "the water cycle", "jazz music", "renewable energy",
    "the stock market", "DNA", "honey bees", "the internet", "coffee", "the Moon landing", "sleep", "rainforests",
    "democracy", "gravity", "the Olympic Games", "recycling", "chess", "bread baking", "the human heart", "earthquakes",
    "public libraries", "solar panels", "ancient Egypt", "time zones", "friendship", "inflation", "remote work",
    "urban gardening", "the Silk Road", "quantum computing", "bird migration", "minimalism", "social media",
    "the Renaissance", "volunteering", "space tourism", "coral reefs", "learning a second language", "public transport",
    "the history of football", "artificial sweeteners", "the gig economy", "mountain climbing", "antibiotics",
    "classical music", "fast fashion", "the Industrial Revolution", "video games", "meditation", "tea ceremonies",
    "wind turbines", "the Great Wall of China", "board games", "nuclear fusion", "street food", "habits",
)
AUDIENCES = ("a ten-year-old", "a busy manager", "a first-year university student", "my grandmother", "a tourist",
             "a room of engineers", "a high-school class", "someone who has never heard of it")
WRITING_FORMS = ("a short story", "a poem", "a blog post", "a persuasive essay", "a product description",
                 "a speech for a school assembly", "a diary entry", "a newspaper opinion column", "a limerick",
                 "a podcast introduction", "a short play scene", "a letter to the editor")
CONSTRAINTS = ("", " Keep it under 150 words.", " Use a hopeful tone.", " Make it funny.", " Use simple words.",
               " End with a question for the reader.", " Use exactly three paragraphs.", " Write it in the first person.",
               " Include one surprising fact.", " Avoid jargon.")
EMAIL_PURPOSES = ("asking for feedback on a report", "declining a meeting politely", "proposing a new weekly schedule",
                  "thanking a team for finishing a project", "requesting a day off", "introducing a new colleague",
                  "apologising for a late delivery", "inviting neighbours to a street party")
RECIPIENTS = ("your manager", "a client", "your landlord", "a former teacher", "the whole team", "a supplier")
ROLES = ("a ship's captain in the 1800s", "a museum guide", "a personal trainer", "a medieval blacksmith", "a detective",
         "a travel agent", "a chef in a busy restaurant", "an astronaut on the space station", "a kind librarian",
         "a startup founder pitching to investors", "a park ranger", "a history teacher", "a job interviewer")
ROLE_TASKS = ("Introduce yourself and describe a typical day.", "Answer my question: what should I do first?",
              "Give me advice about {topic}.", "Tell me about the hardest decision you have made.",
              "Convince me to try something new.", "Describe your workplace to a visitor.")
DISCUSSION = (
    "Explain {topic} to {audience}.", "What are the pros and cons of {topic}?", "Give three interesting facts about {topic}.",
    "What is a common misconception about {topic}? Explain why it is wrong.",
    "Compare {topic} and {other}: what do they have in common?", "How has {topic} changed over the last fifty years?",
    "Write five questions a student might ask about {topic}, with short answers.",
    "Describe {topic} in exactly three sentences.", "What would the world look like without {topic}?",
    "Summarise the history of {topic} for {audience}.", "Plan a one-hour lesson about {topic} for {audience}.",
)
REWRITE_STYLES = ("more formal", "friendlier", "shorter", "clearer for a child", "more persuasive", "into bullet points")
DRAFTS = (
    "hi all, meeting moved to {day} because {name} is off, pls bring the {thing} numbers, thx",
    "We regret to inform you that your order of {count} {thing} has been delayed due to unforeseen circumstances.",
    "{name} has been with us for {count} years and honestly we couldn't have done the {thing} project without them.",
    "The {town} office will be closed on {day}. Anyone who needs the {thing} files should download them before then.",
)
THINGS = ("budget", "chairs", "sales", "website", "marketing", "laptops", "training", "garden", "warehouse")
DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday")


def _reasoning(rng: random.Random) -> str:
    people = rng.sample(FIRST_NAMES, rng.randint(3, 5))
    relation = rng.choice((("taller", "shortest", "tallest"), ("older", "youngest", "oldest"), ("faster", "slowest", "fastest")))
    facts = [f"{a} is {relation[0]} than {b}." for a, b in zip(people, people[1:])]
    rng.shuffle(facts)
    ask = rng.choice((relation[1], relation[2]))
    return f"{' '.join(facts)} Who is the {ask}? Explain your reasoning."


def _extraction(rng: random.Random) -> str:
    rows = [(person(rng), rng.choice(TOWNS), rng.randint(18, 80), rng.choice(THINGS)) for _ in range(rng.randint(3, 6))]
    text = " ".join(f"{name} ({age}) from {town} works on {thing}." for name, town, age, thing in rows)
    fmt = rng.choice(("a JSON list", "a Markdown table", "CSV with a header row", "a bulleted list"))
    return f"Extract every person's name, age and town from this text as {fmt}:\n\n{text}"


def conversation_prompt(rng: random.Random) -> str:
    topic, other = rng.sample(TOPICS, 2)
    audience = rng.choice(AUDIENCES)
    style = rng.randrange(6)
    if style == 0:
        return f"Write {rng.choice(WRITING_FORMS)} about {topic}.{rng.choice(CONSTRAINTS)}"
    if style == 1:
        return (f"Draft an email to {rng.choice(RECIPIENTS)} {rng.choice(EMAIL_PURPOSES)}, mentioning {topic}."
                f"{rng.choice(CONSTRAINTS)}")
    if style == 2:
        task = rng.choice(ROLE_TASKS).format(topic=topic)
        return f"Pretend you are {rng.choice(ROLES)}. {task}{rng.choice(CONSTRAINTS)}"
    if style == 3:
        return rng.choice(DISCUSSION).format(topic=topic, other=other, audience=audience) + rng.choice(CONSTRAINTS)
    if style == 4:
        draft = rng.choice(DRAFTS).format(day=rng.choice(DAYS), name=rng.choice(FIRST_NAMES), thing=rng.choice(THINGS),
                                          count=rng.randint(2, 40), town=rng.choice(TOWNS))
        return f"Rewrite this message to make it {rng.choice(REWRITE_STYLES)}:\n\n{draft}"
    return _reasoning(rng) if rng.random() < 0.5 else _extraction(rng)


# ----------------------------------------------------------------------------- factual questions
ENTITIES = {
    "country": ("Brazil", "Japan", "Kenya", "Norway", "Canada", "Egypt", "India", "Mexico", "Australia", "Germany", "Peru",
                "Vietnam", "Morocco", "Chile", "Finland", "Indonesia", "Ghana", "Portugal", "Nepal", "Argentina", "Poland",
                "South Korea", "New Zealand", "Iceland", "Ethiopia", "Turkey", "Ireland", "Thailand", "Colombia", "Greece"),
    "element": ("oxygen", "iron", "gold", "helium", "carbon", "silicon", "copper", "uranium", "sodium", "neon", "lithium",
                "mercury", "calcium", "titanium", "silver", "nitrogen", "zinc", "aluminium", "hydrogen", "platinum"),
    "animal": ("octopus", "emperor penguin", "honey badger", "blue whale", "cheetah", "axolotl", "elephant", "bat",
               "salmon", "crow", "platypus", "giraffe", "ant", "dolphin", "owl", "camel", "chameleon", "wolf", "tortoise"),
    "invention": ("the telephone", "the steam engine", "the light bulb", "the compass", "paper", "the bicycle",
                  "the transistor", "the World Wide Web", "the refrigerator", "the microscope", "the jet engine",
                  "antibiotics", "the printing press", "the radio", "the camera", "the battery", "the X-ray machine"),
    "event": ("the fall of the Berlin Wall", "the first Moon landing", "the Black Death", "the signing of the Magna Carta",
              "the Industrial Revolution", "the invention of writing", "the eruption of Vesuvius in 79 AD",
              "the first modern Olympic Games", "the discovery of penicillin", "the building of the pyramids of Giza",
              "the end of the Second World War", "the first flight of the Wright brothers"),
    "concept": ("inflation", "entropy", "natural selection", "opportunity cost", "the greenhouse effect", "photosynthesis",
                "plate tectonics", "supply chains", "herd immunity", "compound interest", "the placebo effect", "osmosis",
                "cognitive dissonance", "the water cycle", "continental drift", "game theory", "biodiversity", "relativity"),
    "person": ("Marie Curie", "Leonardo da Vinci", "Nelson Mandela", "Ada Lovelace", "Confucius", "Frida Kahlo",
               "Isaac Newton", "Cleopatra", "Mahatma Gandhi", "Wolfgang Amadeus Mozart", "Charles Darwin", "Joan of Arc",
               "Albert Einstein", "Florence Nightingale", "Galileo Galilei", "Ibn Battuta", "Rosalind Franklin",
               "Genghis Khan", "Jane Austen", "Alan Turing", "Hypatia", "Simon Bolivar", "Harriet Tubman", "Nikola Tesla"),
    "book": ("Pride and Prejudice", "Don Quixote", "One Hundred Years of Solitude", "War and Peace", "The Odyssey",
             "Things Fall Apart", "Moby-Dick", "The Tale of Genji", "Frankenstein", "The Little Prince", "Hamlet",
             "Crime and Punishment", "The Divine Comedy", "Jane Eyre", "The Great Gatsby", "Les Miserables"),
    "food": ("sushi", "sourdough bread", "kimchi", "chocolate", "olive oil", "paella", "tofu", "cheddar cheese", "coffee",
             "quinoa", "croissants", "pasta", "yoghurt", "maple syrup", "saffron", "tortillas", "green tea", "honey"),
    "sport": ("cricket", "basketball", "tennis", "rugby", "ice hockey", "table tennis", "volleyball", "golf", "fencing",
              "badminton", "rowing", "judo", "baseball", "cycling", "handball", "curling", "water polo", "archery"),
    "body": ("the liver", "the heart", "the lungs", "the kidneys", "the brain", "the skin", "the pancreas", "bones",
             "the stomach", "the eyes", "the inner ear", "red blood cells", "the thyroid", "muscles", "the spleen"),
    "space": ("Mars", "Jupiter", "the Moon", "the Sun", "Saturn's rings", "a comet", "the Milky Way", "a neutron star",
              "Venus", "the asteroid belt", "Titan", "the Andromeda galaxy", "a solar eclipse", "Pluto", "Europa"),
    "place": ("the Amazon river", "Mount Everest", "the Sahara", "the Great Barrier Reef", "Antarctica", "the Dead Sea",
              "the Grand Canyon", "Lake Baikal", "the Mariana Trench", "Venice", "the Alps", "Machu Picchu", "the Nile"),
}
QUESTION_TEMPLATES = {
    "country": ("What is the capital of {x}?", "Which languages are spoken in {x}?", "What is {x} famous for?",
                "What currency is used in {x}?", "When did {x} become independent, if ever?",
                "What is the climate like in {x}?", "Which countries border {x}?", "What is the population of {x}?"),
    "element": ("What is the chemical symbol of {x}?", "What is {x} used for?", "Who discovered {x}?",
                "What is the atomic number of {x}?", "Is {x} a metal?", "Where is {x} found in nature?"),
    "animal": ("What does the {x} eat?", "How long does the {x} live?", "Where does the {x} live?",
               "How does the {x} sleep?", "Is the {x} endangered?", "How fast can the {x} move?"),
    "invention": ("Who invented {x}?", "When was {x} invented?", "How did {x} change everyday life?",
                  "How does {x} work?", "What came before {x}?"),
    "event": ("When did {x} happen?", "What caused {x}?", "What were the consequences of {x}?",
              "Who were the key people in {x}?", "Why is {x} remembered today?"),
    "concept": ("What is {x}?", "Who first described {x}?", "Can you give an everyday example of {x}?",
                "Why does {x} matter?", "How is {x} measured?"),
    "person": ("Who was {x}?", "What is {x} best known for?", "When did {x} live?", "What did {x} achieve?",
               "Where did {x} grow up?", "Why is {x} still famous today?", "What influenced {x}?"),
    "book": ("Who wrote {x}?", "What is {x} about?", "When was {x} written?", "Who is the main character of {x}?",
             "Why is {x} considered a classic?", "What are the main themes of {x}?"),
    "food": ("Where does {x} come from?", "How is {x} made?", "Is {x} healthy?", "How long does {x} keep?",
             "What dishes use {x}?", "What is the history of {x}?"),
    "sport": ("What are the basic rules of {x}?", "Where was {x} invented?", "How many players are in a {x} team?",
              "Who is the best {x} player of all time?", "What equipment do you need for {x}?", "How is {x} scored?"),
    "body": ("What does {x} do?", "How does {x} work?", "What can go wrong with {x}?", "How can I keep {x} healthy?",
             "Where in the body is {x}?"),
    "space": ("How far away is {x}?", "What is {x} made of?", "How big is {x}?", "Has anyone visited {x}?",
              "How was {x} discovered?", "What would you see on {x}?"),
    "place": ("Where is {x}?", "How was {x} formed?", "How big is {x}?", "Why do people visit {x}?",
              "What lives in or around {x}?"),
}
COMPARISONS = ("What is the difference between {x} and {y}?", "Which is larger, {x} or {y}?",
               "How are {x} and {y} related?")
QA_STYLE = ("", "", "", " Answer in one sentence.", " Answer briefly.", " Explain your answer.", " Keep it short.",
            " Give some background too.")
QA_OPENERS = ("", "", "", "", "Quick question: ", "I was wondering: ", "My son asked me this and I did not know. ",
              "For a pub quiz: ", "I'm studying for an exam. ", "Settle an argument: ")


def qa_prompt(rng: random.Random) -> str:
    category = rng.choice(sorted(ENTITIES))
    if rng.random() < 0.25:
        x, y = rng.sample(ENTITIES[category], 2)
        question = rng.choice(COMPARISONS).format(x=x, y=y)
    else:
        question = rng.choice(QUESTION_TEMPLATES[category]).format(x=rng.choice(ENTITIES[category]))
    question = question[0].upper() + question[1:]
    return rng.choice(QA_OPENERS) + question + rng.choice(QA_STYLE)


# ----------------------------------------------------------------------------- programming requests
ALGORITHMS = (
    "reverse a string", "check whether a number is prime", "compute the n-th Fibonacci number", "merge two sorted lists",
    "find the most common word in a text", "flatten a nested list", "binary search in a sorted list",
    "remove duplicates from a list while keeping order", "compute the greatest common divisor of two numbers",
    "check whether a string is a palindrome", "transpose a matrix", "parse a CSV line into fields",
    "validate an email address", "compute a running average", "group words by their first letter",
    "implement a stack with push and pop", "rotate a list by k positions", "find all pairs in a list that sum to a target",
    "count the lines, words and characters of a file", "convert a Roman numeral to an integer", "implement an LRU cache",
    "check whether brackets in a string are balanced", "compute the edit distance of two strings",
    "find the shortest path in a grid", "serialise a binary tree to a string", "format a number with thousands separators",
    "parse a date string and print the weekday", "read a JSON file and sum one field", "retry an HTTP request with backoff",
    "split a list into chunks of size n", "compute the median of a list", "find duplicate files by content",
    "sort a list of records by two keys", "count word frequencies in a large file", "generate all permutations of a list",
    "implement a simple queue with two stacks", "check whether two strings are anagrams", "merge overlapping intervals",
    "convert a string to title case", "compute a moving maximum over a window", "parse command-line arguments",
    "rate-limit calls to a function", "deep-copy a nested dictionary", "implement binary tree insertion",
)
LANGUAGES = ("Python", "JavaScript", "C", "Rust", "Go", "Bash", "Java", "TypeScript", "C++", "SQL")
CODE_TEMPLATES = (
    "Write a {language} function to {task}.{extra}", "Write a {language} function to {task}, and explain how it works.{extra}",
    "Write unit tests in {language} for a function that does this: {task}.", "What is the time complexity of the usual way to {task}? Show {language} code.",
    "Review this plan and write the code: in {language}, {task}.{extra}", "My {language} code to {task} is too slow. How would you speed it up?",
    "How do I {task} in {language}?{extra}", "Show two different ways to {task} in {language} and compare them.",
    "I'm new to {language}. Can you show me how to {task}, step by step?{extra}",
    "Write idiomatic {language} to {task} and list the edge cases.{extra}",
)
CODE_EXTRAS = ("", " Add comments.", " Handle invalid input.", " Keep it short.", " Use no external libraries.",
               " Include an example call.")


def code_prompt(rng: random.Random) -> str:
    return rng.choice(CODE_TEMPLATES).format(language=rng.choice(LANGUAGES), task=rng.choice(ALGORITHMS),
                                             extra=rng.choice(CODE_EXTRAS))
