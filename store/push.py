"""`python -m store.push --store CONFIG`: uploads files to the store in a process of its own, for a
caller that must not share its interpreter with the upload, one request at a time for as long as the caller keeps
it.

The trainer is that caller. An upload thread inside the training process needs the GIL for every chunk it reads,
hashes and hands to the client, so the training loop's launches may wait on it; and a call into the client cannot
be stopped from another thread, so an upload given up at the trainer's end went on until the process exited. In a
process of its own the upload shares only the host's cores and memory bandwidth with training, and is stopped by
ending the process. Kept for the trainer's life, it starts once, not once per checkpoint.

stdin: one JSON line per request, `{"prefix": KEY, "source": DIR, "files": [paths relative to DIR]}`; each file
goes to `KEY + path`. When stdin closes (the caller ended, even by SIGKILL, or is done) this process ends at once,
mid-upload or not.
stdout, per request: one JSON line per file once it is stored, `{"path", "key", "bytes", "sha256"}` in the order
given, `{"failing": "<error>"}` each time a try fails (retried with backoff until it succeeds or the caller ends
this process), then `{"done": 0}`, or `{"done": 3}` where a file is not in DIR (waiting cannot bring it back).

CONFIG is the store's config as JSON (contract/storage.py `StoreConfig`): `{"url": ..., "options": {...}}`.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from contract.storage import StoreConfig
from store.checkpoints import sleep_backoff
from store.objects import Store, StoreError, error_line

DONE, FILE_GONE = 0, 3
ROOT = Path(__file__).resolve().parent.parent  # the project, which the process imports from


def start(store: Store, launcher: Sequence[str] = ()) -> subprocess.Popen[str]:
    """This program as a child process uploading to `store`, its pipes open (text); `launcher` goes before the
    interpreter (`taskset -c 1`, say)."""
    argv = [*launcher, sys.executable, "-m", "store.push", "--store", store.config.model_dump_json()]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": path})


def _requests(into: queue.Queue[str]) -> None:
    """stdin's lines into `into`; at its end, the end of this process (an upload in flight is cut off: its caller
    is gone or gave it up)."""
    for line in sys.stdin:
        into.put(line)
    os._exit(0)


def _report(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def upload(store: Store, prefix: str, source: Path, files: list[str]) -> int:
    for rel in files:
        path = source / rel
        tries = 0
        while True:
            if not path.is_file():
                print(f"[uploader] {path} is gone before it was uploaded", file=sys.stderr, flush=True)
                return FILE_GONE
            try:
                done = store.put_file(prefix + rel, path)
                break
            except StoreError as exc:  # a bucket that is not there (yet) is retried too
                tries += 1
                _report(failing=error_line(exc))
                sleep_backoff(tries)
        _report(path=rel, key=done.key, bytes=done.bytes, sha256=done.sha256)
    return DONE


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m store.push", description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, type=StoreConfig.model_validate_json,
                   help='the store\'s config as JSON: {"url": "s3://bucket/prefix", "options": {"endpoint": ...}}')
    a = p.parse_args(argv)
    store = Store(a.store)
    pending: queue.Queue[str] = queue.Queue()
    threading.Thread(target=_requests, args=(pending,), daemon=True).start()
    while True:
        request = json.loads(pending.get())
        _report(done=upload(store, request["prefix"], Path(request["source"]), request["files"]))


if __name__ == "__main__":
    main()
