"""Checkpoints that are complete or ignored: a tag dir counts only once rank 0 wrote COMMITTED into it.

Every rank writes a checkpoint into its attempt's staging folder (`checkpoints/.attempt-N/step-K`); rank 0
moves it to `checkpoints/step-K` and commits it only while the attempt is current (trainer/fence.py), so
a superseded attempt can never replace or add a checkpoint that a newer one resumes from.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from contract.codes import EventKind
from store import checkpoints as stored
from trainer import elastic
from trainer.events import emit_rank0
from trainer.fence import Fence
from trainer.uploader import Pending, Uploads

COMMITTED = "COMMITTED"
STATE_FILE = "trainer_state.json"
# What a method keeps beside the weights and must find again on resume (a dpo job's reference log-probabilities).
EXTRAS_FILE = "extras.pt"
TAG_PREFIX = "step-"
SAVE_PAUSE_ENV = "FT_TEST_SAVE_PAUSE_SECONDS"
# A measuring seam (bench/checkpoint_stall.py): the save waits for its upload and commit, as a synchronous save
# to the store would, so the cost of uploading beside training can be compared with not doing so.
SYNC_UPLOAD_ENV = "FT_BENCH_SYNC_UPLOAD"


@dataclass
class TrainerState:
    step: int = 0
    epoch: int = 0
    next_batch: int = 0  # index of the next global batch within `epoch`
    tokens_seen: int = 0
    last_loss: float | None = None


def tag_for(step: int) -> str:
    return stored.tag_for(step)  # one spelling: the store's manifests are named by it too


def committed_tags(checkpoint_dir: Path) -> list[Path]:
    """Committed tag dirs, oldest first. Uncommitted ones (a crash mid-save) are not checkpoints."""
    if not checkpoint_dir.is_dir():
        return []
    tags = [p for p in checkpoint_dir.iterdir()
            if p.is_dir() and p.name.startswith(TAG_PREFIX) and (p / COMMITTED).is_file()]
    return sorted(tags, key=lambda p: p.name)


def _rng_state() -> dict[str, Any]:
    py = random.getstate()
    np_state = np.random.get_state()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    npst = state["numpy"]
    np.random.set_state((npst[0], np.array(npst[1], dtype=np.uint32), *npst[2:]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def _pause_for_tests() -> None:
    """A fault-injection seam: the chaos tests widen the window between the shards and the commit."""
    pause = os.environ.get(SAVE_PAUSE_ENV)
    if pause:
        time.sleep(float(pause))


def write_model_files(folder: Path, module: Any, tokenizer: Any) -> None:
    """The model's config, tokenizer and generation config (a few small files), so that a checkpoint alone makes
    a model folder with its weights (worker/from_checkpoint.py). A pipeline's module has no Hugging Face config:
    its checkpoints are resumed from, never continued from."""
    config = getattr(module, "config", None)
    if not hasattr(config, "save_pretrained") or tokenizer is None:
        return
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    gen = getattr(module, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(folder)


def save(engine: Any, checkpoint_dir: Path, state: TrainerState, keep_last: int, rank: int, fence: Fence,
         uploads: Uploads | None = None, tokenizer: Any = None, extras: dict[str, torch.Tensor] | None = None) -> Path:
    """Collective: every rank must call it at the same step. With `uploads` (a job the worker runs) the
    checkpoint is also uploaded to the store beside the next steps and committed there by its manifest
    (trainer/uploader.py), which then emits the `checkpoint` event. With `tokenizer`, the model's own files are
    saved beside DeepSpeed's (`write_model_files`)."""
    tag = tag_for(state.step)
    staged = fence.staging(checkpoint_dir) / tag
    tag_dir = checkpoint_dir / tag
    started = time.monotonic()
    if uploads is not None:
        uploads.wait_previous()
    waited = time.monotonic() - started
    if rank == 0 and staged.exists():
        shutil.rmtree(staged)  # never mix the shards of two saves
    _barrier()
    engine.save_checkpoint(str(staged.parent), tag=tag, client_state={"trainer_state": asdict(state)},
                           save_latest=False)
    # Each rank keeps its own RNG stream (dropout masks differ per rank).
    (staged / f"rng-rank{rank:05d}.json").write_text(json.dumps(_rng_state()))
    if rank == 0:
        (staged / STATE_FILE).write_text(json.dumps(asdict(state)))
        write_model_files(staged / stored.HF_FOLDER, engine.module, tokenizer)
        if extras:
            torch.save(extras, staged / EXTRAS_FILE)
    elastic.record(staged, engine, rank)
    _pause_for_tests()
    _barrier()
    owned = uploads.claim(staged) if uploads is not None else []
    removed: list[str] = []
    if rank == 0:
        fence.check(f"checkpoint {tag}")
        if tag_dir.exists():
            # Leftovers of an attempt that died between the move and the commit of this very step.
            shutil.rmtree(tag_dir)
        os.rename(staged, tag_dir)
        (tag_dir / COMMITTED).write_text(json.dumps({"step": state.step, "attempt": fence.attempt}))
        tags = committed_tags(checkpoint_dir)
        for old in tags[: max(0, len(tags) - keep_last)]:
            shutil.rmtree(old, ignore_errors=True)
            removed.append(str(old))
    # Nobody may start the next save (or exit) before the commit and pruning are done.
    _barrier()
    if _local_rank() == 0:
        # Every node converted its own universal copy for this attempt's resume (trainer/elastic.py).
        elastic.prune(checkpoint_dir, keep=tag_dir)
    # What the save cost training: the wait for the previous upload, then the local save itself.
    timing = {"waited_s": round(waited, 3), "save_s": round(time.monotonic() - started - waited, 3)}
    if uploads is None:
        emit_rank0(EventKind.CHECKPOINT, step=state.step, path=str(tag_dir), committed=True, removed=removed, **timing)
    else:
        # Node 0's files were just moved into the tag folder; another host's stay in its own staging folder.
        source = tag_dir if uploads.node_rank == 0 else staged
        uploads.start(Pending(tag, state.step, asdict(state), source, owned, keep_last, str(tag_dir), timing))
        if os.environ.get(SYNC_UPLOAD_ENV):
            uploads.wait_previous()
            _barrier()
    return tag_dir


def resume(engine: Any, checkpoint_dir: Path, rank: int, fence: Fence, node_rank: int = 0) -> TrainerState | None:
    """Collective. `checkpoint_dir` is this node's own folder; `node_rank` only names the node in the events."""
    if _local_rank() == 0:
        # Each node's disk keeps its own leftovers; on a disk nodes share, removing one twice is harmless.
        fence.remove_older_staging(checkpoint_dir)
    tags = committed_tags(checkpoint_dir)
    if not tags:
        return None
    tag_dir = tags[-1]
    # Another world size than the one that wrote it goes through the tag's universal copy (trainer/elastic.py).
    plan = elastic.plan(tag_dir, dist.get_world_size() if dist.is_initialized() else 1)
    elastic.check_engine(plan, engine)
    load_dir, tag = elastic.load_source(plan, checkpoint_dir, fence, node_rank)
    load_path, _ = engine.load_checkpoint(str(load_dir), tag=tag)
    if load_path is None:
        raise RuntimeError(f"DeepSpeed could not load the committed checkpoint {tag_dir}")
    state = TrainerState(**json.loads((tag_dir / STATE_FILE).read_text()))
    rng_file = tag_dir / f"rng-rank{rank:05d}.json"
    if rng_file.is_file():
        _set_rng_state(json.loads(rng_file.read_text()))
    return state


def extras(checkpoint_dir: Path) -> dict[str, torch.Tensor] | None:
    """What the newest committed checkpoint keeps beside the weights (`save`'s `extras`), or None."""
    tags = committed_tags(checkpoint_dir)
    path = tags[-1] / EXTRAS_FILE if tags else None
    return torch.load(path, weights_only=True) if path is not None and path.is_file() else None


class StopFlag:
    """SIGTERM only sets a flag; the loop checkpoints at the next optimizer-step boundary and exits 143."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True
