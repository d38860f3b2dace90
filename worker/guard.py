"""Runs the launcher and takes its whole process group down if the worker that started it dies.

The launcher and the trainer ranks live in their own session (so that ending a job can kill all of
them at once); without this guard a worker killed with SIGKILL would leave them training as orphans.
Usage: python -m worker.guard -- ARGV...
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    worker_pid = os.getppid()
    child = subprocess.Popen(argv)

    def kill_group(signum: int = signal.SIGKILL) -> None:
        try:
            os.killpg(os.getpgid(0), signum)
        except ProcessLookupError:
            pass

    def forward(signum: int, _frame: object) -> None:
        # The worker asks for a graceful stop: pass it on, the launcher forwards it to the ranks.
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    while True:
        try:
            return child.wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != worker_pid:
            kill_group()
            time.sleep(1)
            return 137


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
