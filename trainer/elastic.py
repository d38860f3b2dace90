"""Resuming on another world size: the newest committed checkpoint, converted to DeepSpeed's universal format.

ZeRO partitions optimizer state (stages 1-2) and parameters (stage 3) by data-parallel rank, so a checkpoint
written by N processes cannot be loaded by M != N of them. Every checkpoint records the world it was written
with (`topology.json`). When a resume finds another world size, the first process of every node converts the
node's own copy of the committed tag with DeepSpeed's `ds_to_universal` into the attempt's staging folder
(`checkpoints/.universal-attempt-N/step-K`), moves it to `checkpoints/universal/step-K` and commits it like any
other checkpoint write (trainer/fence.py), so a later attempt on the same new world size reuses it; every rank
then loads its node's copy with the engine's `checkpoint.load_universal`. Step, learning-rate schedule (the
scheduler's state in the model-states file) and data position (TrainerState) come from the source tag, so the
run continues the same curve.

Each node converts its own copy because every node holds the whole committed checkpoint before the launch (the
worker downloads every object of the manifest: worker/checkpoints.py), and the ranks of a node read only its
disk; the universal copy is scratch and never goes to the store. Nodes that share one folder (one host) convert
one after the other under a lock on it: the first converts and commits, the next finds the copy committed.

The data position is counted in global batches, which is only the same place in the data when the global
batch is the same: `resolve` keeps the job's `global_batch_size` for any world size, and a checkpoint whose
global batch differs from this attempt's is refused rather than resumed at a shifted position.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from deepspeed.runtime.pipe.engine import PipelineEngine

from contract.codes import EventKind, FailureCode
from contract.deepspeed.policy import CHECKPOINT
from store.locks import locked
from trainer.errors import TrainerError
from trainer.events import emit_rank0
from trainer.fence import Fence

TOPOLOGY_FILE = "topology.json"
UNIVERSAL_DIR = "universal"
COMMITTED = "COMMITTED"  # the same marker trainer/checkpoint.py commits tags with
LOCK_FILE = ".universal.lock"  # held while a node converts: nodes sharing the folder convert one at a time
CONVERT_TIMEOUT_S = 6 * 3600  # a conversion reads and writes every shard once; far below this on any real model


class ElasticResumeError(TrainerError):
    code = FailureCode.ELASTIC_RESUME_ERROR


@dataclass(frozen=True)
class Topology:
    world_size: int
    global_batch: int | None
    zero_stage: int | None


@dataclass(frozen=True)
class Plan:
    """How this attempt loads `tag_dir`: straight, or through its universal copy (`universal`)."""

    tag_dir: Path
    written: Topology
    world_size: int

    @property
    def universal(self) -> bool:
        # Without ZeRO shard files the optimizer state is whole in the model-states file: any world loads it.
        return self.written.world_size != self.world_size and _has_zero_shards(self.tag_dir)


def record(staged_tag: Path, engine: Any, rank: int) -> None:
    """Write what a later resume needs to know about the world this checkpoint was saved by (rank 0 only)."""
    if rank != 0:
        return
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    topology = {"world_size": world, "global_batch": int(engine.train_batch_size()),
                "zero_stage": int(engine.zero_optimization_stage())}
    (staged_tag / TOPOLOGY_FILE).write_text(json.dumps(topology))


def _has_zero_shards(tag_dir: Path) -> bool:
    return any(tag_dir.glob("*_optim_states.pt"))


def written_topology(tag_dir: Path) -> Topology:
    path = tag_dir / TOPOLOGY_FILE
    if path.is_file():
        raw = json.loads(path.read_text())
        return Topology(int(raw["world_size"]), raw.get("global_batch"), raw.get("zero_stage"))
    # A checkpoint saved before topology.json existed: DeepSpeed writes one optimizer shard per data-parallel rank.
    shards = list(tag_dir.glob("*zero_pp_rank_*_optim_states.pt"))
    world = len(shards) if shards else dist.get_world_size() if dist.is_initialized() else 1
    return Topology(world, None, None)


def plan(tag_dir: Path, world_size: int) -> Plan:
    """How this attempt resumes from `tag_dir`, the newest committed tag."""
    return Plan(tag_dir, written_topology(tag_dir), world_size)


def configure(cfg: dict[str, Any], committed: list[Path], world_size: int) -> None:
    """The engine reads `checkpoint.load_universal` when it is built, so the choice is made before then, from
    the same newest committed tag that the resume will load (only this attempt could commit a newer one)."""
    if committed:
        cfg.setdefault(CHECKPOINT, {})["load_universal"] = plan(committed[-1], world_size).universal


def check_engine(resume: Plan, engine: Any) -> None:
    """The engine was built for this plan, and the checkpoint's data position means the same rows here."""
    check(resume, load_universal=bool(engine.load_universal_checkpoint()),
          global_batch=int(engine.train_batch_size()), pipelined=isinstance(engine, PipelineEngine))


def check(resume: Plan, *, load_universal: bool, global_batch: int, pipelined: bool) -> None:
    if resume.universal and pipelined:
        # The converter reads pipeline checkpoints, but loading one into another data-parallel degree of a
        # PipelineModule is not something this service has verified; a clear refusal beats a silent misload.
        raise ElasticResumeError(
            f"checkpoint {resume.tag_dir.name} of this pipeline-parallel job was written by "
            f"{resume.written.world_size} processes; resuming it on {resume.world_size} is not supported. "
            f"Run it on {resume.written.world_size} processes again")
    if load_universal != resume.universal:
        raise ElasticResumeError(f"the engine was built with checkpoint.load_universal={load_universal} but "
                                 f"resuming {resume.tag_dir.name} ({resume.written.world_size} -> "
                                 f"{resume.world_size} processes) needs {resume.universal}")
    written = resume.written.global_batch
    if written is not None and written != global_batch:
        raise ElasticResumeError(
            f"checkpoint {resume.tag_dir.name} was written with global batch {written} "
            f"({resume.written.world_size} processes) but this attempt runs global batch {global_batch} "
            f"({resume.world_size} processes); its data position and learning-rate schedule count steps of "
            f"{written} rows. Set hyperparameters.global_batch_size to {written} so any world size keeps it")


def _workers() -> tuple[int, int]:
    """Parallel extract and merge processes for the converter: half the node's cores, merging (the more
    memory-hungry pass) with fewer. One means in-process, which the converter also supports."""
    cores = os.cpu_count() or 1
    extract = max(1, min(8, cores // 2))
    return extract, max(1, min(2, extract // 2))


def _convert(source: Path, output: Path) -> None:
    extract, merge = _workers()
    # A process of its own: the converter holds every shard in memory at once and prints progress bars;
    # neither belongs in a rank whose stdout is the event stream.
    argv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(source),
            "--output_folder", str(output), "--num_extract_workers", str(extract),
            "--num_merge_workers", str(merge), "--inject_missing_state"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, check=False)
    if done.returncode != 0:
        tail = (done.stdout[-1500:] + done.stderr[-2500:]).strip()
        raise ElasticResumeError(f"converting checkpoint {source.name} to DeepSpeed's universal format failed "
                                 f"(exit {done.returncode}): {tail}")


def universal_copy(checkpoint_dir: Path, tag_dir: Path, fence: Fence) -> tuple[Path, bool]:
    """A node's first process: the committed universal copy of `tag_dir` in this node's `checkpoint_dir`, made now
    unless an earlier attempt, or another node sharing the folder, made it. Returns (its folder, whether it was
    converted by this call)."""
    target = checkpoint_dir / UNIVERSAL_DIR / tag_dir.name
    with locked(checkpoint_dir / LOCK_FILE):
        if (target / COMMITTED).is_file():
            return target, False
        staged = fence.staging(checkpoint_dir, "universal") / tag_dir.name
        if staged.parent.exists():
            shutil.rmtree(staged.parent)  # a conversion this attempt began and did not finish
        _convert(tag_dir, staged)
        fence.check(f"the universal copy of {tag_dir.name}")
        if target.exists():
            shutil.rmtree(target)  # uncommitted leftovers of an attempt that died between the move and the commit
        target.parent.mkdir(exist_ok=True)
        os.rename(staged, target)
        (target / COMMITTED).write_text(json.dumps({"source": tag_dir.name, "attempt": fence.attempt}))
        shutil.rmtree(staged.parent, ignore_errors=True)  # the converter's `latest_universal` file is what is left
    return target, True


def prune(checkpoint_dir: Path, keep: Path) -> None:
    """Each node's first process once `keep` is committed: only the newest tag is ever resumed from, so the
    universal copies of older ones (each as large as the fp32 weights and optimizer state) are dead weight now."""
    root = checkpoint_dir / UNIVERSAL_DIR
    if root.is_dir():
        for copy in root.iterdir():
            if copy.name != keep.name:
                shutil.rmtree(copy, ignore_errors=True)


def load_source(resume: Plan, checkpoint_dir: Path, fence: Fence, node_rank: int) -> tuple[Path, str]:
    """Collective: (load_dir, tag) for engine.load_checkpoint, converting on each node first when the world
    changed. Emits `resumed`, the job's record of where and across which world sizes it resumed, with every
    node's copy (`copies`)."""
    tag = resume.tag_dir.name
    source = resume.tag_dir
    copies: list[dict[str, Any]] = []
    if resume.universal:
        mine: dict[str, Any] | None = None
        if _local_rank() == 0:
            start = time.monotonic()
            try:
                path, converted = universal_copy(checkpoint_dir, resume.tag_dir, fence)
                mine = {"node_rank": node_rank, "path": str(path), "converted": converted}
            except Exception as exc:  # noqa: BLE001  # told to every rank below, so none waits forever
                mine = {"node_rank": node_rank, "failure": f"{type(exc).__name__}: {exc}"}
            mine["seconds"] = round(time.monotonic() - start, 3)
        # No rank loads before every node's copy is committed; a failed conversion fails them all with its reason.
        reports = _gather(mine)
        failed = [r for r in reports if r is not None and "failure" in r]
        if failed:
            raise ElasticResumeError("; ".join(f"node {r['node_rank']}: {r['failure']}" for r in failed))
        copies = sorted((r for r in reports if r is not None), key=lambda r: r["node_rank"])
        source = checkpoint_dir / UNIVERSAL_DIR / tag
    emit_rank0(EventKind.RESUMED, step=_step_of(resume.tag_dir), tag=tag, from_world_size=resume.written.world_size,
               to_world_size=resume.world_size, universal=resume.universal,
               converted=any(c["converted"] for c in copies),
               conversion_seconds=max(c["seconds"] for c in copies) if copies else None, path=str(source),
               copies=copies)
    return source.parent, tag


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _gather(mine: dict[str, Any] | None) -> list[dict[str, Any] | None]:
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    reports: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(reports, mine)
    return reports


def _step_of(tag_dir: Path) -> int | None:
    try:
        return int(json.loads((tag_dir / COMMITTED).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
