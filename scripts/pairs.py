"""Preference pairs made locally, for the demo's dpo job (examples/dpo-job.json) and the tests: the preferred answer
follows a rule a freshly built model does not know.

The chosen answer of every pair names a colour and the rejected one an animal, each drawn at random, after prompts
drawn at random too: a model has learnt the rule when it ranks a colour above an animal after prompts and words it
was never shown together. A random model ranks them by chance (about half right)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

# By the number of tokens " word." takes under the tests' tiny tokenizer (trainer/tiny.py on the tests' corpus): a
# pair's two answers are equally long, so no length alone tells them apart and a fresh model ranks them by chance.
COLOURS = {4: ["blue", "coral", "cyan", "pink", "purple", "teal"],
           5: ["amber", "black", "brown", "green", "grey", "ivory", "orange", "white"]}
ANIMALS = {4: ["crab", "fox", "frog", "otter"],
           5: ["camel", "duck", "eagle", "goat", "horse", "mouse", "sheep", "spider", "tiger", "whale", "wolf"]}
PROMPTS = ["Name one thing you like", "Tell me a word", "What comes to mind", "Pick something", "Say anything",
           "Give me an answer", "What do you see", "Choose a word"]


def pairs(n: int, seed: int, shape: str = "trl") -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = f"{rng.choice(PROMPTS)} ({rng.randint(0, 999)}):"
        length = rng.choice(sorted(COLOURS))
        good, bad = f" {rng.choice(COLOURS[length])}.", f" {rng.choice(ANIMALS[length])}."
        if shape == "openai":
            out.append({"input": {"messages": [{"role": "user", "content": prompt}]},
                        "preferred_output": [{"role": "assistant", "content": good.strip()}],
                        "non_preferred_output": [{"role": "assistant", "content": bad.strip()}]})
        else:
            out.append({"prompt": prompt, "chosen": good, "rejected": bad})
    return out


def write_pairs(path: Path, n: int, seed: int, shape: str = "trl") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs(n, seed, shape)))
    return path
