"""Where each artifact lives in the store, in a layout an operator can read with any S3 client:

    files/<file id>                                 an uploaded file, as sent
    jobs/<job id>/output/<path>                     the export (weights, tokenizer, config)
    jobs/<job id>/output.json                       its manifest: every file with bytes and SHA-256
    jobs/<job id>/fences/attempt-N.json             attempt N's takeover: written once, by the worker starting it
    jobs/<job id>/checkpoints/.attempt-N/step-K/<path>   a checkpoint's files, as attempt N uploaded them
    jobs/<job id>/checkpoints/.attempt-N/step-K/parts/node-R.json   what node R uploaded of it
    jobs/<job id>/checkpoints/step-K.attempt-N.json the commit: its manifest (every object, bytes, SHA-256)
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


FENCES = "fences"
PARTS = "parts"


def fences_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/{FENCES}/"


def fence_key(job_id: str, attempt: int) -> str:
    return f"{fences_prefix(job_id)}attempt-{attempt:08d}.json"


def checkpoints_prefix(job_id: str) -> str:
    return f"jobs/{job_id}/checkpoints/"


def checkpoint_manifest_key(job_id: str, tag: str, attempt: int) -> str:
    """`tag` is the trainer's tag, `step-00000042`: zero-padded, so manifests list in step order. The attempt in
    the name keeps two attempts' commits of one step apart: a superseded attempt's late write never replaces the
    current one's."""
    return f"{checkpoints_prefix(job_id)}{tag}.attempt-{attempt}.json"


def checkpoint_staging_prefix(job_id: str, attempt: int, tag: str) -> str:
    return f"{checkpoints_prefix(job_id)}.attempt-{attempt}/{tag}/"


def checkpoint_part_key(job_id: str, attempt: int, tag: str, node_rank: int) -> str:
    return f"{checkpoint_staging_prefix(job_id, attempt, tag)}{PARTS}/node-{node_rank}.json"
