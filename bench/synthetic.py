"""The benchmark's token stream, the same for every recipe: wikitext-like line lengths.

A third of the lines are empty and the rest have log-normal lengths (median ~90 tokens), as in
wikitext-2 tokenized by GPT-2. The trainer reads them as text documents; its tokenizer maps one
character to one token, so a line of n letters is n real tokens.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer.tiny import build_tokenizer


def line_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.where(rng.random(n) < 0.33, 0, np.clip(rng.lognormal(4.5, 0.8, n), 1, 2000)).astype(int)


def write_documents(path: Path, n_tokens: int, seed: int = 0) -> int:
    """Non-empty lines as documents separated by blank lines, n_tokens in all; returns the count."""
    rng = np.random.default_rng(seed + 1)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz", dtype=np.uint8)
    docs, total = [], 0
    for n in line_lengths(4 * n_tokens // 90 + 1000, seed):
        if n == 0:
            continue
        docs.append(rng.choice(letters, size=n).tobytes().decode())
        total += n
        if total >= n_tokens:
            break
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n\n".join(docs) + "\n")
    return len(docs)


def write_model_dir(out: Path, config: object) -> Path:
    """config.json and a byte tokenizer (no merges: one character, one token); weights are random-initialised."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer("abcdefghijklmnopqrstuvwxyz", vocab_size=257, max_pos=4096)
    config.save_pretrained(out)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(out)
    return out
