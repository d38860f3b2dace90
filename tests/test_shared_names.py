"""The names the control plane and the workers share (task, Redis keys, stream, statuses, event kinds, error
codes) are the very objects of contract/, which is torch-free and whose name modules need only the standard
library. Checked in a fresh interpreter: this test session itself may well have imported torch already.

Which package may import which (function bodies included) and what the API and the control plane load in a fresh
interpreter are tests/test_layers.py's rules, checked there once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

def fresh(code: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_shared_names_modules_import_only_the_standard_library() -> None:
    seen = fresh("import json, sys\nbefore = set(sys.modules)\nimport contract.protocol, contract.codes\n"
                 "print(json.dumps({'new': sorted(set(sys.modules) - before)}))")
    new = seen["new"]
    assert isinstance(new, list)
    assert set(new) <= {"contract", "contract.protocol", "contract.codes", "enum", "collections.abc"}, new


# Every module of the contract package imported in one fresh interpreter, then what that pulled in.
CONTRACT_PROBE = """
import importlib, json, pkgutil, sys
import contract
names = sorted(m.name for m in pkgutil.walk_packages(contract.__path__, "contract."))
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "loaded": sorted(sys.modules)}))
"""


def test_importing_every_contract_module_imports_neither_torch_nor_deepspeed() -> None:
    seen = fresh(CONTRACT_PROBE)
    imported, loaded = seen["imported"], seen["loaded"]
    assert isinstance(imported, list) and isinstance(loaded, list)
    assert {"contract.spec", "contract.protocol", "contract.codes", "contract.problems", "contract.deepspeed",
            "contract.deepspeed.fields", "contract.deepspeed.fields_gen", "contract.deepspeed.merge",
            "contract.deepspeed.batch", "contract.deepspeed.render", "contract.deepspeed.resolver",
            "contract.stages"} <= set(imported)
    forbidden = {"torch", "deepspeed"}
    assert sorted(m for m in loaded if m.split(".")[0] in forbidden) == []


def test_the_worker_and_the_api_use_the_same_names() -> None:
    # Both sides spell each name through the one module: the objects they hold are the very same.
    seen = fresh("""
import json
import controlplane.dispatcher, controlplane.ingest, controlplane.reaper, contract.protocol as n, contract.codes as c
import db.attempts
import worker.attempt, worker.celery_app, worker.gang, worker.lease, worker.publisher, worker.tasks
print(json.dumps({
    "task": controlplane.dispatcher.RUN_JOB is worker.tasks.RUN_JOB is n.RUN_JOB,
    "stream": controlplane.ingest.EVENTS_STREAM is worker.publisher.EVENTS_STREAM is n.EVENTS_STREAM,
    "keys": controlplane.reaper.lease_key is worker.lease.lease_key is worker.gang.lease_key is n.lease_key,
    "codes": db.attempts.FailureCode is worker.attempt.FailureCode is c.FailureCode,
    "task_registered": n.RUN_JOB in worker.celery_app.app.tasks,
}))
""")
    assert seen == {"task": True, "stream": True, "keys": True, "codes": True, "task_registered": True}


def test_the_job_statuses_are_the_ones_the_table_allows() -> None:
    # The enum, the ORM's constraint and the first migration's constraint name the same set.
    from contract.codes import JobStatus, sql_list
    from db.models import Job

    allowed = f"status IN {sql_list(JobStatus)}"
    migration = (ROOT / "migrations/versions/0001_create_jobs_and_job_events.py").read_text()
    assert allowed in migration
    checks = [c for c in Job.__table__.constraints if c.name and str(c.name).endswith("status_valid")]
    assert [str(c.sqltext) for c in checks] == [allowed]
