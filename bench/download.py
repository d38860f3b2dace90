"""`ft download` of a large export against reading the same bytes from local disk.

`python -m bench.download [--gb 2.5] [--store file|s3] [--parallel 4] [--connections 4] [--chunk-size 64M]`
starts the API on a database of its own with the store a folder (`file`) or a moto S3 server on this machine
(`s3`), makes a succeeded job whose export is a `model.safetensors` of `--gb` GB of random bytes plus a small config
(written straight into the store and the job's row, as a worker's export would leave them), then times, each from
start to exit:

- `ft_download_mb_s`: `ft download JOB DIR` (the CLI: through the API, the large file in `--chunk-size` ranged
  chunks, `--connections` at once; a chunk size above the file: one stream; every file hashed and checked against
  its SHA-256, written to `.part` and renamed), the export's bytes (10^6 per MB) over the wall time;
- `local_read_mb_s`: reading the stored file from the local disk (`cat FILE > /dev/null`), the same bytes;
- `local_copy_mb_s`: `cp` of the stored file to another folder of the same disk.

The page cache is dropped before each where this user may (root), so each reads from the disk. Prints one JSON line
and removes everything it made.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg

from bench.store_stack import store_stack
from core.settings import SharedSettings
from store.layout import output_prefix
from store.objects import Store

# The job the export is attached to: submitted to a queue no worker serves, then marked succeeded.
PARKED = "bench-unserved"


def drop_caches() -> bool:
    try:
        subprocess.run(["sync"], check=True)
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=2.5)
    parser.add_argument("--store", choices=["file", "s3"], default="file")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--chunk-size", default="64M")
    args = parser.parse_args()
    with contextlib.ExitStack() as cleanup:
        own = store_stack(cleanup, prefix="ft-download-", store=args.store, env={"FT_ALLOW_HUB_MODELS": "true"})
        base, env, key, stack = own.base, own.env, own.key, own.stack
        (base / "train.txt").write_text("a line to train on\n")
        stack.start_api()
        stack.wait_ready()

        # The export: written into the store as export_store.py writes it, and named in the job's row.
        store = Store(SharedSettings(store_url=env["FT_STORE_URL"],
                                     s3_endpoint_url=env.get("FT_S3_ENDPOINT_URL")).store_config())
        source = base / "model.safetensors"
        with source.open("wb") as f:
            for _ in range(int(args.gb * 1e9) // (1 << 24)):
                f.write(os.urandom(1 << 24))
        job = json.loads(subprocess.run(
            ["curl", "-sS", "-H", f"Authorization: Bearer {key}", "-H", "Content-Type: application/json", "-d",
             json.dumps({"name": "download-bench", "model": "org/model", "data": {"train": "train.txt"},
                         "resources": {"queue": PARKED}}), f"{stack.api_url}/jobs?dry_run=false"],
            check=True, capture_output=True, text=True).stdout)
        if "id" not in job:
            raise SystemExit(f"the job was refused: {job}")
        prefix = output_prefix(job["id"])
        files = []
        for path, local in (("model.safetensors", source), ("config.json", None)):
            stored = store.put_file(prefix + path, local) if local else store.put_bytes(prefix + path, b"{}")
            files.append({"path": path, "bytes": stored.bytes, "sha256": stored.sha256})
        total = sum(f["bytes"] for f in files)
        output = {"files": files, "bytes": total, "store": prefix, "format": "huggingface"}
        with psycopg.connect(env["FT_DATABASE_URL"].replace("+psycopg", ""), autocommit=True) as conn:
            conn.execute("UPDATE jobs SET status = 'succeeded', output = %s WHERE id = %s",
                         (json.dumps(output), job["id"]))
        stored_file = base / "store" / prefix / "model.safetensors" if args.store == "file" else source

        cold = drop_caches()
        dest = base / "downloaded"
        cli_env = {**os.environ, "FT_API_URL": stack.api_url, "FT_API_KEY": key}
        download_s = timed([sys.executable, "-m", "ftcli.main", "download", job["id"], str(dest), "--json",
                            "--parallel", str(args.parallel), "--connections", str(args.connections),
                            "--chunk-size", args.chunk_size], cli_env)
        digest = hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest()
        assert digest == files[0]["sha256"]
        drop_caches()
        read_s = timed(["sh", "-c", f"cat '{stored_file}' > /dev/null"])
        drop_caches()
        copy_s = timed(["cp", str(stored_file), str(base / "copied")])
        print(json.dumps({
            "figure": "ft download", "store": args.store, "bytes": total, "parallel": args.parallel,
            "connections": args.connections, "chunk_size": args.chunk_size, "load_average_1m": os.getloadavg()[0],
            "page_cache_dropped": cold, "ft_download_mb_s": round(total / download_s / 1e6, 1),
            "local_read_mb_s": round(total / read_s / 1e6, 1), "local_copy_mb_s": round(total / copy_s / 1e6, 1)}),
            flush=True)


if __name__ == "__main__":
    main()
