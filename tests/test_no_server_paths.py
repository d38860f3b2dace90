"""No answer shows a client a path of the server's (docs/api.md, "Server paths"): the rewriting itself
(core/serverpaths.py), the worker's (everything it publishes) and the API's refusals of a job's locations.

The hostile-input and fuzz runs hold every answer they get to the same check (tests/serverpaths.py), and
tests/test_jobs_e2e.py a failed job's error end to end; here the check is shown to catch what the service
answered before.
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path

import pytest
import redis

from api.services.paths import check_locations, server_paths
from api.settings import ApiSettings
from contract.spec import JobSpec
from core.serverpaths import ServerPaths
from tests.serverpaths import known_directories, leaks
from worker import publisher
from worker.outcome import classify_failure
from worker.outcome import server_paths as worker_paths
from worker.publisher import Publisher
from worker.settings import WorkerSettings


@pytest.fixture
def roots(tmp_path: Path) -> dict[str, Path]:
    found = {name: tmp_path / name for name in ("models", "data", "artifacts", "cache", "store", "nvme")}
    for path in found.values():
        path.mkdir()
    (found["models"] / "tiny").mkdir()
    (found["data"] / "train.txt").write_text("text\n")
    return found


def settings_for(kind: type, roots: dict[str, Path]) -> ApiSettings | WorkerSettings:
    return kind(model_root=str(roots["models"]), data_root=str(roots["data"]), artifacts_root=str(roots["artifacts"]),
                nvme_root=str(roots["nvme"]), cache_root=str(roots["cache"]), store_url=f"file://{roots['store']}")


def test_the_check_catches_what_the_api_answered_before(roots: dict[str, Path]) -> None:
    # A refusal and a job's resolved spec as the API wrote them before it named paths relative to their roots.
    directories = known_directories(*roots.values())
    before = [f"training_file: 'file-doesnotexist' does not exist under the data root {roots['data']}",
              f"model.name_or_path: './nope' is outside the model root {roots['models'].resolve()}; give a directory "
              "under it",
              json.dumps({"data": {"train": str(roots["data"] / "train.txt")}}),
              "File \"/usr/lib/python3/dist-packages/x.py\", line 3"]
    for text in before:
        assert leaks(text, directories), text
    # What a client sent may come back: it is the client's own.
    assert not leaks("'/etc/passwd' is outside the data root", directories, sent='{"train": "/etc/passwd"}')


def test_a_path_under_a_root_is_shown_relative_to_it() -> None:
    paths = ServerPaths([("/srv/ft/data", ""), ("/srv/ft", "<artifacts>"), ("/srv/store", "<store>")])
    cases = {
        "data file /srv/ft/data/corpus/x.jsonl line 2": "data file corpus/x.jsonl line 2",
        "under the data root /srv/ft/data.": "under the data root ..",  # a sentence's full stop ends the root
        "/srv/ft/data.bak/y": "<artifacts>/data.bak/y",  # a longer name is not the root: the next one out is
        "/srv/ft/jobs/job_1/checkpoints/step-8": "<artifacts>/jobs/job_1/checkpoints/step-8",
        "the store file:///srv/store/jobs/x": "the store file://<store>/jobs/x",
        "/other/srv/ft/data/x and http://host/srv/ft/x": "/other/srv/ft/data/x and http://host/srv/ft/x",
        "'/srv/ft/data'": "'.'",
    }
    for before, after in cases.items():
        assert paths.text(before) == after, before
    assert paths.json(b'{"a": ["/srv/ft/data/t.txt"], "/srv/ft": 1}') == b'{"a": ["t.txt"], "<artifacts>": 1}'
    assert paths.value({"k": ["/srv/ft/data/t", 1, None]}) == {"k": ["t", 1, None]}


def test_a_refused_location_is_named_as_the_job_named_it(roots: dict[str, Path]) -> None:
    settings = settings_for(ApiSettings, roots)
    directories = known_directories(*roots.values())
    cases = [({"data": {"train": "nope.txt"}}, "data.train", "'nope.txt' does not exist under the data root"),
             ({"data": {"train": str(roots["data"] / "nope.txt")}}, "data.train",
              "'nope.txt' does not exist under the data root"),
             ({"data": {"train": "../x.txt"}}, "data.train", "'../x.txt' is outside the data root"),
             ({"model": "./missing"}, "model.name_or_path", "'./missing' does not exist under the model root"),
             ({"model": str(roots["models"] / "gone")}, "model.name_or_path", "'gone' does not exist under"),
             ({"deepspeed": {"nvme_path": "../elsewhere"}}, "deepspeed.nvme_path", "is outside the NVMe root")]
    for patch, field, says in cases:
        spec = JobSpec.model_validate({"model": "tiny", "data": {"train": "train.txt"}, **patch})
        errors = {e.field: e.message for e in check_locations(spec, settings)}
        assert says in errors[field], errors
        assert not leaks(errors[field], directories), errors[field]
    # A job that passes is resolved to absolute paths (what the trainer runs from), and shown as it was named.
    spec = JobSpec.model_validate({"model": "tiny", "data": {"train": "train.txt"}})
    assert check_locations(spec, settings) == [] and Path(spec.data.train).is_absolute()
    shown = server_paths(settings).json(spec.model_dump_json().encode())
    assert json.loads(shown)["data"]["train"] == "train.txt" and json.loads(shown)["model"]["name_or_path"] == "tiny"


def test_the_worker_publishes_no_server_path(roots: dict[str, Path], redis_url: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(WorkerSettings, roots)
    try:
        # A trainer's failure as it reaches the worker: a message naming the data file, a traceback through the
        # installed packages and the service's own code, and the job's folder.
        json.loads("{")
    except ValueError:
        frames = traceback.format_exc()
    data = roots["data"] / "corpus" / "train.jsonl"
    tail = [*frames.splitlines(), f"[rank 0] saving to {roots['artifacts'] / 'jobs/job_1/checkpoints/step-4'}",
            f"  File \"{Path(sys.modules['redis'].__file__ or '')}\", line 1"]
    error = classify_failure(1, {"code": "data_error", "message": f"{data} line 2: missing field 'text'"}, tail)
    directories = known_directories(*roots.values())
    assert leaks(json.dumps(error), directories), "the failure as the trainer reported it names server paths"
    client = redis.Redis.from_url(redis_url)
    stream = f"test-no-server-paths-{id(error)}"  # a stream of its own: no control plane reads it
    monkeypatch.setattr(publisher, "EVENTS_STREAM", stream)
    Publisher(client, "job_1", 1, worker_paths(settings)).emit_many([("state", {"status": "failed", "error": error})])
    [(_, fields)] = client.xrange(stream)
    client.delete(stream)
    sent = json.loads(fields[b"data"])["error"]
    assert sent["message"] == "corpus/train.jsonl line 2: missing field 'text'", sent
    assert not leaks(json.dumps(sent), directories), sent
    assert "<site-packages>/redis/" in sent["log_tail"] and "<artifacts>/jobs/job_1/checkpoints" in sent["log_tail"]
