"""Write the word problems glmlight ships (glmlight/data/word_problems/): GSM8K-style grade-school problems of
one and two steps, written for this project from the templates below (no problem is taken from GSM8K or any
other dataset), released with glmlight under its license. Deterministic: the same files on every run.

    python scripts/make_word_problems.py [--out glmlight/data/word_problems]

Each row is GSM8K's layout: `question`, `answer` (the worked solution, ending with `#### <number>`), plus the
bare number as `label` (what the reward checks), and the template as `kind`. `one_step_*.jsonl` hold the
problems of one operation (ONE_STEP) of each file. A problem is its template and its numbers; names, objects and
wording are dressing. The held-out file holds problems whose (template, numbers) never occur in the training
file under any dressing, chosen by a hash of that key (glmlight.split.unit_hash), so no held-out problem's
arithmetic is trained on.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Callable

from glmlight.split import unit_hash

NAMES = [("Sam", "he"), ("Mia", "she"), ("Tom", "he"), ("Lena", "she"), ("Omar", "he"), ("Ava", "she"),
         ("Ravi", "he"), ("Zoe", "she"), ("Leo", "he"), ("Nora", "she"), ("Ben", "he"), ("Ivy", "she")]
THINGS = ["apples", "marbles", "stickers", "pencils", "cookies", "stamps", "shells", "cards", "books", "eggs"]
ITEMS = [("pen", "notebook"), ("sandwich", "juice"), ("ticket", "poster"), ("toy car", "ball"), ("cup", "plate")]
TRAIN, HELDOUT, FRACTION = 400, 100, 0.2
ONE_STEP = ("add", "sub", "mul", "div", "per_day")  # one operation; the other templates take two


def _add(r: random.Random):
    a, b = r.randint(3, 30), r.randint(2, 20)
    return dict(a=a, b=b), "{n} has {a} {t}. {P} gets {b} more. How many {t} does {n} have now?", \
        f"{a} + {b} = {a + b}", a + b


def _sub(r: random.Random):
    a = r.randint(10, 40)
    b = r.randint(2, a - 2)
    return dict(a=a, b=b), "{n} had {a} {t} and gave {b} of them to a friend. How many {t} does {n} have left?", \
        f"{a} - {b} = {a - b}", a - b


def _mul(r: random.Random):
    a, b = r.randint(2, 12), r.randint(2, 9)
    return dict(a=a, b=b), "A box holds {a} {t}. How many {t} are there in {b} boxes?", f"{a} * {b} = {a * b}", a * b


def _div(r: random.Random):
    q, b = r.randint(2, 12), r.randint(2, 8)
    a = q * b
    return dict(a=a, b=b), "{n} shares {a} {t} equally among {b} friends. How many {t} does each friend get?", \
        f"{a} / {b} = {q}", q


def _add_sub(r: random.Random):
    a, b = r.randint(5, 25), r.randint(2, 15)
    c = r.randint(1, a + b - 1)
    return dict(a=a, b=b, c=c), "{n} has {a} {t}. {P} finds {b} more and then gives away {c}. How many {t} does {p} have now?", \
        f"{a} + {b} = {a + b}, and {a + b} - {c} = {a + b - c}", a + b - c


def _packs(r: random.Random):
    a, b, c = r.randint(2, 6), r.randint(2, 10), r.randint(1, 15)
    return dict(a=a, b=b, c=c), "{n} buys {a} packs of {t} with {b} in each pack. {P} already had {c}. " \
        "How many {t} does {p} have in total?", f"{a} * {b} = {a * b}, and {a * b} + {c} = {a * b + c}", a * b + c


def _price(r: random.Random):
    a, b, k = r.randint(2, 9), r.randint(2, 15), r.randint(2, 5)
    return dict(a=a, b=b, k=k), "A {i} costs ${a} and a {j} costs ${b}. How many dollars do {k} {i}s and one {j} cost?", \
        f"{k} * {a} = {k * a}, and {k * a} + {b} = {k * a + b}", k * a + b


def _per_day(r: random.Random):
    a, b = r.randint(3, 15), r.randint(2, 7)
    return dict(a=a, b=b), "{n} reads {a} pages every day. How many pages does {p} read in {b} days?", \
        f"{a} * {b} = {a * b}", a * b


def _more_than(r: random.Random):
    a, b = r.randint(2, 20), r.randint(1, 10)
    return dict(a=a, b=b), "{n} has {a} {t}. {m} has {b} more {t} than {n}. How many {t} do they have together?", \
        f"{{m}} has {a} + {b} = {a + b}, and {a} + {a + b} = {2 * a + b}", 2 * a + b


def _spend(r: random.Random):
    a = r.randint(20, 60)
    b = r.randint(2, a // 2)
    c = r.randint(1, a - b - 1)
    return dict(a=a, b=b, c=c), "{n} had ${a}. {P} spent ${b} on lunch and ${c} on a book. How many dollars does {p} have left?", \
        f"{b} + {c} = {b + c}, and {a} - {b + c} = {a - b - c}", a - b - c


TEMPLATES: dict[str, Callable] = {f.__name__[1:]: f for f in
                                  (_add, _sub, _mul, _div, _add_sub, _packs, _price, _per_day, _more_than, _spend)}


def problem(kind: str, r: random.Random) -> tuple[str, dict]:
    """One problem of template `kind`: its key (template and numbers) and its row."""
    numbers, text, working, value = TEMPLATES[kind](r)
    (n, pron), (m, _) = r.sample(NAMES, 2)
    t, (i, j) = r.choice(THINGS), r.choice(ITEMS)
    fill = dict(n=n, P=pron.capitalize(), p=pron, m=m, t=t, i=i, j=j, **numbers)
    question, working = text.format(**fill), working.format(**fill)
    row = {"question": question, "answer": f"{working}.\n#### {value}", "label": str(value)}
    return f"{kind}:" + ",".join(f"{k}={v}" for k, v in numbers.items()), row


def build(seed: int = 0) -> tuple[list[dict], list[dict]]:
    """The training and held-out problems: TRAIN and HELDOUT of them, each (template, numbers) key once, the
    held-out ones those whose key hashes below FRACTION."""
    r = random.Random(seed)
    train: dict[str, dict] = {}
    heldout: dict[str, dict] = {}
    kinds = sorted(TEMPLATES)
    while len(train) < TRAIN or len(heldout) < HELDOUT:
        key, row = problem(kinds[(len(train) + len(heldout)) % len(kinds)], r)
        side = heldout if unit_hash(key) < FRACTION else train
        if key not in side and len(side) < (HELDOUT if side is heldout else TRAIN):
            side[key] = {**row, "kind": key.split(":")[0]}
    return list(train.values()), list(heldout.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "glmlight/data/word_problems"))
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    train, heldout = build()
    one_step = [[row for row in rows if row["kind"] in ONE_STEP] for rows in (train, heldout)]
    for name, rows in zip(("train", "heldout", "one_step_train", "one_step_heldout"), (train, heldout, *one_step)):
        with open(out / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        print(f"{out / name}.jsonl: {len(rows)} problems")


if __name__ == "__main__":
    main()
