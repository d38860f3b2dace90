"""Resuming on another number of processes, under the real launcher on CPU ranks (gloo, tiny model, no mocks),
with every checkpoint committed to a real S3 server (moto) and restored from it onto each node before each attempt,
as a worker does (worker/checkpoints.py).

One chain per ZeRO stage (2 and 3) covers both directions: 2 processes train and are stopped (SIGTERM, checkpoint),
1 process resumes through the checkpoint's universal copy and is stopped again, 2 processes resume and finish and
their export goes to the store. The 2-process attempts run as two nodes of one process each. ZeRO-2's nodes are
hosts that share no disk, each with a folder of its own: the first attempt runs on hosts a and b (b's folder is
then deleted), the second on a fresh host c, the third on a and c, so every node restores the checkpoint from the
store and converts its own copy. ZeRO-3's two nodes share one folder (one host): one node converts, the other
finds the copy committed. An uninterrupted run of the same job on one process is the reference: the job fixes the
global batch (8 rows), so the data position, counted in global batches, names the same rows on either world size, and
the curve is the same on any, up to the order of float32 sums (LOSS_REL_TOL).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

pytest.register_assert_rewrite("tests.trainer_support")

from contract.spec import GangMember, NodeShare  # noqa: E402
from store import checkpoints as stored  # noqa: E402
from store.layout import output_manifest_key  # noqa: E402
from store.objects import Store  # noqa: E402
from tests.s3_support import CREDENTIALS, S3Server  # noqa: E402
from tests.trainer_support import (  # noqa: E402
    Event,
    launch,
    launch_gang,
    make_job,
    of,
    write_run_spec,
)
from trainer import fence  # noqa: E402
from worker import checkpoints, export_store  # noqa: E402
from worker.outcome import read_completion  # noqa: E402

pytest_plugins = ["tests.trainer_support"]

STEPS = 12
EVERY = 4
# fp32, no dropout, the same rows per step: what differs between world sizes is only the order in which the
# micro batches' gradients are summed (within a rank, then across ranks by the all-reduce), and the weights,
# moments and step counts go through the universal copy in fp32, unchanged. Observed differences are below
# 1e-7 relative; 1e-5 is the bound of the same-world resume test (test_trainer_matrix), and a skipped or
# repeated batch moves the loss by more than 1e-2 here.
LOSS_REL_TOL = 1e-5
# Each attempt: the host (folder) of each of its nodes, one process each, and the step after which it is stopped.
HOSTS: dict[int, list[tuple[list[str], int | None]]] = {
    2: [(["a", "b"], EVERY), (["c"], 2 * EVERY), (["a", "c"], None)],
    3: [(["a", "a"], EVERY), (["a"], 2 * EVERY), (["a", "a"], None)],
}
GONE = {2: "b"}  # the host lost after the first attempt, its folder with it


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    server = S3Server(tmp_path_factory.mktemp("s3"))
    try:
        with pytest.MonkeyPatch.context() as env:
            for name, value in CREDENTIALS.items():
                env.setenv(name, value)  # the trainer's and the restore's store client read them
            yield server
    finally:
        server.stop()


def _spec(tmp: Path, job: dict[str, Any], job_dir: Path, attempt: int, store: dict[str, Any],
          nodes: int = 1, node_rank: int = 0, procs: int = 1) -> Path:
    path = write_run_spec(tmp, {**job, "resources": {"num_gpus": procs, "num_nodes": nodes}}, job_dir=job_dir)
    spec = json.loads(path.read_text())
    spec["attempt"] = attempt  # each resume is the job's next attempt, as the worker would start it
    spec["paths"]["store"] = store
    if nodes > 1:
        gang = [GangMember(node=f"node-{i}", devices=["0"]) for i in range(nodes)]
        spec["placement"] = NodeShare(node=f"node-{node_rank}", devices=["0"], node_rank=node_rank, num_nodes=nodes,
                                      gang=gang).model_dump(mode="json")
    path.write_text(json.dumps(spec))
    return path


@dataclass
class Chain:
    stage: int
    root: Path  # host-<name>/job is that host's job folder
    job_dir: Path  # node 0's folder in the last attempt
    reference: list[Event]
    runs: list[tuple[int, list[Event]]]  # (processes, events) in order
    hosts: list[list[str]]  # each run's host per node
    restored: list[list[int | None]] = field(default_factory=list)  # the step each node restored from the store
    copies_at_resume: list[dict[str, bool]] = field(default_factory=list)  # host -> its universal copy committed
    store: Store | None = None
    job_id: str = ""
    export: dict[str, Any] = field(default_factory=dict)

    def checkpoints(self, host: str) -> Path:
        return self.root / f"host-{host}" / "job" / "checkpoints"


def _restore(store: Store, job_id: str, job_dir: Path, node_rank: int, attempt: int) -> int | None:
    """What a node's worker does before the launch: raise the fences, bring the store's newest checkpoint here.
    Every file of the manifest must then be on this node's disk, whichever node wrote it."""
    fence.raise_to(job_dir, attempt)
    stored.raise_fence(store, job_id, attempt)
    said: list[str] = []
    manifest = checkpoints.restore(store, job_id, job_dir / "checkpoints", node_rank, lambda line, _: said.append(line))
    assert not said, said
    if manifest is None:
        return None
    tag_dir = job_dir / "checkpoints" / manifest.tag
    assert {f.path: f.bytes for f in manifest.files} == {
        f.path: (tag_dir / f.path).stat().st_size for f in manifest.files if (tag_dir / f.path).is_file()}
    return manifest.step


@pytest.fixture(scope="module", params=[2, 3], ids=["zero2-hosts", "zero3-one-host"])
def chain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_model: Path,
          corpus: str, s3: S3Server) -> Chain:
    stage = request.param
    tmp = tmp_path_factory.mktemp(f"elastic-zero{stage}")
    train = tmp / "train.txt"
    train.write_text(corpus)
    job = make_job(tiny_model, train, hyperparameters={"max_steps": STEPS, "warmup_steps": 2},
                   deepspeed={"zero_stage": stage, "precision": "fp32"},
                   checkpointing={"every_steps": EVERY, "keep_last": 2})
    path = write_run_spec(tmp, {**job, "resources": {"num_gpus": 1}}, job_dir=tmp / "reference")
    rc, reference, tail = launch(path, procs=1)
    assert rc == 0, tail
    (tmp / "events-reference.json").write_text(json.dumps(reference))

    config = s3.config(s3.bucket())
    store, job_id = Store(config), f"elastic-zero{stage}"
    ref = {"config": config.model_dump(), "job_id": job_id}
    chain = Chain(stage, tmp, tmp / "host-a" / "job", reference, [], [], store=store, job_id=job_id)
    for attempt, (hosts, stop_at) in enumerate(HOSTS[stage], start=1):
        folders = [tmp / f"host-{h}" / "job" for h in hosts]
        chain.restored.append([_restore(store, job_id, d, i, attempt) for i, d in enumerate(folders)])
        seen: dict[str, bool] = {}

        def on_event(event: Event, proc: Any, hosts: list[str] = hosts, seen: dict[str, bool] = seen,
                     stop_at: int | None = stop_at) -> None:
            if event["event"] == "resumed":
                # Every node's copy is committed by the time rank 0 announces the resume; later saves prune it.
                seen.update({h: (chain.checkpoints(h) / "universal" / event["tag"] / "COMMITTED").is_file()
                             for h in hosts})
            # By step, not by the `checkpoint` event: that comes when the store commits, a variable number of
            # steps later. The trainer honours SIGTERM at the next step boundary with a checkpoint of its own.
            if stop_at is not None and event["event"] == "progress" and event["step"] >= stop_at \
                    and not seen.get("stopped"):
                seen["stopped"] = True
                for each in proc if isinstance(proc, list) else [proc]:
                    os.killpg(each.pid, signal.SIGTERM)

        if len(hosts) == 1:
            rc, events, tail = launch(_spec(tmp, job, folders[0], attempt, ref), procs=1, on_event=on_event)
            codes = [rc]
        else:
            specs = [(_spec(tmp, job, d, attempt, ref, nodes=len(hosts), node_rank=i), 1)
                     for i, d in enumerate(folders)]
            codes, events, tail = launch_gang(specs, on_event=on_event)
        assert not of(events, "error"), tail
        assert all((rc == 0) == (stop_at is None) for rc in codes), (codes, tail)
        chain.runs.append((len(hosts), events))
        chain.hosts.append(hosts)
        seen.pop("stopped", None)
        chain.copies_at_resume.append(seen)
        # Kept beside the job for a failing run's post-mortem.
        (tmp / f"events-{attempt}.json").write_text(json.dumps(events))
        if attempt == 1 and stage in GONE:
            shutil.rmtree(tmp / f"host-{GONE[stage]}")
    out = chain.job_dir / "output"
    completion = read_completion(out)
    assert completion is not None
    chain.export = export_store.publish(store, job_id=job_id, attempt=len(HOSTS[stage]), output_dir=out,
                                        completion=completion, give_up_after=30, interrupted=lambda: None,
                                        say=lambda line: None)
    return chain


def _stopped_at(events: list[Event]) -> int:
    (stopped,) = of(events, "interrupted")
    return int(stopped["step"])


def test_resume_changes_world_size_through_a_committed_universal_copy_on_every_node(chain: Chain) -> None:
    (_, first), (_, second), (_, third) = chain.runs
    assert not of(first, "resumed")
    assert chain.restored[0] == [None] * len(chain.hosts[0])
    for run, ((before, prev), (procs, events)) in enumerate(pairwise(chain.runs), start=1):
        (resumed,) = of(events, "resumed")
        (started,) = of(events, "started")
        step = _stopped_at(prev)
        tag = f"step-{step:08d}"
        hosts = chain.hosts[run]
        # Every node restored the checkpoint the previous attempt committed to the store, whole, onto its own disk.
        assert chain.restored[run] == [step] * len(hosts), chain.restored
        # The job's events say where it resumed from and that the world size changed.
        assert resumed["step"] == started["resumed_from_step"] == step, (resumed, started)
        assert (resumed["from_world_size"], resumed["to_world_size"]) == (before, procs), resumed
        assert resumed["universal"] is True and resumed["converted"] is True, resumed
        assert resumed["path"] == str(chain.checkpoints(hosts[0]) / "universal" / tag)
        # Each node loaded a universal copy in its own folder, committed there before any rank loaded: converted
        # by every host from its own copy, and once per folder where nodes share one.
        copies = resumed["copies"]
        assert [(c["node_rank"], c["path"]) for c in copies] == [
            (i, str(chain.checkpoints(h) / "universal" / tag)) for i, h in enumerate(hosts)], copies
        assert chain.copies_at_resume[run] == dict.fromkeys(hosts, True)
        assert sum(c["converted"] for c in copies) == len(set(hosts)), copies
        assert started["world_size"] == procs
        # The global batch stays 8 rows: micro 2 x accumulation (8 / 2 / processes) x processes.
        assert started["micro_batch_size"] * started["gradient_accumulation_steps"] * procs == 8, started

    ckpt = chain.job_dir / "checkpoints"
    # Every checkpoint records the world that wrote it; the last two tags are kept as the job says.
    tags = sorted(p.name for p in ckpt.glob("step-*"))
    assert tags == [f"step-{s:08d}" for s in (_stopped_at(second), STEPS)], tags
    assert json.loads((ckpt / tags[-1] / "topology.json").read_text()) == {
        "world_size": 2, "global_batch": 8, "zero_stage": chain.stage}
    assert json.loads((ckpt / tags[0] / "topology.json").read_text())["world_size"] == 1
    # A universal copy is dead weight once a newer checkpoint is committed, on every node's disk; no conversion
    # staging is left.
    for host in set(chain.hosts[-1]):
        assert list((chain.checkpoints(host) / "universal").iterdir()) == [], host
        assert not list(chain.checkpoints(host).glob(".universal-attempt-*")), host
    assert of(third, "completed")[0]["steps"] == STEPS


def test_the_store_holds_the_checkpoints_and_the_export_and_never_a_universal_copy(chain: Chain) -> None:
    assert chain.store is not None
    manifests, unreadable = stored.read_all(chain.store, chain.job_id)
    assert not unreadable and [m.step for m in manifests] == [STEPS, _stopped_at(chain.runs[1][1])]
    keys = [item.key for item in chain.store.list(f"jobs/{chain.job_id}/")]
    assert not [k for k in keys if "universal" in k], keys
    assert chain.store.head(output_manifest_key(chain.job_id)) is not None
    assert {"model.safetensors", "config.json"} <= {f["path"] for f in chain.export["files"]}
    if chain.stage in GONE:
        assert not (chain.root / f"host-{GONE[chain.stage]}").exists()
        # Only node 0 exports; the other host's folder holds no output.
        assert not (chain.checkpoints("c").parent / "output" / "COMPLETE").exists()


def test_steps_learning_rates_data_order_and_losses_continue(chain: Chain) -> None:
    reference = {p["step"]: p for p in of(chain.reference, "progress")}
    seen: dict[int, Event] = {}
    for _, events in chain.runs:
        steps = [p["step"] for p in of(events, "progress")]
        (started,) = of(events, "started")
        # Each run continues right after the step its predecessor checkpointed: nothing trained twice or skipped.
        assert steps[0] == (started["resumed_from_step"] or 0) + 1, steps
        assert not set(steps) & set(seen), (steps, sorted(seen))
        seen.update({p["step"]: p for p in of(events, "progress")})
    # Progress comes every step up to 10, and at the last; steps 11 and 12 of the reference may be merged.
    common = sorted(reference.keys() & seen.keys())
    assert set(range(1, 11)) | {STEPS} <= set(common), common
    for step in common:
        # The schedule is a function of the step alone, restored from the scheduler's state: equal to rounding.
        assert seen[step]["lr"] == pytest.approx(reference[step]["lr"], rel=1e-9), step
        # The same rows in the same order: token counts match step by step, and so does the epoch position.
        assert seen[step]["tokens_seen"] == reference[step]["tokens_seen"], step
        assert seen[step]["epoch"] == reference[step]["epoch"], step
        assert seen[step]["loss"] == pytest.approx(reference[step]["loss"], rel=LOSS_REL_TOL), step
    state = json.loads((chain.job_dir / "checkpoints" / f"step-{STEPS:08d}" / "trainer_state.json").read_text())
    ref_state = json.loads((chain.root / "reference" / "checkpoints" / f"step-{STEPS:08d}"
                            / "trainer_state.json").read_text())
    assert {k: state[k] for k in ("step", "epoch", "next_batch", "tokens_seen")} == \
        {k: ref_state[k] for k in ("step", "epoch", "next_batch", "tokens_seen")}


def test_a_universal_copy_is_converted_once_and_reused(chain: Chain) -> None:
    """Two nodes sharing a folder convert it once: the one that takes the folder's lock converts, the other waits
    and finds the copy committed. An attempt that dies after converting and before its next checkpoint leaves the
    copy committed; the next attempt on that world size loads it without converting again. Driven directly (no
    launch) on the reference's newest tag, written by 1 process, for a resume on 2."""
    from concurrent.futures import ThreadPoolExecutor

    from trainer import elastic
    from trainer.fence import Fence

    ckpt = chain.root / "reference" / "checkpoints"
    tag = ckpt / f"step-{STEPS:08d}"
    plan = elastic.plan(tag, 2)
    assert plan.universal and plan.written == elastic.Topology(1, 8, chain.stage)
    assert not elastic.plan(tag, 1).universal
    with ThreadPoolExecutor(2) as pool:
        both = list(pool.map(lambda _: elastic.universal_copy(ckpt, tag, Fence(chain.root / "reference", 2)),
                             range(2)))
    assert sorted(converted for _, converted in both) == [False, True], both
    copy = both[0][0]
    assert both[1][0] == copy and (copy / "COMMITTED").is_file() and (copy / "zero").is_dir()
    again, converted = elastic.universal_copy(ckpt, tag, Fence(chain.root / "reference", 3))
    assert again == copy and not converted
    assert not (ckpt / ".universal-attempt-2").exists()


def test_a_resume_that_cannot_continue_the_same_data_is_refused_before_converting(chain: Chain) -> None:
    """The checks `checkpoint.resume` makes against the engine before rank 0 converts anything, on the chain's
    last tag (written by 2 processes with global batch 8) resumed on 1 process."""
    from trainer import elastic

    tag = chain.job_dir / "checkpoints" / f"step-{STEPS:08d}"
    plan = elastic.plan(tag, 1)
    elastic.check(plan, load_universal=True, global_batch=8, pipelined=False)
    # Another global batch would count the data position and the schedule in batches of another size.
    with pytest.raises(elastic.ElasticResumeError, match=r"global batch 8 \(2 processes\) but this attempt runs "
                                                         r"global batch 4 .* hyperparameters.global_batch_size to 8"):
        elastic.check(plan, load_universal=True, global_batch=4, pipelined=False)
    with pytest.raises(elastic.ElasticResumeError, match="pipeline-parallel job was written by 2 processes"):
        elastic.check(plan, load_universal=True, global_batch=8, pipelined=True)
    with pytest.raises(elastic.ElasticResumeError, match="checkpoint.load_universal=False"):
        elastic.check(plan, load_universal=False, global_batch=8, pipelined=False)
    assert not (chain.job_dir / "checkpoints" / "universal" / tag.name).exists()


def test_a_node_whose_conversion_fails_fails_the_resume_with_its_reason(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Every rank learns each node's outcome before any loads; a node whose copy cannot be converted (here its
    shard is not a checkpoint at all) fails the resume, naming the node, and commits no copy."""
    from trainer import elastic
    from trainer.fence import Fence

    ckpt = tmp_path / "checkpoints"
    tag = ckpt / "step-00000004"
    tag.mkdir(parents=True)
    (tag / "topology.json").write_text(json.dumps({"world_size": 2, "global_batch": 8, "zero_stage": 2}))
    (tag / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a checkpoint")
    (tag / "COMMITTED").write_text(json.dumps({"step": 4, "attempt": 1}))
    monkeypatch.setenv("LOCAL_RANK", "0")
    plan = elastic.plan(tag, 1)
    assert plan.universal
    with pytest.raises(elastic.ElasticResumeError,
                       match=r"^node 3: ElasticResumeError: converting checkpoint step-00000004 to DeepSpeed's "
                             r"universal format failed \(exit \d+\)"):
        elastic.load_source(plan, ckpt, Fence(tmp_path, 2), node_rank=3)
    assert not (ckpt / "universal" / tag.name).exists()
    assert not list(ckpt.glob(".universal-attempt-*/step-*/zero"))
