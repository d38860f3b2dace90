"""Local training text for the demo and the tests: the Python standard library's own docstrings.

Nothing can be downloaded where this runs, and this is real English prose with code in it, so a
tiny model's loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import importlib
import inspect
import random
from pathlib import Path

MODULES = ["abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "csv",
           "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "gzip",
           "heapq", "hmac", "html", "http.client", "inspect", "io", "ipaddress", "itertools", "json", "logging",
           "mailbox", "numbers", "operator", "os", "pathlib", "pickle", "pprint", "queue", "random", "re",
           "sched", "secrets", "shlex", "shutil", "socket", "sqlite3", "statistics", "string", "struct",
           "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback",
           "typing", "unittest", "urllib.parse", "uuid", "warnings", "weakref", "zipfile"]


def documents(limit_chars: int = 400_000) -> list[str]:
    docs: list[str] = []
    seen: set[str] = set()
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        for obj in [module, *(v for _, v in inspect.getmembers(module))]:
            doc = inspect.getdoc(obj) if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj) \
                else None
            if doc and len(doc) > 80 and doc not in seen:
                seen.add(doc)
                docs.append(doc.strip())
    random.Random(0).shuffle(docs)
    out, total = [], 0
    for d in docs:
        if total > limit_chars:
            break
        out.append(d)
        total += len(d)
    return out


def write_corpus(data_dir: Path, limit_chars: int = 400_000, validation_docs: int = 40) -> tuple[Path, Path]:
    """Writes train.txt and validation.txt (documents separated by blank lines) into data_dir."""
    docs = [d.replace("\n\n", "\n") for d in documents(limit_chars)]
    data_dir.mkdir(parents=True, exist_ok=True)
    train, val = data_dir / "train.txt", data_dir / "validation.txt"
    train.write_text("\n\n".join(docs[validation_docs:]) + "\n")
    val.write_text("\n\n".join(docs[:validation_docs]) + "\n")
    return train, val
