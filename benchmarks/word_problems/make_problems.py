"""Short chat word problems with a verifiable answer, for benchmarks on a real chat model
(benchmarks/real_model.py): 400 rows of ``{"prompt": [user message], "answer": int}``.

    .venv/bin/python benchmarks/word_problems/make_problems.py   # writes problems.jsonl beside it
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Tom", "Ann", "Raj", "Mia", "Leo", "Sara", "Ken", "Ivy"]
THINGS = ["apples", "books", "coins", "pens", "cards", "shells", "stamps", "marbles"]


def problems(n: int = 400, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        who, what = rng.choice(NAMES), rng.choice(THINGS)
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        if rng.random() < 0.5:
            question, answer = f"{who} has {a} {what} and gets {b} more. How many {what} does {who} have now?", a + b
        else:
            a, b = max(a, b), min(a, b)
            question, answer = f"{who} has {a} {what} and gives away {b}. How many {what} are left?", a - b
        message = {"role": "user", "content": f"{question} Answer with the number only."}
        rows.append({"prompt": [message], "answer": answer})
    return rows


if __name__ == "__main__":
    out = Path(__file__).with_name("problems.jsonl")
    out.write_text("".join(json.dumps(r) + "\n" for r in problems()))
    print(out)
