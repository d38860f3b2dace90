"""`python -m worker [-Q QUEUES] [celery worker options]`: start this node's worker.

One Celery worker process per node, with a threads pool of one thread per slot: each job's supervisor is
a thread of the worker process, so every guard watches the same process (killing the worker, even by
SIGKILL, still ends every job's ranks at once) and a SIGTERM reaches every running job through Celery's
shutdown flag (each trainer checkpoints and its job is released). The slots a job runs on are chosen by
the control plane, never by the thread that happens to take the message.
"""

from __future__ import annotations

import os
import sys

from worker import prebuild
from worker.node import NodeSettings, describe
from worker.ops import extensions_dir
from worker.settings import WorkerSettings


def argv(extra: list[str]) -> list[str]:
    node = NodeSettings()
    slots = describe(node, [], 1)["slots"]
    queues = WorkerSettings().queues
    base = [sys.executable, "-m", "celery", "-A", "worker.celery_app:app", "worker", "--pool", "threads",
            "--concurrency", str(slots), "-n", f"{node.name}@%h", "--without-gossip", "--without-mingle",
            "--loglevel", "INFO"]
    # -Q given here wins over FT_QUEUES: these are the queues the node serves (worker/node.py).
    return base + ([] if "-Q" in extra else ["-Q", queues]) + extra


if __name__ == "__main__":
    args = argv(sys.argv[1:])
    settings = WorkerSettings()
    if settings.warm_trainer:
        # The warm trainer imports while the ops are checked and Celery starts, so a job sent as soon as the node
        # is up finds it ready sooner (worker/warm.py); the Celery process this becomes adopts it.
        from worker.attempt import spares, trainer_env

        spares(settings).start(trainer_env(extensions_dir(settings)))
        spares(settings).hand_down()
    # Before the worker takes a job: an op this node became able to build since the ops were prebuilt
    # (libaio-dev installed later) is built now, not by the first job's ranks inside its time limit.
    try:
        prebuild.ensure(extensions_dir(settings))
    except RuntimeError as exc:
        sys.exit(f"worker: refusing to start: {exc}")
    os.execv(args[0], args)
