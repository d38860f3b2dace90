"""Server paths out of what clients read.

A client never sees an absolute path of the server's: the model, data and NVMe roots, the artifacts root and the
job folders in it, the store's folder, a node's cache, or where Python and the service are installed. A path under
one of those directories is shown relative to it, behind the directory's label where a client would not know
which directory it is relative to (`<store>/jobs/job_…`, `<site-packages>/torch/…`). The model and data roots
have no label: a client names its model and data relative to them, and gets them back as it named them.

The API rewrites what it reads from Postgres (a job's resolved spec, its checkpoints and output, its events); the
worker rewrites a failed attempt's error and log lines with the directories of its node (worker/attempt.py).
"""

from __future__ import annotations

import os
import re
import site
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

# What may follow the directory itself: a separator, or anything that cannot continue its last name (a full stop
# that ends a sentence cannot; one before more of a name can).
_AFTER = r"(?=/|[^\w.-]|\.(?![\w-])|$)"
# Where the service's code lives: a traceback's frames in it are shown relative to it (`trainer/data.py`).
PROJECT = Path(__file__).resolve().parent.parent


def _forms(directory: str | Path) -> set[str]:
    """A directory as configured, made absolute, and resolved (a symlinked root appears both ways in paths)."""
    path = Path(directory).expanduser()
    forms = {str(path.absolute())}
    try:
        forms.add(str(path.resolve()))
    except (OSError, RuntimeError):
        pass
    return {f.rstrip("/") for f in forms if f.rstrip("/")}


def store_folder(url: str) -> str | None:
    """The folder of a `file://` store URL (FT_STORE_URL), None for S3 (its URL names no server path)."""
    parsed = urlparse(url)
    return parsed.netloc + parsed.path if parsed.scheme == "file" else None


def python_directories() -> list[tuple[str, str]]:
    """Where Python's own modules and the installed packages are: a traceback names them in every frame."""
    packages = {*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    if site.ENABLE_USER_SITE and site.getusersitepackages():
        packages.add(site.getusersitepackages())
    found = [(d, "<site-packages>") for d in packages] + [
        (sysconfig.get_paths()["stdlib"], "<python>"), (sys.prefix, "<python>"), (str(PROJECT), "")]
    # A prefix of /usr is the system's, not Python's: /usr/bin/gcc is no `<python>/bin/gcc`.
    return [(d, label) for d, label in found if d.rstrip("/").count("/") >= 2]


def host_directories() -> list[tuple[str, str]]:
    """The home and temporary folders: whatever else a library writes or reads there stays out too."""
    return [(os.path.expanduser("~"), "~"), (tempfile.gettempdir(), "<tmp>")]


class ServerPaths:
    """Rewrites every absolute path under one of `directories` ((directory, label) pairs) to its form relative to
    the directory, behind the label where it has one; the directory alone becomes its label (or `.`). Of nested
    directories the innermost one wins: a job's folder inside the artifacts root, a root inside the temporary
    folder."""

    def __init__(self, directories: Iterable[tuple[str | Path | None, str]]) -> None:
        labels: dict[str, str] = {}
        for directory, label in directories:
            if directory:
                for form in _forms(directory):  # "/" itself has no form: it would make every path relative
                    labels.setdefault(form, label)
        self.labels = labels
        ordered = sorted(labels, key=len, reverse=True)
        # What comes before a match is checked in _replace: a lookbehind here costs ten times the whole search.
        self.pattern = re.compile("(" + "|".join(map(re.escape, ordered)) + ")" + _AFTER + "(/)?") if ordered else None
        self._encoded = [form.encode() for form in ordered]

    def _replace(self, match: re.Match[str]) -> str:
        start, text = match.start(), match.string
        before = text[start - 1] if start else ""
        inside_a_name = before.isalnum() or before in ("_", ".", "~", "-")
        # Inside a longer path, or a URL's path: not this directory (but a folder store's URL, `file://` and it, is).
        inside_a_path = before == "/" and text[max(0, start - 7):start] != "file://"
        if inside_a_name or inside_a_path:
            return match.group(0)
        label = self.labels[match.group(1)]
        if match.group(2):  # a path under the directory: the rest follows the label's separator
            end = match.end()
            named = end < len(text) and (text[end].isalnum() or text[end] in "._-")
            return f"{label}/" if label else ("" if named else "./")
        return label or "."

    def text(self, value: str) -> str:
        if self.pattern is None or not any(form in value for form in self.labels):
            return value
        return self.pattern.sub(self._replace, value)

    def value(self, value: Any) -> Any:
        """`value` with every string in it (keys included) rewritten: an error, an event's data."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.value(k): self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        return value

    def json(self, body: bytes) -> bytes:
        """A JSON document's bytes with the paths in its strings rewritten. A directory whose name JSON escapes (a
        quote, a backslash, a control character) appears escaped in it, and is left as it is: no root has one."""
        if self.pattern is None or not any(form in body for form in self._encoded):
            return body
        return self.text(body.decode("utf-8", "surrogatepass")).encode("utf-8", "surrogatepass")
