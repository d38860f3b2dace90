"""Parse DeepSpeed configs with DeepSpeed's own `DeepSpeedConfig`, inside a real process group of each world size.

`python -m tests.ds_parse IN OUT`: IN maps a world size to {id: config}; OUT gets, per world size and id, whether
DeepSpeed accepted the config, its error if not, and a JSON view of what it read. DeepSpeed reads the world size
from the process group, so each size gets that many real ranks (forked after DeepSpeed is imported once, joined
over gloo on loopback); rank 0 parses and reports, the others only make up the group.
"""

from __future__ import annotations

import copy
import enum
import json
import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any

# Attributes that are the process's place in the group, not something the config chose.
NOT_CHOSEN = {"_param_dict", "global_rank", "world_size"}


def _jsonable(v: Any, depth: int = 0) -> Any:
    if depth > 6:
        return repr(v)
    if isinstance(v, enum.Enum):
        return _jsonable(v.value, depth + 1)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple, set)):
        return [_jsonable(x, depth + 1) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x, depth + 1) for k, x in v.items()}
    if hasattr(v, "model_dump"):
        return _jsonable(v.model_dump(by_alias=True), depth + 1)
    if hasattr(v, "__dict__"):
        return _jsonable({k: x for k, x in vars(v).items() if not k.startswith("_")}, depth + 1)
    return str(v)


def _parse(config: dict[str, Any]) -> dict[str, Any]:
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        parsed = DeepSpeedConfig(copy.deepcopy(config))
    except Exception as exc:  # noqa: BLE001 - any refusal is the answer
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:500]}
    view = {k: _jsonable(v) for k, v in vars(parsed).items() if k not in NOT_CHOSEN}
    return {"ok": True, "view": view}


def _rank(rank: int, world: int, port: int, configs: dict[str, Any], out: Path) -> None:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    if accel.device_name() == "cpu":
        # As the trainer does: no shared-memory all-reduce op to build and map, torch.distributed does the work.
        deepspeed.ops.__compatible_ops__[accel.get_op_builder("ShareMemCommBuilder").NAME] = False
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_SIZE": str(world)})
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
    from deepspeed import comm as dist

    assert dist.get_world_size() == world
    if rank == 0:
        out.write_text(json.dumps({key: _parse(cfg) for key, cfg in configs.items()}))
    dist.barrier()


def parse_all(by_world: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    logging.disable(logging.WARNING)  # DeepSpeed logs every parse; only the results matter here
    import deepspeed  # noqa: F401 - imported once, before the ranks fork

    results: dict[int, dict[str, Any]] = {}
    for world, configs in by_world.items():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        out = Path(os.environ.get("TMPDIR", "/tmp")) / f"ds_parse_{os.getpid()}_{world}.json"
        pids = []
        for rank in range(world):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    _rank(rank, world, port, configs, out)
                except BaseException as exc:  # noqa: BLE001 - a child must never return into the parent's code
                    print(f"rank {rank}: {exc!r}", file=sys.stderr)
                    code = 1
                os._exit(code)
            pids.append(pid)
        codes = [os.waitpid(pid, 0)[1] for pid in pids]
        if any(codes):
            raise RuntimeError(f"world {world}: ranks exited with {codes}")
        results[world] = json.loads(out.read_text())
        out.unlink()
    return results


def main() -> None:
    by_world = {int(k): v for k, v in json.loads(Path(sys.argv[1]).read_text()).items()}
    Path(sys.argv[2]).write_text(json.dumps({str(k): v for k, v in parse_all(by_world).items()}))


if __name__ == "__main__":
    main()
