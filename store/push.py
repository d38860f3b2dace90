"""`python -m store.push --store URL [--endpoint URL] --prefix KEY --source DIR`: uploads files of `DIR` to the
store in a process of its own, for a caller that must not share its interpreter with the upload.

The trainer is that caller: an upload thread inside the training process takes the GIL back from the training
loop many times a second (each chunk read, hashed and handed to the client), and every time the step's next
kernel launch waits for it. In a process of its own the upload costs training only a share of the host's cores
and memory bandwidth.

stdin: one JSON line, the paths (relative to `DIR`) to upload, each to `KEY + path`. Then stdin stays open: when
it closes (the caller is gone, even by SIGKILL) this process ends too.
stdout: one JSON line per file once it is stored, `{"path", "key", "bytes", "sha256"}` in the order given, and
`{"failing": "<error>"}` each time a try fails; a failing try is retried with backoff until it succeeds or the
caller ends this process. Exit status 0 once every file is stored; 3 when a file is not in `DIR` (waiting cannot
bring it back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
from pathlib import Path

from store.checkpoints import sleep_backoff
from store.objects import Store, StoreError, error_line

FILE_GONE = 3


def _end_with_caller() -> None:
    """Exit as soon as stdin closes: the caller ended, and nothing it does not wait for may outlive it."""
    sys.stdin.read()
    os._exit(1)


def _report(**fields: object) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m store.push", description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True, help="the store's URL (file://… or s3://bucket/prefix)")
    p.add_argument("--endpoint", default=None, help="an S3 server's URL")
    p.add_argument("--prefix", required=True, help="each file's key is this followed by its path")
    p.add_argument("--source", required=True, type=Path, help="the folder the paths are relative to")
    a = p.parse_args(argv)
    paths = json.loads(sys.stdin.readline())
    threading.Thread(target=_end_with_caller, daemon=True).start()
    store = Store(a.store, a.endpoint)
    for rel in paths:
        path = a.source / rel
        tries = 0
        while True:
            if not path.is_file():
                print(f"[uploader] {path} is gone before it was uploaded", file=sys.stderr, flush=True)
                return FILE_GONE
            try:
                done = store.put_file(a.prefix + rel, path)
                break
            except StoreError as exc:  # a bucket that is not there (yet) is retried too
                tries += 1
                _report(failing=error_line(exc))
                sleep_backoff(tries)
        _report(path=rel, key=done.key, bytes=done.bytes, sha256=done.sha256)
    return 0


if __name__ == "__main__":
    sys.exit(main())
