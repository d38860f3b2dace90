"""How much of its node's CPU a job's launcher and ranks may take from everything else there.

A node runs more than its ranks: the worker renews the job's lease and heartbeats, the guard watches that
lease, and a one-host deployment (`make up`, the compose file) runs the API and the control plane beside
them. A rank that saturates the CPU (a CPU node, a busy data loader) must not starve those: a lease renewal
that waits for a core makes a healthy job look lost, and an API process that waits for one delays every
follower's events (bench/RESULTS.md: with a CPU job training on the same two cores, 1,000 followers' event
delay p99 was ~290 ms at equal priority or nice 10, 130 ms with the ranks in SCHED_IDLE).

- `normal`: as the worker itself.
- `low` (the worker's default): nice 10. Contended, the ranks get about a tenth of what a normal process
  gets; on a GPU node, whose ranks mostly wait on the GPU, nothing is taken from them.
- `idle`: SCHED_IDLE, the ranks run only on CPU time nothing else on the node wants (they still get all of
  it). For a host that also serves the control plane: `scripts.stack` (what `make up` runs) and the
  compose file choose it. Any unprivileged process may lower itself to it.

The guard stays at the worker's priority: it is what kills the ranks when the lease is lost.
"""

from __future__ import annotations

import shutil
from typing import Literal

Priority = Literal["normal", "low", "idle"]
LOW_NICE = 10


def command(argv: list[str], priority: Priority) -> list[str]:
    """argv run at `priority`: nice(1) and chrt(1) set it and exec argv in place (the same pid, the signals
    reach it as before), and every process it starts inherits it."""
    if priority == "low":
        return ["nice", "-n", str(LOW_NICE), *argv]
    if priority == "idle":
        if shutil.which("chrt"):
            return ["chrt", "--idle", "0", *argv]
        return ["nice", "-n", "19", *argv]  # without util-linux's chrt, the lowest nice is the nearest
    return argv
