"""Which client the artifact store uses: upload and download throughput of obstore, boto3 and s3fs against the
same S3-protocol server, and of obstore's folder store against a plain file copy.

`python -m bench.store_clients [--mib 512] [--endpoint URL --bucket B]` starts moto's S3 server on this machine
unless an endpoint is given (MinIO or any S3 server: its bucket must exist), writes a file of random bytes and,
for each client that is installed, uploads it (multipart, 8 MiB parts, the store's own setting) and downloads it
to a file, timing each from the first request to the last byte on disk. One JSON line per figure; MB/s are
10^6 bytes per second of the file's size. A client that is not installed is reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

PART = 8 << 20
CREDS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_REGION": "us-east-1"}


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def obstore_s3(src: Path, dst: Path, endpoint: str, bucket: str) -> tuple[float, float]:
    from contract.storage import StoreConfig
    from store.objects import Store

    store = Store(StoreConfig(url=f"s3://{bucket}/obstore", options={"endpoint": endpoint}))
    up = timed(lambda: store.put_file("big", src))
    down = timed(lambda: store.download("big", dst))
    return up, down


def boto3_s3(src: Path, dst: Path, endpoint: str, bucket: str) -> tuple[float, float]:
    import boto3
    from boto3.s3.transfer import TransferConfig

    client = boto3.client("s3", endpoint_url=endpoint)
    config = TransferConfig(multipart_chunksize=PART, multipart_threshold=PART, max_concurrency=10)
    up = timed(lambda: client.upload_file(str(src), bucket, "boto3/big", Config=config))
    down = timed(lambda: client.download_file(bucket, "boto3/big", str(dst), Config=config))
    return up, down


def s3fs_s3(src: Path, dst: Path, endpoint: str, bucket: str) -> tuple[float, float]:
    import s3fs

    fs = s3fs.S3FileSystem(endpoint_url=endpoint)
    up = timed(lambda: fs.put_file(str(src), f"{bucket}/s3fs/big", chunksize=PART))
    down = timed(lambda: fs.get_file(f"{bucket}/s3fs/big", str(dst)))
    return up, down


def obstore_folder(src: Path, dst: Path, root: Path) -> tuple[float, float]:
    from contract.storage import StoreConfig
    from store.objects import Store

    store = Store(StoreConfig(url=f"file://{root / 'obstore'}"))
    return timed(lambda: store.put_file("big", src)), timed(lambda: store.download("big", dst))


def copy_folder(src: Path, dst: Path, root: Path) -> tuple[float, float]:
    target = root / "copy" / "big"
    target.parent.mkdir(parents=True, exist_ok=True)
    return timed(lambda: shutil.copyfile(src, target)), timed(lambda: shutil.copyfile(target, dst))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--endpoint")
    parser.add_argument("--bucket", default="bench")
    args = parser.parse_args()
    os.environ.update({k: os.environ.get(k, v) for k, v in CREDS.items()})
    work = Path(tempfile.mkdtemp(prefix="store-bench-"))
    server = None
    try:
        endpoint = args.endpoint
        if endpoint is None:
            from tests.s3_support import S3Server

            server = S3Server(work)
            endpoint, bucket = server.endpoint, server.bucket()
        else:
            bucket = args.bucket
        src = work / "src"
        with src.open("wb") as f:
            for _ in range(args.mib):
                f.write(os.urandom(1 << 20))
        size = src.stat().st_size
        runs: list[tuple[str, str, Callable[[Path, Path], tuple[float, float]]]] = [
            ("obstore", "s3", lambda s, d: obstore_s3(s, d, endpoint, bucket)),
            ("boto3", "s3", lambda s, d: boto3_s3(s, d, endpoint, bucket)),
            ("s3fs", "s3", lambda s, d: s3fs_s3(s, d, endpoint, bucket)),
            ("obstore", "folder", lambda s, d: obstore_folder(s, d, work)),
            ("shutil.copyfile", "folder", lambda s, d: copy_folder(s, d, work)),
        ]
        for client, kind, run in runs:
            dst = work / f"dst-{client}-{kind}"
            try:
                up, down = run(src, dst)
            except ImportError as exc:
                print(json.dumps({"client": client, "store": kind, "skipped": f"not installed: {exc}"}))
                continue
            assert dst.stat().st_size == size
            dst.unlink()
            print(json.dumps({"client": client, "store": kind, "mib": args.mib,
                              "server": "moto (this machine)" if server else endpoint,
                              "upload_mb_s": round(size / up / 1e6, 1), "download_mb_s": round(size / down / 1e6, 1)}),
                  flush=True)
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
