"""The artifact store's client (store/objects.py) against both kinds of store, a folder and a real S3 server, and
a node's cache of stored objects (store/cache.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from contract.spec import RunPaths, StoreRef
from contract.storage import StoreConfig
from core.settings import SharedSettings, settings_or_exit
from store import push
from store.backends import BadConfig
from store.cache import CacheFull, NodeCache
from store.objects import Store, TooLarge
from tests.helpers import free_port
from tests.s3_support import CREDENTIALS, S3Server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    yield server
    server.stop()


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Store:
    if request.param == "file":
        return Store(StoreConfig(url=f"file://{tmp_path / 'store'}"))
    server: S3Server = request.getfixturevalue("s3_server")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    return Store(server.config(server.bucket(), "prefix"))


def chunks(n: int, size: int = 1 << 20) -> Iterator[bytes]:
    for i in range(n):
        yield bytes([i % 251]) * size


def test_a_streamed_upload_is_stored_whole_with_its_size_and_sha256(store: Store) -> None:
    data = b"".join(chunks(20))
    stored = store.put("files/one", chunks(20))
    assert (stored.bytes, stored.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert store.head("files/one") == len(data) and store.head("files/none") is None
    assert [(i.key, i.bytes) for i in store.list("files/")] == [("files/one", len(data))]
    assert b"".join(store.iter("files/one")) == data
    assert b"".join(store.iter("files/one", 5, 1 << 21)) == data[5:1 << 21]
    assert b"".join(store.iter("files/one", len(data) - 3)) == data[-3:]


def test_an_upload_that_fails_half_way_or_passes_its_limit_leaves_nothing(store: Store) -> None:
    async def broken() -> AsyncIterator[bytes]:
        for chunk in chunks(12):
            yield chunk
        raise ConnectionResetError("the client went away")

    with pytest.raises(ConnectionResetError):
        asyncio.run(store.put_async("files/broken", broken()))
    with pytest.raises(TooLarge):
        store.put("files/big", chunks(12), limit=10 << 20)
    assert store.list("") == []


def test_a_download_whose_bytes_differ_from_the_recorded_sha256_leaves_nothing(store: Store, tmp_path: Path) -> None:
    store.put_bytes("files/x", b"hello")
    with pytest.raises(ValueError, match="SHA-256"):
        store.download("files/x", tmp_path / "got" / "x", sha256="0" * 64)
    assert list((tmp_path / "got").iterdir()) == []
    assert store.download("files/x", tmp_path / "got" / "x").bytes == 5
    assert (tmp_path / "got" / "x").read_bytes() == b"hello"
    assert store.delete_prefix("files/") == 1 and store.list("") == []


def test_a_batch_delete_removes_every_key_named_and_takes_missing_ones_as_gone(store: Store) -> None:
    for i in range(5):
        store.put_bytes(f"jobs/j/checkpoints/k{i}", b"x")
    store.put_bytes("jobs/j/keep", b"y")
    store.delete_many(["jobs/j/checkpoints/k0", "jobs/j/checkpoints/missing", "jobs/j/checkpoints/k3"])
    assert sorted(i.key for i in store.list("jobs/")) == [
        "jobs/j/checkpoints/k1", "jobs/j/checkpoints/k2", "jobs/j/checkpoints/k4", "jobs/j/keep"]
    assert store.delete_prefix("jobs/j/checkpoints/") == 3
    assert [i.key for i in store.list("jobs/")] == ["jobs/j/keep"]
    store.delete_many([])


def test_the_run_spec_carries_the_store_config_whole_and_the_trainer_opens_the_same_store(store: Store) -> None:
    store.put_bytes("jobs/j/fences/attempt-1.json", b"{}")
    ref = RunPaths(job_dir="/j", checkpoint_dir="/j/c", output_dir="/j/o",
                   store=StoreRef(config=store.config, job_id="job_ref")).model_dump_json()
    assert json.loads(ref)["store"]["config"] == store.config.model_dump()
    carried = RunPaths.model_validate_json(ref).store
    assert carried is not None and carried.config == store.config and hash(carried.config) == hash(store.config)
    config = carried.config
    assert Store(config).get_bytes("jobs/j/fences/attempt-1.json") == b"{}"


def test_a_folder_store_is_named_absolutely_to_other_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    store = Store(StoreConfig(url="file://./var/store"))
    assert store.config == StoreConfig(url=f"file://{tmp_path.resolve()}/var/store") and store.where.startswith("/")


STORE_SETTINGS = ("FT_STORE_URL", "FT_S3_ENDPOINT_URL", "FT_STORE_OPTIONS")


def test_the_settings_build_one_store_config_with_the_backends_options(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    for name in STORE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    assert SharedSettings().store_config() == StoreConfig(url="file://./var/store")
    monkeypatch.setenv("FT_STORE_URL", "s3://bucket/prefix")
    monkeypatch.setenv("FT_S3_ENDPOINT_URL", "http://127.0.0.1:9000")
    assert SharedSettings().store_config() == StoreConfig(url="s3://bucket/prefix",
                                                          options={"endpoint": "http://127.0.0.1:9000"})
    monkeypatch.setenv("FT_STORE_URL", f"file://{tmp_path}")  # one environment for either kind of store
    assert SharedSettings().store_config() == StoreConfig(url=f"file://{tmp_path}")
    monkeypatch.setenv("FT_STORE_URL", "s3://bucket/prefix")
    monkeypatch.delenv("FT_S3_ENDPOINT_URL")
    monkeypatch.setenv("FT_STORE_OPTIONS", '{"endpoint": "http://minio:9000"}')
    assert SharedSettings().store_config().options == {"endpoint": "http://minio:9000"}


@pytest.mark.parametrize(("env", "said"), [
    ({"FT_STORE_URL": "gs://bucket/prefix"}, "FT_STORE_URL: the store is file://<folder> or s3://<bucket>/<prefix>"),
    ({"FT_STORE_URL": "s3://"}, "FT_STORE_URL: the store is file://<folder> or s3://<bucket>/<prefix>"),
    ({"FT_STORE_URL": "s3://b/p", "FT_STORE_OPTIONS": '{"endpont": "http://minio:9000"}'},
     "FT_STORE_OPTIONS: the s3:// store takes no option 'endpont' (its options: endpoint)"),
    ({"FT_STORE_URL": "file:///srv/store", "FT_STORE_OPTIONS": '{"endpoint": "http://minio:9000"}'},
     "FT_STORE_OPTIONS: the file:// store takes no option 'endpoint' (its options: none)"),
    ({"FT_STORE_URL": "s3://b/p", "FT_STORE_OPTIONS": "{endpoint"}, "FT_STORE_OPTIONS: not a JSON object"),
    ({"FT_STORE_URL": "s3://b/p", "FT_STORE_OPTIONS": '{"endpoint": "http://a:9000"}',
      "FT_S3_ENDPOINT_URL": "http://b:9000"}, "FT_STORE_OPTIONS: names an endpoint other than FT_S3_ENDPOINT_URL's"),
], ids=["scheme", "no-bucket-or-folder", "option", "folder-option", "json", "two-endpoints"])
def test_store_settings_no_backend_takes_stop_the_process_naming_the_setting(
        env: dict[str, str], said: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in STORE_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as stopped:
        settings_or_exit(SharedSettings, "API")
    assert said in str(stopped.value)


def test_a_config_no_backend_can_open_is_refused_before_anything_is_contacted() -> None:
    with pytest.raises(BadConfig, match=r"^'gs://b/p': the store is file://<folder> or s3://<bucket>/<prefix>$"):
        Store(StoreConfig(url="gs://b/p"))
    with pytest.raises(BadConfig, match=r"^'s3:///p' names no bucket: s3://<bucket>/<prefix>$"):
        Store(StoreConfig(url="s3:///p"))
    with pytest.raises(BadConfig, match="takes no option 'region'"):
        Store(StoreConfig(url="s3://b/p", options={"region": "eu-west-1"}))


def _put(store: Store, key: str, data: bytes) -> str:
    return store.put_bytes(key, data).sha256


def test_the_cache_downloads_once_keeps_what_jobs_hold_and_evicts_the_least_recently_used(store: Store,
                                                                                         tmp_path: Path) -> None:
    cache = NodeCache(tmp_path / "cache", max_bytes=300)
    a, b, c = (_put(store, f"files/{n}", n.encode() * 100) for n in "abc")
    path_a, hold_a = cache.hold(store, "files/a", a, 100)
    inode = path_a.stat().st_ino
    again, hold_again = cache.hold(store, "files/a", a, 100)
    assert again == path_a and path_a.stat().st_ino == inode, "a cached copy was downloaded again"
    hold_again.close()
    _, hold_b = cache.hold(store, "files/b", b, 100)
    hold_b.close()
    os.utime(cache.path(b), (1, 1))  # b is the least recently used
    _, hold_c = cache.hold(store, "files/c", c, 100)
    hold_c.close()
    d = _put(store, "files/d", b"d" * 100)
    _, hold_d = cache.hold(store, "files/d", d, 100)
    assert not cache.path(b).exists(), "the least recently used entry was kept"
    assert cache.path(a).exists(), "an entry a job holds was evicted"
    os.utime(cache.path(a), (0, 0))  # now the oldest, but still held
    e = _put(store, "files/e", b"e" * 100)
    cache.hold(store, "files/e", e, 100)[1].close()
    assert cache.path(a).read_bytes() == b"a" * 100 and not cache.path(c).exists()
    hold_a.close()
    hold_d.close()
    with pytest.raises(CacheFull):
        cache.hold(store, "files/f", _put(store, "files/f", b"f" * 400), 400)
    with pytest.raises(ValueError, match="SHA-256"):
        cache.hold(store, "files/a", "1" * 64, 100)
    assert not cache.path("1" * 64).exists()


FETCH = """
import sys
from pathlib import Path
from contract.storage import StoreConfig
from store.cache import NodeCache
from store.objects import Store
store = Store(StoreConfig.model_validate_json(sys.argv[1]))
path, hold = NodeCache(Path(sys.argv[2]), 1 << 30).hold(store, "files/big", sys.argv[3], int(sys.argv[4]))
print(path.stat().st_ino)
"""


def test_two_slots_fetching_the_same_object_at_once_download_it_once(store: Store, tmp_path: Path) -> None:
    stored = store.put("files/big", chunks(16))
    argv = [sys.executable, "-c", FETCH, store.config.model_dump_json(), str(tmp_path / "cache"), stored.sha256,
            str(stored.bytes)]
    procs = [subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    inodes = {p.communicate(timeout=120)[0].strip() for p in procs}
    assert all(p.returncode == 0 for p in procs)
    assert len(inodes) == 1, "each slot wrote its own copy"
    leftovers = [p.name for p in (tmp_path / "cache" / "sha256").iterdir() if p.name.endswith(".part")]
    assert leftovers == []


def request(proc: subprocess.Popen[str], prefix: str, source: Path, files: list[str]) -> list[dict[str, Any]]:
    """One request, as the trainer sends it; the reports up to and with its `done` line."""
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"prefix": prefix, "source": str(source), "files": files}) + "\n")
    proc.stdin.flush()
    rows = []
    while not rows or "done" not in rows[-1]:
        rows.append(json.loads(proc.stdout.readline()))
    return rows


def test_the_push_process_reports_each_file_it_stored_request_after_request(store: Store, tmp_path: Path) -> None:
    source = tmp_path / "ckpt"
    (source / "global_step3").mkdir(parents=True)
    blobs = {"latest": b"global_step3", "global_step3/model_states.pt": os.urandom(9 << 20)}  # one multipart upload
    for rel, data in blobs.items():
        (source / rel).write_bytes(data)
    proc = push.start(store)
    try:
        rows = request(proc, "jobs/j/step-3/", source, sorted(blobs))
        assert rows == [{"path": rel, "key": f"jobs/j/step-3/{rel}", "bytes": len(blobs[rel]),
                         "sha256": hashlib.sha256(blobs[rel]).hexdigest()} for rel in sorted(blobs)] + [{"done": 0}]
        assert store.get_bytes("jobs/j/step-3/global_step3/model_states.pt") == blobs["global_step3/model_states.pt"]
        # A file that is not there ends its request with 3; the process serves the next one.
        rows = request(proc, "jobs/j/step-4/", source, ["latest", "not-there"])
        assert [r.get("path") for r in rows[:-1]] == ["latest"] and rows[-1] == {"done": 3}
        assert request(proc, "jobs/j/step-5/", source, ["latest"])[-1] == {"done": 0}
        assert store.get_bytes("jobs/j/step-5/latest") == b"global_step3"
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the caller is done: it exits
        assert proc.wait(timeout=10) == 0


def test_the_push_process_retries_a_store_it_cannot_reach_and_ends_when_its_caller_does(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    port = free_port()  # nothing listens there
    proc = push.start(Store(StoreConfig(url="s3://bucket/p", options={"endpoint": f"http://127.0.0.1:{port}"})))
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"prefix": "k/", "source": str(tmp_path), "files": ["f"]}) + "\n")
    proc.stdin.flush()
    failing = json.loads(proc.stdout.readline())
    assert "failing" in failing and failing["failing"], failing
    assert proc.poll() is None  # still retrying
    proc.stdin.close()  # what its caller's death does to it, mid-request
    proc.wait(timeout=10)
