"""The API gets the names it shares with the workers (task, Redis keys, stream, statuses, event kinds, error
codes) from contract/, never from a worker module, and importing it never imports torch. contract/ itself is
torch-free and imports nothing of the processes that use it (api, worker, trainer).

Both are checked in a fresh interpreter: this test session itself may well have imported torch already.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Every module of the api package imported in one fresh interpreter, then what that pulled in.
PROBE = """
import importlib, json, pkgutil, sys
names = []
for package in ("api", "controlplane", "db", "core"):
    root = importlib.import_module(package)
    found = pkgutil.walk_packages(root.__path__, package + ".")
    names += sorted(m.name for m in found if m.name != "controlplane.__main__")
for name in names:
    importlib.import_module(name)
print(json.dumps({"imported": names, "torch": "torch" in sys.modules,
                  "worker": sorted(m for m in sys.modules if m == "worker" or m.startswith("worker."))}))
"""


def fresh(code: str) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_importing_every_api_module_imports_neither_torch_nor_any_worker_module() -> None:
    seen = fresh(PROBE)
    imported = seen["imported"]
    assert isinstance(imported, list)
    # The walk really reached the modules that use the shared names.
    assert {"api.main", "controlplane.main", "controlplane.dispatch", "controlplane.reaper",
            "controlplane.scheduler", "controlplane.ingest", "api.services.jobs"} <= set(imported)
    assert seen["torch"] is False
    assert seen["worker"] == []


def test_no_api_source_imports_a_worker_module_even_inside_a_function() -> None:
    # An import inside a function body escapes the check above until that function runs.
    offenders = []
    for path in sorted((ROOT / "api").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "worker":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
            elif isinstance(node, ast.Import) and any(a.name.split(".")[0] == "worker" for a in node.names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert offenders == []


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


def test_importing_every_contract_module_imports_no_torch_deepspeed_or_process_module() -> None:
    seen = fresh(CONTRACT_PROBE)
    imported, loaded = seen["imported"], seen["loaded"]
    assert isinstance(imported, list) and isinstance(loaded, list)
    assert {"contract.spec", "contract.protocol", "contract.codes", "contract.problems", "contract.deepspeed",
            "contract.deepspeed.fields", "contract.deepspeed.fields_gen", "contract.deepspeed.merge",
            "contract.deepspeed.batch", "contract.deepspeed.render", "contract.deepspeed.resolver"} <= set(imported)
    forbidden = {"torch", "deepspeed", "api", "worker", "trainer"}
    assert sorted(m for m in loaded if m.split(".")[0] in forbidden) == []


def test_the_worker_and_the_api_use_the_same_names() -> None:
    # Both sides spell each name through the one module: the objects they hold are the very same.
    seen = fresh("""
import json
import controlplane.dispatch, controlplane.ingest, controlplane.reaper, contract.protocol as n, contract.codes as c
import worker.attempt, worker.celery_app, worker.gang, worker.lease, worker.publisher, worker.tasks
print(json.dumps({
    "task": controlplane.dispatch.RUN_JOB is worker.tasks.RUN_JOB is n.RUN_JOB,
    "stream": controlplane.ingest.EVENTS_STREAM is worker.publisher.EVENTS_STREAM is n.EVENTS_STREAM,
    "keys": controlplane.reaper.lease_key is worker.lease.lease_key is worker.gang.lease_key is n.lease_key,
    "codes": controlplane.reaper.FailureCode is worker.attempt.FailureCode is c.FailureCode,
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
