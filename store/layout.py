"""Where each artifact lives in the store, in a layout an operator can read with any S3 client:

    files/<file id>                                 an uploaded file, as sent
    jobs/<job id>/output/<path>                     the export (weights, tokenizer, config)
    jobs/<job id>/output.json                       its manifest: every file with bytes and SHA-256
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
