"""Prompts with several right answers that a program checks, and whose right answers are known, for
the diversity study (``bench_diversity.py``) on a real chat model (``benchmarks/real_model.py``):
rows of ``{"id", "prompt": [user message], "kind", "lo", "hi", "d" / "s", "answers": [every right answer]}``.

    .venv/bin/python benchmarks/many_answers/make_problems.py   # writes problems.jsonl beside it

Two kinds (``--kinds``):

- ``multiple``: "Name a whole number between LO and HI that is divisible by D": the multiples of D in
  [LO, HI], 4 to 12 of them; D is 2, 5 or 10 (``EASY_DIVISORS``: SmolLM2-135M-Instruct right 10-21%
  of the time at temperature 1, most of it on one answer), or with ``--hard`` 3 to 13 (about 7%);
- ``pair``: "Name two one-digit numbers that add up to S": the unordered pairs {a, b} of digits with
  a + b = S (S from 5 to 13: 3 to 5 pairs; SmolLM2 got none of 192 samples right).

A reply is scored by :mod:`rewards` (beside this file): its first number (``multiple``) or its first
two (``pair``), checked against the rule, not against a list.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

KINDS = ("multiple", "pair")


EASY_DIVISORS = (2, 5, 10)
"""``multiple`` prompts that SmolLM2-135M-Instruct gets right 10-21% of the time at temperature 1."""
HARD_DIVISORS = (3, 4, 6, 7, 8, 9, 11, 12, 13)
"""``multiple`` prompts that it gets right a few percent of the time (the sparse-reward setting)."""


def multiple(rng: random.Random, divisors=EASY_DIVISORS) -> dict:
    while True:
        d = rng.choice(divisors)
        lo = rng.randint(1, 30 if d in EASY_DIVISORS else 60)
        hi = lo + rng.randint(15, 90)
        answers = [n for n in range(lo, hi + 1) if n % d == 0]
        if 4 <= len(answers) <= 12:
            break
    text = f"Name a whole number between {lo} and {hi} that is divisible by {d}. Answer with the number only."
    return {
        "id": f"multiple-{d}-{lo}-{hi}",
        "prompt": [{"role": "user", "content": text}],
        "kind": "multiple",
        "lo": lo,
        "hi": hi,
        "d": d,
        "answers": [str(n) for n in answers],
    }


def pair(rng: random.Random) -> dict:
    s = rng.randint(5, 13)
    answers = [f"{a}+{s - a}" for a in range(0, 10) if 0 <= s - a <= 9 and a <= s - a]
    text = f"Name two one-digit numbers that add up to {s}. Answer with the two numbers only, like 2 and 3."
    prompt = [{"role": "user", "content": text}]
    return {"id": f"pair-{s}", "prompt": prompt, "kind": "pair", "s": s, "answers": answers}


def problems(n: int, kinds: list[str], seed: int = 0, hard: bool = False) -> list[dict]:
    rng = random.Random(seed)
    makers = {"multiple": lambda r: multiple(r, HARD_DIVISORS if hard else EASY_DIVISORS), "pair": pair}
    seen, rows, tries = set(), [], 0
    while len(rows) < n and tries < 100 * n:  # the pair prompts are few (9): each once
        tries += 1
        row = makers[kinds[tries % len(kinds)]](rng)
        key = row["prompt"][0]["content"]
        if key not in seen:
            seen.add(key)
            rows.append(row)
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=["multiple"])
    p.add_argument("-n", type=int, default=400)
    p.add_argument("--hard", action="store_true", help="the divisors it rarely gets right (HARD_DIVISORS)")
    p.add_argument("--out", type=Path, default=Path(__file__).with_name("problems.jsonl"))
    a = p.parse_args()
    rows = problems(a.n, a.kinds, hard=a.hard)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{a.out}: {len(rows)} rows")
