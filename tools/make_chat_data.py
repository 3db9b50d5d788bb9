"""Writes a small chat data set whose answers follow from the prompts: sums of two numbers.

Each record is a chat in the JSON Lines format the trainer reads (docs/data.md, "Chat data"):
``{"messages": [{"role": "user", "content": "What is 12 + 7?"}, {"role": "assistant", "content":
"12 + 7 = 19."}]}``. The same ``--seed`` writes the same file.

Usage: python tools/make_chat_data.py runs/data/chat_sums.jsonl [--records 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

QUESTIONS = ("What is {a} + {b}?", "Add {a} and {b}.", "{a} plus {b} makes?", "Sum: {a}, {b}")


def chat(rng: random.Random) -> dict:
    a, b = rng.randrange(100), rng.randrange(100)
    question = rng.choice(QUESTIONS).format(a=a, b=b)
    messages = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": f"{a} + {b} = {a + b}."},
    ]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Answer with the sum only."})
    return {"messages": messages}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the .jsonl file to write")
    parser.add_argument("--records", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as f:
        f.writelines(json.dumps(chat(rng)) + "\n" for _ in range(args.records))
    print(f"wrote {args.records} chats to {args.out}")


if __name__ == "__main__":
    main()
