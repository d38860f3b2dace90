"""What an answer must never show a client: an absolute path of the server's (docs/api.md, "Server paths").

The hostile-input and fuzz runs hold every response they get to it (tests/test_hostile_input.py's client, the fuzz
run's checks in tests/test_fuzz_api.py), and a failed job's error is held to it end to end
(tests/test_jobs_e2e.py). What the request itself sent is the client's own, and may come back.
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
from urllib.parse import unquote

from scripts.stack import ROOT


def _top_directories() -> list[str]:
    """The server's real top-level directories (/tmp, /usr, /work, ...): a path that begins with one is the
    server's, whatever follows."""
    return sorted(p.name for p in Path("/").iterdir() if p.is_dir() and re.fullmatch(r"[\w.-]+", p.name))


# An absolute path of at least two parts whose first is a real top-level directory, not inside a longer path or a URL.
ABSOLUTE = re.compile(r"(?<![\w.~:/<>-])/(?:" + "|".join(map(re.escape, _top_directories())) +
                      r")/[\w.+@%-]+(?:/[\w.+@%-]*)*")


def known_directories(*roots: str | Path) -> list[str]:
    """The directories that must not appear in any answer: the given roots (as configured and as resolved), this
    checkout, the Python installation and the temporary folder the tests put the roots in."""
    found = {str(ROOT), str(Path(ROOT).resolve()), sys.prefix, sys.base_prefix, sysconfig.get_paths()["stdlib"],
             *site.getsitepackages(), tempfile.gettempdir(), os.path.expanduser("~")}
    for root in roots:
        found |= {str(Path(root).expanduser().absolute()), str(Path(root).expanduser().resolve())}
    # "/" (a home of /) or "/usr" say nothing on their own: the regular expression covers what follows them.
    return sorted((d for d in found if d.count("/") >= 2 or d in (str(ROOT),)), key=len, reverse=True)


def leaks(text: str, directories: Iterable[str], sent: str = "") -> list[str]:
    """The server paths in `text` that `sent` (the request, as the client wrote it) did not hold."""
    sent = sent + "\n" + unquote(sent)
    found = [d for d in directories if d in text and d not in sent]
    found += [m.group(0) for m in ABSOLUTE.finditer(text) if m.group(0) not in sent]
    return found


def request_text(method: str, url: str, body: bytes | str | None) -> str:
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    return f"{method} {url}\n{body or ''}"


def on_server(shown: str, artifacts_root: str | Path) -> Path:
    """Where a path a job response shows under `<artifacts>/` (a checkpoint's, the export's) is on this machine."""
    assert shown.startswith("<artifacts>/jobs/job_"), shown
    return Path(artifacts_root, shown.removeprefix("<artifacts>/"))
