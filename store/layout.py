"""Where each artifact lives in the store, in a layout an operator can read with any S3 client:

    files/<file id>                                 an uploaded file, as sent
    jobs/<job id>/output/<path>                     the export (weights, tokenizer, config)
    jobs/<job id>/output.json                       its manifest: every file with bytes and SHA-256
    jobs/<job id>/fence                             the newest attempt a worker started (raised, never lowered)
    jobs/<job id>/checkpoints/.attempt-N/step-K/<path>   a checkpoint's files, as attempt N uploaded them
    jobs/<job id>/checkpoints/.attempt-N/step-K/parts/node-R.json   what node R uploaded of it
    jobs/<job id>/checkpoints/step-K.json           the commit: its manifest (every object, bytes, SHA-256)
"""

from __future__ import annotations

OUTPUT_MANIFEST = "output.json"


def file_key(file_id: str) -> str:
    return f"files/{file_id}"


def job_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/"


def output_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/output/"


def output_manifest_key(job_id: str) -> str:
    return f"jobs/{job_id}/{OUTPUT_MANIFEST}"


FENCE = "fence"
PARTS = "parts"


def fence_key(job_id: str) -> str:
    return f"jobs/{job_id}/{FENCE}"


def checkpoints_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/checkpoints/"


def checkpoint_manifest_key(job_id: str, tag: str) -> str:
    """`tag` is the trainer's tag, `step-00000042`: zero-padded, so manifests list in step order."""
    return f"{checkpoints_prefix(job_id)}{tag}.json"


def checkpoint_staging_prefix(job_id: str, attempt: int, tag: str) -> str:
    return f"{checkpoints_prefix(job_id)}.attempt-{attempt}/{tag}/"


def checkpoint_part_key(job_id: str, attempt: int, tag: str, node_rank: int) -> str:
    return f"{checkpoint_staging_prefix(job_id, attempt, tag)}{PARTS}/node-{node_rank}.json"
