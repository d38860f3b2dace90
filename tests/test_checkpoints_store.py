"""Every committed checkpoint lives in the artifact store: uploaded beside training, committed by a manifest,
resumed from the store on a node whose disk holds nothing of the job, listed and served by the API.

Against the real things: the session stack (its store is a real S3 server), the real launcher, and for the
outage an S3 server of the test's own, really stopped and started again.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from store import checkpoints as stored
from store import layout
from store.objects import Store
from tests.helpers import events_of, wait_for, wait_status
from tests.s3_support import S3Server
from tests.trainer_support import corpus, launch, make_job, of, tiny_model, train_file, write_run_spec  # noqa: F401


def store_of(env: dict[str, str]) -> Store:
    os.environ.update({k: v for k, v in env.items() if k.startswith("AWS_")})
    return Store(env["FT_STORE_URL"], env.get("FT_S3_ENDPOINT_URL"))


def with_store(spec_path: Path, url: str, endpoint: str, job_id: str) -> Path:
    run = json.loads(spec_path.read_text())
    run["paths"]["store"] = {"url": url, "endpoint": endpoint, "job_id": job_id}
    spec_path.write_text(json.dumps(run))
    return spec_path


def test_training_goes_on_while_the_store_is_down_and_commits_once_it_is_back(
        tmp_path: Path, tiny_model: Path, corpus: str, roots: dict[str, Path]) -> None:  # noqa: F811
    server = S3Server(roots["logs"])
    try:
        bucket = server.bucket()
        env = server.env(bucket)
        store = store_of(env)
        job = make_job(tiny_model, train_file(tmp_path, corpus), hyperparameters={"max_steps": 12},
                       checkpointing={"every_steps": 4, "keep_last": 2})
        spec = with_store(write_run_spec(tmp_path, job), env["FT_STORE_URL"], server.endpoint, "job_outage")
        server.stop()
        seen: dict[str, Any] = {}

        def on_event(event: dict[str, Any], proc: Any) -> None:
            # Steps past the first save go on while its upload waits for the store; then the store comes back.
            if event["event"] == "progress" and event["step"] >= 6 and "restarted" not in seen:
                seen["checkpoints_before"] = len(of(seen.setdefault("events", []), "checkpoint"))
                seen["restarted"] = True
                threading.Thread(target=server.start_again, args=([bucket],), daemon=True).start()
            seen.setdefault("events", []).append(event)

        rc, events, tail = launch(spec, on_event=on_event)
        assert rc == 0, tail
        assert seen.get("restarted") and seen["checkpoints_before"] == 0, "a checkpoint was committed while down"
        assert not of(events, "error"), tail
        committed = of(events, "checkpoint")
        assert [c["step"] for c in committed] == [4, 8, 12], (committed, tail[-6000:])
        assert all(c["committed"] and c["key"].endswith(".json") for c in committed)
        manifests, unreadable = stored.read_all(store, "job_outage")
        assert not unreadable and [m.step for m in manifests] == [12, 8]
        # Nothing but the kept checkpoints' objects (and their part lists) is left.
        named = {f.key for m in manifests for f in m.files}
        left = {i.key for i in store.list(layout.checkpoints_prefix("job_outage"))}
        assert named <= left
        assert {k for k in left - named if "/parts/" not in k and not stored.is_manifest_key("job_outage", k)} \
            == set()
    finally:
        server.stop()
