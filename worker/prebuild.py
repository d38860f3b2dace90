"""Build DeepSpeed's C++/CUDA ops before any job runs, into the folder the launched ranks use.

DeepSpeed compiles an op the first time a rank loads it, under a file lock, inside the job. On a small
node that first build takes minutes of a job's time limit, and a build killed half-way (a cancel, a
time limit) leaves the lock behind for every later job. Building here, before any job runs, keeps
compilers out of jobs: the ranks find the ops already built and load them.

Which ops can be built depends on the system, not on any file of this project: installing libaio-dev after
the first install makes the async I/O op (NVMe offload) buildable. So the folder holds a manifest of what was
built and what the system looked like then; every `make install` and every worker start compare it with now
and build what became buildable, before a job could need it.

    python -m worker.prebuild            # build every op this node can build that is not built yet
    python -m worker.prebuild --check    # exit 1, naming them, if any such op is not built
    python -m worker.prebuild --print-dir
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from worker.ops import extensions_dir, release_stale_build_locks
from worker.settings import WorkerSettings

log = logging.getLogger("worker.prebuild")

# The ops a rank can load: CPU Adam for optimizer offload, async I/O for NVMe offload (needs libaio), and
# on CUDA FusedAdam for the optimizer.
OPS_BY_ACCELERATOR = {"cpu": ["CPUAdamBuilder", "AsyncIOBuilder"],
                      "cuda": ["FusedAdamBuilder", "CPUAdamBuilder", "AsyncIOBuilder"]}
# DeepSpeed's is_compatible(verbose=False) gives no reason; what an operator installs to make each buildable.
NEEDS = {"AsyncIOBuilder": "libaio-dev (apt-get install libaio-dev)"}

MANIFEST = "prebuilt.json"
# Beside the ops' folders, not inside one: release_stale_build_locks looks at `<op>/lock` only.
PREBUILD_LOCK = ".prebuild.lock"

# What decides whether an op builds: the compilers and flags DeepSpeed's build checks use, and the system's
# headers and libraries. Installing a package changes its package database and the folders it writes into.
BUILD_ENV = ("CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH",
             "LIBRARY_PATH", "CUDA_HOME", "CUDA_PATH", "ROCM_HOME", "DS_ACCELERATOR", "TORCH_CUDA_ARCH_LIST")
_multiarch = sysconfig.get_config_var("MULTIARCH") or ""
SYSTEM_PATHS = ("/var/lib/dpkg/status", "/var/lib/rpm", "/var/lib/pacman/local", "/usr/include",
                "/usr/local/include", "/usr/lib", "/usr/lib64", "/usr/local/lib", "/usr/local/cuda",
                *([f"/usr/lib/{_multiarch}", f"/usr/include/{_multiarch}"] if _multiarch else []))
# The installed packages whose headers and sources the ops compile from. A reinstall of the same versions (a
# venv made anew) writes them anew, and ninja then sees every object older than its headers: unless the
# prebuild notices and asks ninja, the first job to load an op recompiles it inside its time limit.
PACKAGE_PATHS = (("torch", "include"), ("deepspeed", "ops/csrc"), ("deepspeed", "ops/op_builder"))


def _package_path(package: str, inner: str) -> str | None:
    spec = importlib.util.find_spec(package)  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(next(iter(spec.submodule_search_locations))) / inner)


def fingerprint() -> dict[str, Any]:
    """What the ops were built against and what decided which could be built, read in milliseconds (no
    import of torch or DeepSpeed): a worker compares it at every start."""
    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    def changed(path: str) -> int | None:
        try:
            return os.stat(path).st_mtime_ns
        except OSError:
            return None

    env = {k: v for k, v in os.environ.items() if k in BUILD_ENV or k.startswith("DS_BUILD_")}
    system = hashlib.sha256(json.dumps([[p, changed(p)] for p in SYSTEM_PATHS]).encode()).hexdigest()[:16]
    paths = [path for package, inner in PACKAGE_PATHS if (path := _package_path(package, inner))]
    packages = hashlib.sha256(json.dumps([[p, changed(p)] for p in paths]).encode()).hexdigest()[:16]
    return {"deepspeed": version("deepspeed"), "torch": version("torch"), "python": sys.prefix,
            "env": dict(sorted(env.items())), "system": system, "packages": packages}


def read_manifest(folder: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    # Readers in other processes (workers starting, `--check`) never see half a manifest.
    part = folder / f".{MANIFEST}.{os.getpid()}"
    part.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    part.replace(folder / MANIFEST)


def built_ops(folder: Path, manifest: dict[str, Any] | None, now: dict[str, Any]) -> set[str]:
    """The ops the manifest says were built, against the DeepSpeed and torch installed now, whose libraries
    are all still there; none where it was written for other versions (their sources may have changed)."""
    if manifest is None or any(manifest.get("fingerprint", {}).get(k) != now[k] for k in ("deepspeed", "torch")):
        return set()
    if not all((folder / lib).is_file() for lib in manifest.get("libraries", [])):
        return set()
    return {name for name, state in manifest.get("ops", {}).items() if state == "built"}


def stale_reason(folder: Path) -> str | None:
    """Why the ops of this folder may not be what this node can build now, or None: the manifest matches
    the system as it is and every library it lists is there. Cheap; a change it reports calls for the full
    check (`main`), which imports DeepSpeed and asks each op whether it builds here."""
    manifest = read_manifest(folder)
    if manifest is None:
        return f"no {MANIFEST} in {folder}: the ops were never prebuilt there"
    now = fingerprint()
    then = manifest.get("fingerprint", {})
    differ = sorted(k for k in now if then.get(k) != now[k])
    if differ:
        return f"{', '.join(differ)} changed since the ops were prebuilt"
    missing = [lib for lib in manifest.get("libraries", []) if not (folder / lib).is_file()]
    if missing:
        return f"prebuilt libraries are gone: {', '.join(missing)}"
    return None


@contextmanager
def exclusive(folder: Path) -> Iterator[None]:
    """One prebuild of a folder at a time, across processes: a second waits, then finds the ops built. The
    kernel drops the lock with its holder, so a killed prebuild leaves nothing to clean up."""
    with (folder / PREBUILD_LOCK).open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another prebuild of %s is running; waiting for it", folder)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def survey(folder: Path) -> tuple[str, dict[str, str], set[str]]:
    """(accelerator, {op: why it cannot be built here} for those it cannot, ops built) for this node now."""
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    cannot: dict[str, str] = {}
    for name in OPS_BY_ACCELERATOR.get(accelerator.device_name(), []):
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            cannot[name] = f"cannot be built here; needs {NEEDS.get(name, 'what DeepSpeed reports on loading it')}"
    return accelerator.device_name(), cannot, built_ops(folder, read_manifest(folder), fingerprint())


def build(folder: Path) -> dict[str, Any]:
    """Build every op this node can build and bring every built one up to date; returns the new manifest. Run
    under `exclusive(folder)`. Each op is loaded, so its build (ninja) decides what to compile: nothing where
    every object is newer than its sources and headers, a few seconds; the stale objects where packages were
    reinstalled since."""
    now = fingerprint()  # before the survey: a change made while it runs shows at the next check
    device, cannot, _ = survey(folder)
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    ops: dict[str, str] = dict(cannot)
    timings: dict[str, float] = {}
    for name in OPS_BY_ACCELERATOR.get(device, []):
        if name in cannot:
            continue
        started = time.monotonic()
        accelerator.create_op_builder(name).load(verbose=False)
        timings[name] = round(time.monotonic() - started, 1)
        ops[name] = "built"
    libraries = sorted(str(p.relative_to(folder)) for p in folder.glob("*/*.so"))
    manifest = {"fingerprint": now, "accelerator": device, "ops": ops, "libraries": libraries,
                "built_in_seconds": timings}
    write_manifest(folder, manifest)
    return manifest


def ensure(folder: Path) -> None:
    """Before anything may load an op from `folder` (a worker taking jobs, a test launching ranks): build
    what this node can build now and has not built, so no job compiles. Cheap when nothing changed; raises
    RuntimeError where the build fails."""
    reason = stale_reason(folder)
    if reason is None:
        return
    log.warning("checking DeepSpeed's ops before any job runs: %s", reason)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(folder)}
    done = subprocess.run([sys.executable, "-m", "worker.prebuild"], env=env, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"`python -m worker.prebuild` failed ({done.returncode}) for {folder}; no job may "
                           "run until it succeeds, or its ranks would compile DeepSpeed's ops inside its time limit")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--print-dir", action="store_true", help="print the ops folder and exit")
    parser.add_argument("--check", action="store_true",
                        help="build nothing; exit 1 if an op this node can build now is not built")
    args = parser.parse_args(argv)
    folder = extensions_dir(WorkerSettings())
    if args.print_dir:
        print(folder)
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder.mkdir(parents=True, exist_ok=True)
    if args.check:
        device, cannot, built = survey(folder)
        missing = [n for n in OPS_BY_ACCELERATOR.get(device, []) if n not in cannot and n not in built]
        if missing:
            log.error("DeepSpeed ops this node can build but has not built in %s: %s; run `make install` "
                      "(or `python -m worker.prebuild`)", folder, ", ".join(missing))
            return 1
        log.info("DeepSpeed ops ready in %s: %s", folder, ", ".join(sorted(built)) or "none needed")
        return 0
    with exclusive(folder):
        # Under the prebuild lock: a lock of `<op>/lock` that no live process holds was left by a killed build.
        for lock in release_stale_build_locks(folder):
            log.info("removed a build lock a killed build left: %s", lock)
        manifest = build(folder)
    built = [n for n, state in manifest["ops"].items() if state == "built"]
    log.info("DeepSpeed ops ready in %s: %s", folder,
             ", ".join(f"{n} ({manifest['built_in_seconds'][n]} s)" if n in manifest["built_in_seconds"] else n
                       for n in built) or "none needed")
    for name, why in manifest["ops"].items():
        if name not in built:
            log.warning("%s %s; jobs that need it fail with its reason", name, why)
    return 0


if __name__ == "__main__":
    sys.exit(main())
