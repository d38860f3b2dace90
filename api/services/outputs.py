"""A job's export in the artifact store, as the API serves it: the list of its files (from the manifest the worker
wrote, stored in jobs.output) and where each one is. Only a path the manifest lists is ever served, so no path a
client spells ('../', an absolute one, an encoded one, a link) can reach anything else."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from api.errors import ApiError, ErrorCode
from api.schemas import OutputFile, OutputList
from contract.codes import JobStatus
from store.layout import output_prefix


def _stored_files(job: dict[str, Any]) -> list[dict[str, Any]]:
    output = job.get("output") or {}
    files = output.get("files")
    # A job that succeeded before exports went to the store lists bare names and no `store`: nothing to serve.
    if job.get("status") != JobStatus.SUCCEEDED or not output.get("store") or not isinstance(files, list):
        raise ApiError(404, ErrorCode.NO_OUTPUT, f"job {job['id']!r} has no export in the artifact store "
                       f"(it is {job.get('status')}; a job's export is there once it succeeded)", "id")
    return [f for f in files if isinstance(f, dict)]


def url_of(job_id: str, path: str) -> str:
    return f"/jobs/{job_id}/output/{quote(path)}"


def listing(job_json: bytes) -> OutputList:
    job = json.loads(job_json)
    files = _stored_files(job)
    output = job["output"]
    return OutputList(job_id=job["id"], format=output.get("format", "huggingface"), step=output.get("step"),
                      final_loss=output.get("final_loss"), bytes=sum(int(f["bytes"]) for f in files),
                      files=[OutputFile(path=f["path"], bytes=f["bytes"], sha256=f["sha256"],
                                        url=url_of(job["id"], f["path"])) for f in files])


def file_of(job_json: bytes, path: str) -> tuple[str, int, str]:
    """The store key, size and SHA-256 of the export's file at `path`, or the 404 naming `path`."""
    job = json.loads(job_json)
    for f in _stored_files(job):
        if f["path"] == path:
            return output_prefix(job["id"]) + path, int(f["bytes"]), str(f["sha256"])
    raise ApiError(404, ErrorCode.NOT_FOUND, f"path: {path[:200]!r} is not a file of job {job['id']!r}'s export; "
                   f"GET /jobs/{job['id']}/output lists them", "path")
