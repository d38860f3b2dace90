"""The store's fence against a real folder store and a real S3 server (moto's): a superseded attempt whose manifest
lands after the next attempt took over is never trusted, listed, served or resumed from, and never replaces the
next attempt's commit of the same step; two nodes taking one attempt over agree on one cut."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from contract.storage import StoreConfig
from store import checkpoints as stored
from store import layout
from store.objects import AlreadyExists, Store
from tests.s3_support import CREDENTIALS, S3Server
from trainer import fence
from worker import checkpoints as restoring

JOB = "job_fenced"


@pytest.fixture(params=["file", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Store]:
    if request.param == "file":
        yield Store(StoreConfig(url=f"file://{tmp_path / 'store'}"))
        return
    server: S3Server = request.getfixturevalue("s3")
    for name, value in CREDENTIALS.items():
        monkeypatch.setenv(name, value)
    yield Store(server.config(server.bucket(), "prefix"))


def committed(store: Store, attempt: int, step: int) -> stored.Manifest:
    """A checkpoint of one object, uploaded under the attempt's staging prefix and committed by its manifest."""
    tag = stored.tag_for(step)
    body = f"weights of attempt {attempt} at step {step}".encode()
    done = store.put_bytes(layout.checkpoint_staging_prefix(JOB, attempt, tag) + "model.pt", body)
    manifest = stored.Manifest(layout.checkpoint_manifest_key(JOB, tag, attempt), step, attempt, tag, stored.now(),
                               [stored.ManifestFile("model.pt", done.key, done.bytes, done.sha256)])
    stored.commit(store, manifest)
    return manifest


def steps(manifests: list[stored.Manifest]) -> list[tuple[int, int]]:
    return [(m.attempt, m.step) for m in manifests]


def test_a_create_only_write_has_one_winner(store: Store) -> None:
    store.put_bytes("once", b"first", create=True)
    with pytest.raises(AlreadyExists):
        store.put_bytes("once", b"second", create=True)
    assert store.get_bytes("once") == b"first"


def test_a_manifest_a_superseded_attempt_writes_after_the_takeover_is_never_trusted(store: Store,
                                                                                     tmp_path: Path) -> None:
    committed(store, 1, 10)
    committed(store, 1, 20)
    # Attempt 1's rank 0 checks the fence here, still current; then attempt 2 takes over...
    fence.check_store(store, JOB, 1, "checkpoint step-30")
    taken = stored.raise_fence(store, JOB, 2)
    assert taken == stored.Fence(2, {1: 20})
    # ...and attempt 1's manifests land after it: the race a read-then-write fence cannot close.
    late = committed(store, 1, 30)
    with pytest.raises(fence.Superseded):
        fence.check_store(store, JOB, 1, "checkpoint step-40")

    trusted, refused = stored.read_all(store, JOB)
    assert steps(trusted) == [(1, 20), (1, 10)]
    assert [key for key, _ in refused] == [late.key] and "after attempt 2 had taken over" in refused[0][1]
    api_view = asyncio.run(stored.read_all_async(store, JOB))
    assert steps(api_view) == [(1, 10), (1, 20)]
    assert asyncio.run(stored.read_async(store, JOB, 30)) is None

    # Attempt 2 resumes from step 20, never from the late step 30, and says why it passed it over. The node's
    # scratch keeps only that copy: an older restored one is removed, the late one was never committed.
    for step in (10, 30):
        (tmp_path / "ckpt" / stored.tag_for(step)).mkdir(parents=True)
    said: list[tuple[str, dict[str, Any]]] = []
    chosen = restoring.restore(store, JOB, tmp_path / "ckpt", 0, lambda line, fields: said.append((line, fields)))
    assert chosen is not None and (chosen.attempt, chosen.step) == (1, 20)
    assert (tmp_path / "ckpt" / stored.tag_for(20) / "model.pt").read_bytes() == b"weights of attempt 1 at step 20"
    assert any(late.key in line for line, _ in said), said
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-")) == [stored.tag_for(20)]

    # Attempt 2 commits step 30 too: beside the late one, never replaced by it, and the one served for step 30.
    mine = committed(store, 2, 30)
    stored.commit(store, late)  # attempt 1 retrying its write changes nothing
    found = asyncio.run(stored.read_async(store, JOB, 30))
    assert found is not None and found.key == mine.key and found.attempt == 2
    trusted, _ = stored.read_all(store, JOB)
    assert steps(trusted)[0] == (2, 30)


def test_the_nodes_of_one_attempt_agree_on_one_cut_and_an_older_attempt_cannot_lower_the_fence(store: Store) -> None:
    committed(store, 1, 10)
    first = stored.raise_fence(store, JOB, 2)
    committed(store, 1, 20)  # lands between the two nodes' takeovers
    second = stored.raise_fence(store, JOB, 2)
    assert first == second == stored.Fence(2, {1: 10})
    # A worker of an older attempt that starts late finds the newer one and takes nothing over.
    assert stored.raise_fence(store, JOB, 1) == stored.Fence(2, {1: 10})
    # Attempt 3 cuts attempt 2 where it stands; attempt 1's cut stays the first one, not what attempt 3 can see.
    committed(store, 2, 15)
    third = stored.raise_fence(store, JOB, 3)
    assert third == stored.Fence(3, {1: 10, 2: 15})
    trusted, refused = stored.read_all(store, JOB)
    assert steps(trusted) == [(2, 15), (1, 10)]
    assert [k for k, _ in refused] == [layout.checkpoint_manifest_key(JOB, stored.tag_for(20), 1)]
    assert sorted(os.path.basename(i.key) for i in store.list(layout.fences_prefix(JOB))) == [
        "attempt-00000002.json", "attempt-00000003.json"]


def test_nodes_taking_one_attempt_over_at_once_all_read_the_one_record_that_won(store: Store) -> None:
    committed(store, 1, 10)
    with ThreadPoolExecutor(6) as pool:
        late = pool.submit(lambda: [committed(store, 1, s) for s in (20, 30, 40)])
        fences = list(pool.map(lambda _: stored.raise_fence(store, JOB, 2), range(5)))
        late.result()
    assert len(set(map(repr, fences))) == 1 and fences[0].attempt == 2, fences
    cut = fences[0].cuts[1]
    trusted, refused = stored.read_all(store, JOB)
    assert [m.step for m in trusted] == [s for s in (40, 30, 20, 10) if s <= cut]
    assert all(int(key.split("step-")[1][:8]) > cut for key, _ in refused)
