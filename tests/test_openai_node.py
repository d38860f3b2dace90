"""The /v1 face driven by OpenAI's official Node SDK (tests/node/openai_sdk.mjs), as a Node tool would drive it
with only `baseURL` changed: an upload followed to `processed`, jobs made with the `method` form and cancelled,
auto-paged job and event lists, the models, a delete, and the SDK's own error classes for their causes. The
Python SDK's modules (test_openai_files.py, test_openai_jobs.py) test the same face in full, training included;
this one checks that the other official SDK reads the same answers the same way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path
from typing import Any

import pytest

from scripts.stack import Stack
from tests.conftest import create_key
from tests.test_openai_jobs import BASE, chat_lines

SCRIPT = Path(__file__).parent / "node" / "openai_sdk.mjs"
SDK = "openai@7"

pytestmark = pytest.mark.skipif(shutil.which("node") is None or shutil.which("npm") is None,
                                reason="Node.js and npm are not installed (apt-get install nodejs npm)")


@pytest.fixture(scope="module")
def node_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder with the SDK installed from the npm registry and the script beside it (an ES module resolves its
    imports from its own folder)."""
    where = tmp_path_factory.mktemp("node-openai")
    done = subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--prefix", str(where), SDK],
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        pytest.skip(f"npm could not install {SDK} (no registry reachable?): {done.stderr[-500:]}")
    shutil.copy(SCRIPT, where / SCRIPT.name)
    return where


def test_the_node_sdk_reads_the_v1_face_as_openais(stack: Stack, stack_env: dict[str, str], node_dir: Path,
                                                   tmp_path: Path) -> None:
    owner = f"oai-node-{uuid.uuid4().hex[:8]}"
    key = create_key({**os.environ, **stack_env}, owner, "jobs:write")
    train = tmp_path / "train.jsonl"
    train.write_bytes(chat_lines(16))
    done = subprocess.run(["node", SCRIPT.name], cwd=node_dir, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OPENAI_BASE_URL": f"{stack.api_url}/v1", "OPENAI_API_KEY": key,
                               "FT_BASE_MODEL": BASE, "FT_TRAIN_JSONL": str(train)})
    assert done.returncode == 0, done.stderr[-3000:]
    seen: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])

    assert seen["file"] == {"id": seen["file"]["id"], "object": "file", "bytes": train.stat().st_size,
                            "purpose": "fine-tune", "status": "processed"}
    assert seen["file"]["id"].startswith("file_")
    assert seen["job"] == {"object": "fine_tuning.job", "status": "cancelled", "model": BASE,
                           "training_file": seen["file"]["id"], "n_epochs": 1}
    # Auto-paged two at a time, newest first: the owner's three jobs, each once.
    assert seen["listed"] == list(reversed(seen["created"]))
    events = seen["events"]
    assert events and all(e["object"] == "fine_tuning.job.event" for e in events)
    assert len({e["id"] for e in events}) == len(events)
    assert [e["created_at"] for e in events] == sorted((e["created_at"] for e in events), reverse=True)
    assert BASE in seen["models"]
    assert seen["deleted"] is True

    errors = seen["errors"]
    assert errors["not_found"]["raised"] == "NotFoundError" and errors["not_found"]["status"] == 404
    assert errors["bad_param"] == {"raised": "BadRequestError", "status": 400,
                                   "param": "hyperparameters.n_epochs", "code": "invalid_request"}
    # dpo on a chat file: the file's shape is the method's other one
    assert errors["dpo"]["raised"] == "BadRequestError" and errors["dpo"]["param"] == "training_file"
    assert errors["cancel_ended"]["raised"] == "ConflictError" and errors["cancel_ended"]["status"] == 409
    assert errors["wrong_key"]["raised"] == "AuthenticationError" and errors["wrong_key"]["code"] == "invalid_api_key"
