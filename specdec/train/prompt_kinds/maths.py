"""Maths word problems with random numbers (the `math` kind): arithmetic, shopping, rates, percentages,
unit conversions, ages, averages, areas and simple equations.

Every problem knows its numbers and its answer (`MathsProblem`), so a test can check that the
numbers in the text are the ones used and that the problem has a clean answer (whole, or at most
two decimals, never negative). The target writes the worked solution; only the question is ours.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

from .passages import FIRST_NAMES

ITEMS = (("notebook", "notebooks"), ("apple", "apples"), ("pencil", "pencils"), ("ticket", "tickets"),
         ("loaf of bread", "loaves of bread"), ("bag of rice", "bags of rice"), ("plant", "plants"),
         ("comic book", "comic books"), ("bottle of juice", "bottles of juice"), ("candle", "candles"))
CONVERSIONS = (  # (from unit, to unit, factor): exact factors, so the answer is clean
    ("kilometres", "metres", 1000), ("hours", "minutes", 60), ("kilograms", "grams", 1000), ("litres", "millilitres", 1000),
    ("days", "hours", 24), ("feet", "inches", 12), ("yards", "feet", 3), ("minutes", "seconds", 60),
    ("metres", "centimetres", 100), ("weeks", "days", 7),
)
ASK_STYLE = ("", " Show your working.", " Explain each step.", " Think step by step.", " Give the final answer on its own line.")


@dataclass(frozen=True)
class MathsProblem:
    text: str
    numbers: tuple[Fraction, ...]  # the quantities given, in the order they appear in the text
    answer: Fraction


def fmt(value: Fraction | int) -> str:
    """A number as the text writes it: 12, 3.5, 0.25 (never 3.50 or 1e5)."""
    value = Fraction(value)
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.2f}".rstrip("0")


def _name(rng: random.Random, *exclude: str) -> str:
    return rng.choice([n for n in FIRST_NAMES if n not in exclude])


def shopping(rng):
    name, (item, items) = _name(rng), rng.choice(ITEMS)
    count, price, paid_extra = rng.randint(2, 12), Fraction(rng.randint(5, 95), 20), rng.randint(1, 20)
    paid = int(count * price) + paid_extra
    text = (f"{name} buys {count} {items} at {fmt(price)} dollars each and pays with {fmt(paid)} dollars. "
            f"How much change does {name} get?")
    return MathsProblem(text, (Fraction(count), price, Fraction(paid)), paid - count * price)


def speed(rng):
    name = _name(rng)
    kmh, hours, minutes = rng.randint(4, 120), rng.randint(1, 6), rng.choice((0, 15, 30, 45))
    duration = f"{hours} hours and {minutes} minutes" if minutes else f"{hours} hours"
    text = f"{name} travels at a steady {kmh} kilometres per hour for {duration}. How far does {name} travel, in kilometres?"
    numbers = (Fraction(kmh), Fraction(hours)) + ((Fraction(minutes),) if minutes else ())
    return MathsProblem(text, numbers, kmh * (hours + Fraction(minutes, 60)))


def percentage(rng):
    (item, _), price, off = rng.choice(ITEMS), rng.randint(2, 90) * 10, rng.choice((5, 10, 15, 20, 25, 30, 40, 50))
    text = f"A {item} costs {price} dollars. In a sale it is {off} percent off. What is the sale price?"
    return MathsProblem(text, (Fraction(price), Fraction(off)), price * Fraction(100 - off, 100))


def work_rate(rng):
    name = _name(rng)
    other = _name(rng, name)
    per_hour_a, per_hour_b, hours = rng.randint(2, 20), rng.randint(2, 20), rng.randint(2, 9)
    total = (per_hour_a + per_hour_b) * hours
    text = (f"{name} can pack {per_hour_a} boxes an hour and {other} can pack {per_hour_b} boxes an hour. "
            f"Working together, how many hours do they need to pack {total} boxes?")
    return MathsProblem(text, (Fraction(per_hour_a), Fraction(per_hour_b), Fraction(total)), Fraction(hours))


def ages(rng):
    name = _name(rng)
    other = _name(rng, name)
    young, factor, years = rng.randint(3, 20), rng.randint(2, 4), rng.randint(2, 15)
    text = (f"{name} is {factor} times as old as {other}. {other} is {young} years old. "
            f"How old will {name} be in {years} years?")
    return MathsProblem(text, (Fraction(factor), Fraction(young), Fraction(years)), Fraction(factor * young + years))


def average(rng):
    name = _name(rng)
    scores = [rng.randint(40, 100) for _ in range(rng.randint(3, 6))]
    scores[-1] -= sum(scores) % len(scores)  # a whole-number average
    text = (f"{name} scored {', '.join(map(str, scores[:-1]))} and {scores[-1]} points in {len(scores)} games. "
            f"What is {name}'s average score per game?")
    return MathsProblem(text, tuple(Fraction(s) for s in scores) + (Fraction(len(scores)),), Fraction(sum(scores), len(scores)))


def rectangle(rng):
    length, width, price = rng.randint(3, 40), rng.randint(2, 30), rng.randint(2, 25)
    text = (f"A rectangular garden is {length} metres long and {width} metres wide. Turf costs {price} dollars per "
            "square metre. How much does it cost to cover the whole garden?")
    return MathsProblem(text, (Fraction(length), Fraction(width), Fraction(price)), Fraction(length * width * price))


def conversion(rng):
    big, small, factor = rng.choice(CONVERSIONS)
    amount = Fraction(rng.randint(1, 40) * 4 + rng.choice((0, 1, 2, 3)), 4)
    text = f"How many {small} are there in {fmt(amount)} {big}?"
    return MathsProblem(text, (amount,), amount * factor)


def equation(rng):
    x, a, b = rng.randint(-20, 40), rng.randint(2, 15), rng.randint(1, 90)
    result = a * x + b
    text = f"Solve for x: {a}x + {b} = {result}."
    answer = Fraction(x)
    if x < 0:  # keep answers non-negative: ask for the distance from zero instead
        text = f"Solve for x: {a}x + {b} = {result}. What is the absolute value of x?"
        answer = Fraction(-x)
    return MathsProblem(text, (Fraction(a), Fraction(b), Fraction(result)), answer)


def arithmetic(rng):
    a, b, c = rng.randint(12, 999), rng.randint(2, 99), rng.randint(1, 500)
    text = f"What is {a} times {b} plus {c}?"
    return MathsProblem(text, (Fraction(a), Fraction(b), Fraction(c)), Fraction(a * b + c))


def savings(rng):
    name = _name(rng)
    weekly, weeks = rng.randint(5, 60), rng.randint(3, 26)
    spent = rng.randint(0, weekly * weeks)
    text = (f"{name} saves {weekly} dollars every week for {weeks} weeks, then spends {spent} dollars on a present. "
            f"How much money does {name} have left?")
    return MathsProblem(text, (Fraction(weekly), Fraction(weeks), Fraction(spent)), Fraction(weekly * weeks - spent))


def sharing(rng):
    (item, items), people = rng.choice(ITEMS), rng.randint(2, 9)
    each, left = rng.randint(2, 25), rng.randint(0, people - 1)
    total = people * each + left
    text = (f"There are {total} {items} to share equally among {people} children. How many {items} does each child get, "
            "and how many are left over? Give the number each child gets.")
    return MathsProblem(text, (Fraction(total), Fraction(people)), Fraction(each))


PROBLEMS = (shopping, speed, percentage, work_rate, ages, average, rectangle, conversion, equation, arithmetic, savings,
            sharing)


def maths_problem(rng: random.Random) -> MathsProblem:
    problem = rng.choice(PROBLEMS)(rng)
    return MathsProblem(problem.text + rng.choice(ASK_STYLE), problem.numbers, problem.answer)


def maths_prompt(rng: random.Random) -> str:
    return maths_problem(rng).text
