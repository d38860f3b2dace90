"""The one rule of whether a node takes a job's share now (core/placement.py), as the scheduler and the dry run
both apply it: usable, below its job limit, enough devices free."""

from __future__ import annotations

from core import placement


def test_a_node_at_its_job_limit_takes_nothing_whatever_its_free_slots() -> None:
    assert placement.fits_now(usable=True, free=7, jobs=0, jobs_max=1, need=1)
    assert not placement.fits_now(usable=True, free=7, jobs=1, jobs_max=1, need=1)
    assert placement.free_now(free=7, jobs=1, jobs_max=1) == 0
    assert "limit" in str(placement.why_not_now(usable=True, free=7, jobs=1, jobs_max=1, need=1))


def test_usable_and_free_devices_are_needed_too() -> None:
    assert not placement.fits_now(usable=False, free=8, jobs=0, jobs_max=4, need=1)
    assert not placement.fits_now(usable=True, free=1, jobs=0, jobs_max=4, need=2)
    assert placement.why_not_now(usable=True, free=2, jobs=1, jobs_max=4, need=2) is None


def test_what_no_node_state_can_change() -> None:
    assert placement.why_never(queues=["a"], slots=8, queue="a", need=8) == []
    assert placement.why_never(queues=["a"], slots=2, queue="b", need=4) == [
        "it serves a, not resources.queue 'b'", "resources.num_gpus is 4; the node has 2 slots"]
