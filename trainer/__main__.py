"""`python -m trainer --spec run.json`: run one attempt of a job and report it as JSON events on stdout.

Exit codes: contract/codes.py `TrainerExit`.
"""

from __future__ import annotations

import argparse
import errno
import sys
import traceback

from contract.codes import EventKind, FailureCode, TrainerExit
from contract.spec import RunSpec
from trainer import startup
from trainer.errors import Interrupted, TrainerError
from trainer.events import emit


def _error_code(exc: BaseException) -> str:
    if isinstance(exc, TrainerError):
        return exc.code
    if wrote_to_a_full_disk(exc):
        return FailureCode.DISK_FULL
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return FailureCode.OUT_OF_MEMORY
    return TrainerError.code


def wrote_to_a_full_disk(exc: BaseException) -> bool:
    """A write the filesystem refused for room: ENOSPC or EDQUOT anywhere in the exception's chain, or torch's
    archive writer's own word for a short write (a checkpoint's torch.save on a full disk raises no OSError)."""
    seen: BaseException | None = exc
    for _ in range(16):  # a chain's depth, bounded: a cycle in it must not hang the error report
        if seen is None:
            return False
        if isinstance(seen, OSError) and seen.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if isinstance(seen, RuntimeError) and "inline_container.cc" in str(seen) and "unexpected pos" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def main(argv: list[str] | None = None) -> int:
    created = startup.process_start()
    if created is not None:
        startup.mark("process", created)
    parser = argparse.ArgumentParser(prog="python -m trainer")
    parser.add_argument("--spec", required=True, help="path of a RunSpec JSON file")
    # The deepspeed launcher appends --local_rank=K; the rank comes from the environment instead.
    parser.add_argument("--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        with open(args.spec, encoding="utf-8") as f:
            run_spec = RunSpec.model_validate_json(f.read())
    except Exception as exc:
        emit(EventKind.ERROR, code=FailureCode.TRAINER_ERROR, message=f"cannot read run spec {args.spec}: {exc}")
        return TrainerExit.FAILED

    from trainer import recipe

    startup.mark("imported")
    try:
        recipe.run(run_spec)
        return TrainerExit.DONE
    except Interrupted:
        return TrainerExit.INTERRUPTED
    except Exception as exc:
        emit(EventKind.ERROR, code=_error_code(exc), message=str(exc) or type(exc).__name__,
             exception=type(exc).__name__)
        traceback.print_exc(file=sys.stderr)
        return TrainerExit.FAILED
    finally:
        recipe.cleanup()


if __name__ == "__main__":
    sys.exit(main())
