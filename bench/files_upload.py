"""`POST /files` of a large JSONL file into the embedded store: throughput, and the API process's memory meanwhile.

`python -m bench.files_upload [--gib 1.0] [--runs 2] [--store file|s3]` starts the API (one process, so its RSS is
the whole server's) and the control plane on a database and Redis database of their own, with the store a folder
in a temporary directory (`file`, the default: the embedded store) or a moto S3 server on this machine (`s3`),
writes a JSONL file of {"text": ...} lines, uploads it with curl (`-F file=@...`, so the client is not the
bottleneck) and prints one JSON line per run:

- `mb_per_s`: the file's bytes (10^6 per MB) over the wall time from curl's start to the `201`; it includes the
  multipart parsing, the SHA-256 and the write into the store, and excludes generating the file.
- `rss_growth_mib`: the API process's peak RSS during the upload (sampled every 20 ms from /proc) minus its RSS
  just before it.
- `validated_s`: from the `201` to the control plane's verdict (`processed`), which reads the file back from the
  store and checks every line as the trainer would.

Everything it made is removed at the end. It prints figures and never judges them; each line carries its target.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.service_load import rss_bytes
from bench.store_stack import store_stack

LINE = json.dumps({"text": "The quick brown fox jumps over the lazy dog. " * 20}) + "\n"


def write_jsonl(path: Path, size: int) -> int:
    block = (LINE * max(1, (1 << 20) // len(LINE))).encode()
    written = 0
    with path.open("wb") as f:
        while written < size:
            f.write(block)
            written += len(block)
    return written


class Sampler:
    """The peak RSS of one process while it runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid, [self.pid]))
            time.sleep(0.02)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--store", choices=["file", "s3"], default="file")
    args = parser.parse_args()
    with contextlib.ExitStack() as cleanup:
        own = store_stack(cleanup, prefix="ft-files-upload-", store=args.store,
                          env={"FT_API_WORKERS": "1", "FT_QUOTA_MAX_STORED_BYTES": ""})
        base, key, stack = own.base, own.key, own.stack
        stack.start_api()
        stack.start_controlplane()
        stack.wait_ready()
        data = base / "train.jsonl"
        size = write_jsonl(data, int(args.gib * (1 << 30)))
        api_pid = stack.procs["api"].pid
        for run in range(1, args.runs + 1):
            before = rss_bytes(api_pid, [api_pid])
            with Sampler(api_pid) as sampler:
                start = time.perf_counter()
                done = subprocess.run(["curl", "-sS", "-H", f"Authorization: Bearer {key}", "-F", "purpose=fine-tune",
                                       "-F", "format=jsonl", "-F", f"file=@{data}", f"{stack.api_url}/files"],
                                      capture_output=True, text=True, check=True)
                seconds = time.perf_counter() - start
            created = json.loads(done.stdout)
            assert created.get("bytes") == size, done.stdout[:500]
            checked = time.perf_counter()
            while True:
                found = httpx.get(f"{stack.api_url}/files/{created['id']}",
                                  headers={"Authorization": f"Bearer {key}"}).json()
                if found["status"] != "uploaded":
                    break
                time.sleep(0.2)
            print(json.dumps({
                "figure": "POST /files", "store": args.store, "run": run, "bytes": size,
                "mb_per_s": round(size / seconds / 1e6, 1), "target_mb_per_s": ">= 200 (file store)",
                "rss_before_mib": round(before / 2**20, 1), "rss_growth_mib": round((sampler.peak - before) / 2**20, 1),
                "target_rss_growth_mib": "< 64", "validated": found["status"],
                "validated_s": round(time.perf_counter() - checked, 1)}), flush=True)
            httpx.delete(f"{stack.api_url}/files/{created['id']}", headers={"Authorization": f"Bearer {key}"})


if __name__ == "__main__":
    main()
