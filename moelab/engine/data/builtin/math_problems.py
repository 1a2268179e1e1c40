"""Arithmetic word problems generated here, with worked answers (``builtin:math``); one unit per
generated problem (its generator seed)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

from ..sets import Sample
from .packing import TARGET_CHARS, Built, _allocate, _interleave, _trim, unit_split

_NAMES = (
    "Ava", "Liam", "Noah", "Emma", "Olivia", "Mateo", "Sofia", "Ethan", "Maya", "Lucas",
    "Zara", "Omar", "Priya", "Kenji", "Amara", "Diego", "Hannah", "Yusuf", "Chloe", "Ivan",
)
_OBJECTS = (
    "apples", "marbles", "stickers", "books", "pencils", "coins", "cookies", "stamps",
    "seashells", "toy cars", "cupcakes", "postcards", "oranges", "crayons", "beads",
)
_CONTAINERS = ("boxes", "bags", "baskets", "crates", "jars", "shelves", "trays")


def _money(x: float) -> str:
    return f"${x:.2f}" if abs(x - round(x)) > 1e-9 else f"${int(round(x))}"


def _num(x: float) -> str:
    return f"{x:.2f}".rstrip("0").rstrip(".") if abs(x - round(x)) > 1e-9 else str(int(round(x)))


def _two_names(r: random.Random) -> tuple[str, str]:
    a, b = r.sample(_NAMES, 2)
    return a, b


def _addition(r: random.Random) -> str:
    a_, b_ = _two_names(r)
    obj = r.choice(_OBJECTS)
    a, b, c = r.randint(12, 480), r.randint(5, 350), r.randint(3, 120)
    t = r.randrange(3)
    if t == 0:
        q = f"{a_} has {a} {obj}. {b_} gives {a_} {b} more {obj}. How many {obj} does {a_} have now?"
        s = f"{a_} starts with {a} {obj} and receives {b} more, so {a} + {b} = {a + b}."
        ans = a + b
    elif t == 1:
        place = r.choice(("library", "school", "shop", "museum", "bakery"))
        q = f"A {place} received {a} {obj} on Monday and {b} {obj} on Tuesday. How many {obj} did it receive in total?"
        s = f"Add the two deliveries: {a} + {b} = {a + b}."
        ans = a + b
    else:
        q = (
            f"{a_} collected {a} {obj} in the morning, {b} in the afternoon and {c} in the evening. "
            f"How many {obj} did {a_} collect that day?"
        )
        s = f"First {a} + {b} = {a + b}, then {a + b} + {c} = {a + b + c}."
        ans = a + b + c
    return f"Question: {q}\nSolution: {s} The answer is {_num(ans)}."


def _subtraction(r: random.Random) -> str:
    a_, b_ = _two_names(r)
    obj = r.choice(_OBJECTS)
    b = r.randint(4, 300)
    a = b + r.randint(5, 400)
    t = r.randrange(3)
    if t == 0:
        q = f"{a_} had {a} {obj} and gave {b} of them to {b_}. How many {obj} does {a_} have left?"
        s = f"Take away the {obj} given to {b_}: {a} - {b} = {a - b}."
    elif t == 1:
        q = f"A train carries {a} passengers. At the next station {b} passengers get off and nobody gets on. How many passengers are still on the train?"
        s = f"{a} - {b} = {a - b} passengers remain."
    else:
        q = f"{a_} is saving for a bicycle that costs {_money(a)}. {a_} has already saved {_money(b)}. How much more money does {a_} need?"
        s = f"The missing amount is {_money(a)} - {_money(b)} = {_money(a - b)}."
    return f"Question: {q}\nSolution: {s} The answer is {_num(a - b)}."


def _multiplication(r: random.Random) -> str:
    a_, _ = _two_names(r)
    obj = r.choice(_OBJECTS)
    a, b = r.randint(3, 48), r.randint(3, 36)
    t = r.randrange(3)
    if t == 0:
        box = r.choice(_CONTAINERS)
        q = f"There are {a} {box} with {b} {obj} in each. How many {obj} are there altogether?"
        s = f"{a} {box} times {b} {obj} each is {a} × {b} = {a * b}."
    elif t == 1:
        q = f"{a_} reads {b} pages every day. How many pages does {a_} read in {a} days?"
        s = f"{b} pages a day for {a} days is {b} × {a} = {a * b} pages."
    else:
        q = f"A concert ticket costs {_money(b)}. How much do {a} tickets cost?"
        s = f"{a} × {_money(b)} = {_money(a * b)}."
    return f"Question: {q}\nSolution: {s} The answer is {_num(a * b)}."


def _division(r: random.Random) -> str:
    a_, _ = _two_names(r)
    obj = r.choice(_OBJECTS)
    d, qv = r.randint(2, 24), r.randint(3, 40)
    total = d * qv
    t = r.randrange(3)
    if t == 0:
        q = f"{a_} shares {total} {obj} equally among {d} friends. How many {obj} does each friend get?"
        s = f"Divide the {obj} into {d} equal groups: {total} ÷ {d} = {qv}."
    elif t == 1:
        q = f"A coach splits {total} players into teams of {d}. How many teams are there?"
        s = f"{total} ÷ {d} = {qv} teams."
    else:
        q = f"A rope {total} meters long is cut into {d} pieces of equal length. How long is each piece?"
        s = f"Each piece is {total} ÷ {d} = {qv} meters long."
    return f"Question: {q}\nSolution: {s} The answer is {_num(qv)}."


def _multi_step(r: random.Random) -> str:
    a_, b_ = _two_names(r)
    obj = r.choice(_OBJECTS)
    t = r.randrange(3)
    if t == 0:
        x, p = r.randint(2, 9), r.randint(2, 15)
        bill = next(v for v in (10, 20, 50, 100, 200) if v >= x * p)
        q = f"{a_} buys {x} notebooks at {_money(p)} each and pays with a {_money(bill)} bill. How much change does {a_} get?"
        s = f"The notebooks cost {x} × {_money(p)} = {_money(x * p)}. The change is {_money(bill)} - {_money(x * p)} = {_money(bill - x * p)}."
        ans = bill - x * p
    elif t == 1:
        a, packs, per = r.randint(5, 60), r.randint(2, 8), r.randint(3, 12)
        d = r.randint(1, a + packs * per - 1)
        q = f"{a_} had {a} {obj}, then bought {packs} packs with {per} {obj} in each, and gave {d} {obj} to {b_}. How many {obj} does {a_} have now?"
        s = f"The packs hold {packs} × {per} = {packs * per} {obj}, so {a_} had {a} + {packs * per} = {a + packs * per}. After giving {d} away: {a + packs * per} - {d} = {a + packs * per - d}."
        ans = a + packs * per - d
    else:
        hens, eggs = r.randint(4, 30), r.randint(1, 3)
        week = hens * eggs * 7
        q = f"A farmer has {hens} hens and each hen lays {eggs} egg{'s' if eggs > 1 else ''} a day. How many eggs do the hens lay in one week?"
        s = f"Each day the hens lay {hens} × {eggs} = {hens * eggs} eggs; in 7 days that is {hens * eggs} × 7 = {week}."
        ans = week
    return f"Question: {q}\nSolution: {s} The answer is {_num(ans)}."


def _percentage(r: random.Random) -> str:
    a_, _ = _two_names(r)
    t = r.randrange(3)
    if t == 0:
        price = r.randint(2, 40) * 5
        pct = r.choice((10, 15, 20, 25, 30, 40, 50))
        off = price * pct / 100
        q = f"A jacket costs {_money(price)}. It is on sale for {pct}% off. What is the sale price?"
        s = f"The discount is {pct}% of {_money(price)} = {_money(off)}, so the sale price is {_money(price)} - {_money(off)} = {_money(price - off)}."
        ans = price - off
    elif t == 1:
        total = r.choice((20, 25, 40, 50))
        got = r.randint(total // 3, total)
        pct = got * 100 / total
        q = f"{a_} answered {got} out of {total} questions correctly. What percentage of the questions did {a_} get right?"
        s = f"{got} ÷ {total} = {_num(got / total)}, and {_num(got / total)} × 100 = {_num(pct)}%."
        ans = pct
    else:
        pop = r.randint(12, 400) * 100
        pct = r.choice((2, 4, 5, 8, 10, 12, 20))
        grow = pop * pct // 100
        q = f"A town has {pop} people. This year the population grows by {pct}%. How many people live there at the end of the year?"
        s = f"The increase is {pct}% of {pop} = {grow}, so the new population is {pop} + {grow} = {pop + grow}."
        ans = pop + grow
    return f"Question: {q}\nSolution: {s} The answer is {_num(ans)}."


MATH_OPERATIONS: dict[str, Callable[[random.Random], str]] = {
    "addition": _addition,
    "subtraction": _subtraction,
    "multiplication": _multiplication,
    "division": _division,
    "multi_step": _multi_step,
    "percentage": _percentage,
}


def math_problem(operation: str, unit_seed: int) -> str:
    """One worked word problem, fully determined by (operation, unit seed)."""
    return MATH_OPERATIONS[operation](random.Random(f"math:{operation}:{unit_seed}"))


def _build_math(n: int, rng: random.Random, split: str, data_dir: Path | None) -> Built:
    ops = list(MATH_OPERATIONS)
    rng.shuffle(ops)
    counts = _allocate({op: n for op in ops}, n, ops, allow_repeat=False)
    groups: list[Built] = []
    for op in ops:
        group: Built = []
        for _ in range(counts[op]):
            parts: list[str] = []
            units: list[str] = []
            size = 0
            while size < TARGET_CHARS:
                seed = rng.getrandbits(40)
                unit = f"math:{op}:{seed}"
                if unit_split(unit) != split:
                    continue
                text = math_problem(op, seed)
                parts.append(text)
                units.append(unit)
                size += len(text) + 2
            group.append((tuple(units), Sample(_trim("\n\n".join(parts)), "math", op)))
        groups.append(group)
    return _interleave(groups)
