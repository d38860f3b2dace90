"""The layout's rules, read from the code itself: which package may import which, where SQL may be written, and
where a job status or event kind may be spelled as a string (docs/architecture.md).

The layers, lowest first: contract (the torch-free names, job spec and store config) < store (the artifact store's
client) < core (settings, secrets, webhook rules) < db (every SQL statement) < api | controlplane | worker (the
processes); trainer runs under the DeepSpeed launcher and shares only the contract and the store.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from contract.codes import AuditAction, DeliveryStatus, EventKind, JobStatus, WebhookEvent

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("contract", "store", "core", "db", "api", "controlplane", "worker", "trainer", "ftcli")
# What each package may import of the project (itself always).
ALLOWED = {
    "contract": set(),
    "store": {"contract"},
    "core": {"contract", "store"},
    "db": {"contract", "core"},
    "api": {"contract", "store", "core", "db"},
    "controlplane": {"contract", "store", "core", "db"},
    "worker": {"contract", "store", "core", "trainer"},
    "trainer": {"contract", "store"},
    "ftcli": {"contract"},
}
SQL = re.compile(r"^\s*(SELECT|INSERT\s+INTO|UPDATE\s+\w+\s+SET|DELETE\s+FROM|WITH\s+\w+\s+AS|LISTEN|NOTIFY)\b")
DRIVER_CALLS = {"fetch", "fetchrow", "fetchval", "fetchone", "fetchall", "fetchmany", "scalars", "scalar",
                "add_listener"}
# The shared names that are enums in contract/codes.py; spelled elsewhere, one of them could drift unseen.
STATUS_OR_KIND = {m.value for enum in (JobStatus, EventKind, AuditAction, WebhookEvent, DeliveryStatus) for m in enum}


def modules() -> Iterator[tuple[str, Path, ast.Module]]:
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            yield name, path, ast.parse(path.read_text(), str(path))


def imports(tree: ast.Module, name: str) -> Iterator[tuple[int, str]]:
    """Every project module imported anywhere in the module, function bodies included."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.lineno, f"{node.module}.{alias.name}"


def where(path: Path, line: int) -> str:
    return f"{path.relative_to(ROOT)}:{line}"


def docstrings(tree: ast.Module) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_package_imports_one_above_it_or_beside_it() -> None:
    offenders = []
    for name, path, tree in modules():
        package = name.split(".")[0]
        for line, imported in imports(tree, name):
            top = imported.split(".")[0]
            if top in PACKAGES and top != package and top not in ALLOWED[package]:
                offenders.append(f"{where(path, line)} {name} imports {imported}")
    assert offenders == [], "\n".join(offenders)


def test_the_project_modules_import_no_circle() -> None:
    known = {name for name, _, _ in modules()}
    graph: dict[str, set[str]] = {}
    for name, _, tree in modules():
        edges = graph.setdefault(name, set())
        for _, imported in imports(tree, name):
            # `from pkg import mod` names a module; `from mod import name` names something in it.
            target = imported if imported in known else imported.rpartition(".")[0]
            if target in known and target != name and not name.startswith(target + "."):
                edges.add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    assert circles == [], circles


def test_sql_and_driver_calls_live_in_db_only() -> None:
    offenders = []
    for name, path, tree in modules():
        if name.split(".")[0] == "db":
            continue
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
                if SQL.search(node.value):
                    offenders.append(f"{where(path, node.lineno)} SQL text {node.value.strip()[:40]!r}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                attr = node.func.attr
                # A Redis pipeline's execute() takes no statement; a database's always does.
                if attr in DRIVER_CALLS or (attr == "execute" and node.args):
                    offenders.append(f"{where(path, node.lineno)} .{attr}(")
    assert offenders == [], "\n".join(offenders)


def field_names(tree: ast.Module) -> set[int]:
    """String constants that name a field, not a value: dict keys and subscripts (`{"error": ...}`, `row["state"]`).
    A field may share its spelling with a status or event kind (a job's `error`, a node's `state`)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found |= {id(k) for k in node.keys if isinstance(k, ast.Constant)}
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            found.add(id(node.slice))
    return found


def test_statuses_event_kinds_and_other_shared_names_are_spelled_only_in_contract() -> None:
    offenders = []
    for name, path, tree in modules():
        if name.split(".")[0] == "contract":
            continue
        skip = docstrings(tree) | field_names(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                    and node.value in STATUS_OR_KIND):
                offenders.append(f"{where(path, node.lineno)} {node.value!r}")
    assert offenders == [], "\n".join(offenders)


# Every module a process loads, in a fresh interpreter (this session may have imported anything already).
PROCESS_PROBE = """
import importlib, json, pkgutil, sys
names = []
for package in sys.argv[1].split(","):
    root = importlib.import_module(package)
    names += [m.name for m in pkgutil.walk_packages(root.__path__, package + ".") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def loaded(packages: str) -> set[str]:
    done = subprocess.run([sys.executable, "-c", PROCESS_PROBE, packages], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_control_plane_loads_nothing_of_the_api() -> None:
    seen = loaded("controlplane")
    assert {"controlplane.main", "controlplane.scheduler", "controlplane.deliverer"} <= seen
    assert sorted(m for m in seen if m == "api" or m.startswith("api.")) == []
    assert "torch" not in seen


def test_the_api_loads_neither_torch_nor_the_orm_session_nor_the_control_plane_nor_a_worker() -> None:
    seen = loaded("api")
    assert {"api.main", "api.routes.jobs", "api.services.jobs"} <= seen
    for forbidden in ("torch", "sqlalchemy.orm", "controlplane", "worker", "trainer"):
        assert sorted(m for m in seen if m == forbidden or m.startswith(forbidden + ".")) == [], forbidden


# The database drivers, by the top-level module a process imports for each. SQLAlchemy is no driver of its own: it
# runs on psycopg (its URL says `+psycopg`), so it counts as psycopg.
DRIVERS = {"asyncpg": "asyncpg", "psycopg": "psycopg", "sqlalchemy": "psycopg"}


def drivers(seen: set[str]) -> set[str]:
    return {driver for module, driver in DRIVERS.items() if module in seen}


def test_one_database_driver_per_process() -> None:
    """The API and its operator tools speak asyncpg; the control plane psycopg (its ORM, its deliverer's and its
    listener's connections); workers and the trainer no database at all."""
    assert drivers(loaded("api")) == {"asyncpg"}
    assert drivers(loaded("controlplane")) == {"psycopg"}
    assert drivers(loaded("worker,trainer")) == set()


# A parameter of another style than Postgres's own `$n`: SQLAlchemy's `:name`, psycopg's `%(name)s` and `%s`.
OTHER_PLACEHOLDER = re.compile(r"(?<![:\w]):[a-z_]\w*\b|%\(\w+\)s|%s\b")


def test_every_statement_is_written_one_way_with_dollar_parameters() -> None:
    """db/ writes each statement as text with `$n` parameters, which asyncpg (db/pool.py) and psycopg's raw cursor
    (db/engine.py `run`) both send as written: no rewriting, no second style, no SQLAlchemy `text()` statement."""
    offenders = []
    for name, path, tree in modules():
        if name.split(".")[0] != "db" or name == "db.models":  # models: DDL fragments of the schema, not statements
            continue
        skip = docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                    and SQL.search(node.value) and OTHER_PLACEHOLDER.search(node.value):
                offenders.append(f"{where(path, node.lineno)} {OTHER_PLACEHOLDER.search(node.value)[0]!r}")
            elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "text":
                offenders.append(f"{where(path, node.lineno)} text(")
    assert offenders == [], "\n".join(offenders)


# The keys of a RunSpec or AttemptOrder (contract/spec.py): a worker or trainer that indexes a dict by them is
# editing a copy of the run spec that validation no longer checks.
RUN_SPEC_KEYS = {"job", "spec", "paths", "deepspeed_config", "hyperparameters"}


def test_no_dict_run_spec_past_validation_in_the_worker_or_the_trainer() -> None:
    offenders = []
    for name, path, tree in modules():
        if name.split(".")[0] not in ("worker", "trainer"):
            continue
        for node in ast.walk(tree):
            if (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                    and node.slice.value in RUN_SPEC_KEYS):
                offenders.append(f"{where(path, node.lineno)} [{node.slice.value!r}]")
    assert offenders == [], "\n".join(offenders)


# The functions a training step runs through (trainer/recipe.py): fault injection for tests is put on the engine at
# setup (trainer/oom.py `ForcedOOM.install`) or done by the test's own process control, never switched here.
STEP_FUNCTIONS = {"_steps", "_optimizer_step", "_report_progress_if_due", "_between_steps"}


def test_the_training_step_carries_no_test_switch() -> None:
    tree = ast.parse((ROOT / "trainer" / "recipe.py").read_text())
    found = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in STEP_FUNCTIONS}
    assert found == STEP_FUNCTIONS, "the step functions were renamed: name them here"
    offenders = [f"{f.name}: {n.attr if isinstance(n, ast.Attribute) else n.id}"
                 for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in STEP_FUNCTIONS
                 for n in ast.walk(f)
                 if (isinstance(n, ast.Attribute) and n.attr in ("forced", "FORCE_ENV", "environ"))
                 or (isinstance(n, ast.Name) and n.id in ("os", "FORCE_ENV"))]
    assert offenders == [], offenders
