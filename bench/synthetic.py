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


def write_stdlib_text(path: Path) -> int:
    """Real English with no download, for loss curves that mean something: the docstrings of the standard
    library's pure-Python modules (a few MB), one document per docstring; returns the characters written."""
    import importlib
    import inspect
    import sys
    import warnings

    docs: list[str] = []
    seen: set[str] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in sorted(sys.stdlib_module_names):
            if name.startswith("_") or name in ("antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"):
                continue
            try:
                mod = importlib.import_module(name)
            except BaseException:  # noqa: BLE001  # some modules refuse to import here; they are just skipped
                continue
            for obj in (mod, *[getattr(mod, n, None) for n in dir(mod) if not n.startswith("_")]):
                doc = inspect.getdoc(obj) if obj is not None else None
                if doc and len(doc) > 200 and doc not in seen and doc.isascii():
                    seen.add(doc)
                    docs.append(doc)
    text = "\n\n".join(docs) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return len(text)


def write_model_dir(out: Path, config: object) -> Path:
    """config.json and a byte tokenizer (no merges: one character, one token); weights are random-initialised."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer("abcdefghijklmnopqrstuvwxyz", vocab_size=257, max_pos=4096)
    config.save_pretrained(out)  # type: ignore[attr-defined]
    tokenizer.save_pretrained(out)
    return out
