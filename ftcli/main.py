"""`ft`: submit, list, read, follow, cancel and wait for fine-tune jobs from a terminal or a script.

Configured by FT_API_URL (default http://127.0.0.1:8000) and FT_API_KEY (else ./var/dev-key, which `make up`
writes). Every command takes `--json` for scripts. Exit codes: 0 done (for `wait`, `watch` and `submit --wait`:
the job succeeded), 1 the job ended otherwise, 2 a usage error, 3 the service refused the request or could not
be reached (its message and the field at fault on stderr, never a traceback).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape

from contract.codes import EventKind, JobStatus
from ftcli import download as downloads
from ftcli import files, render
from ftcli.http import Api, CliError
from ftcli.jobfile import load_job

EXIT_JOB_NOT_SUCCEEDED = 1
EXIT_SERVICE_ERROR = 3

app = typer.Typer(help="Fine-tune jobs from a terminal: FT_API_URL, FT_API_KEY (else ./var/dev-key). Exit codes: "
                  "0 done (wait/watch/submit --wait: succeeded), 1 the job ended otherwise, 2 usage, 3 the "
                  "service refused or was unreachable.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)
out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)

Json = Annotated[bool, typer.Option("--json", help="Print JSON (what the API answered) instead of tables")]
JobId = Annotated[str, typer.Argument(help="A job id, as `ft submit` or `ft ls` shows it")]


def emit(value: Any) -> None:
    """JSON on stdout, one document per call (a line each, so scripts can read a stream of them)."""
    sys.stdout.write(json.dumps(value) + "\n")
    sys.stdout.flush()


def wait_for_end(api: Api, job_id: str, as_json: bool) -> dict[str, Any]:
    """Follows the job's state events until its stream ends (the job ended), then reads it."""
    for e in api.events(job_id, types=[EventKind.STATE], on_reconnect=reconnecting(as_json)):
        if not as_json:
            err.print(f"{job_id}: {e.get('status')}")
    return api.json("GET", f"/jobs/{job_id}")


def reconnecting(as_json: bool) -> Any:
    def say(last: int, why: str) -> None:
        # stderr in both modes: stdout stays the events (or nothing) for a script.
        err.print(f"[yellow]stream dropped ({escape(why)}); resuming after event {last}[/]")
    return say


def finished(job: dict[str, Any], as_json: bool) -> None:
    if as_json:
        emit(job)
    else:
        out.print(render.job_table(job))
    if job["status"] != JobStatus.SUCCEEDED:
        raise typer.Exit(EXIT_JOB_NOT_SUCCEEDED)


@app.command()
def submit(job_file: Annotated[Path, typer.Argument(help="The job as JSON (see examples/demo-job.json)")],
           set_: Annotated[list[str] | None, typer.Option("--set", help="Override a field: a.b=value (JSON or text); "
                                                          "repeatable")] = None,
           wait: Annotated[bool, typer.Option("--wait", help="Follow the job to its end; exit 0 only if it "
                                                             "succeeded")] = False,
           dry_run: Annotated[bool, typer.Option("--dry-run", help="Validate and resolve, estimate memory and "
                                                                   "duration; create nothing")] = False,
           idempotency_key: Annotated[str | None, typer.Option(help="Makes a retried submit safe")] = None,
           as_json: Json = False) -> None:
    """Submit a job."""
    api = Api.from_env()
    job = load_job(job_file, set_ or [])
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
    if dry_run:
        answer = api.json("POST", "/jobs", params={"dry_run": "true"}, json=job, headers=headers)
        if as_json:
            emit(answer)
        else:
            out.print(render.dry_run_table(answer))
        return
    created = api.json("POST", "/jobs", json=job, headers=headers)
    if as_json and not wait:
        emit(created)
        return
    err.print(f"submitted [bold]{created['id']}[/] ({created['status']}, queue {created['queue']})")
    if not as_json:
        out.print(created["id"])
    if wait:
        finished(wait_for_end(api, created["id"], as_json), as_json)


@app.command("ls")
def list_jobs(status: Annotated[str | None, typer.Option(help="queued, running, succeeded, ...")] = None,
              owner: Annotated[str | None, typer.Option(help="Only this owner's (admin keys)")] = None,
              queue: Annotated[str | None, typer.Option()] = None,
              limit: Annotated[int, typer.Option(min=1, max=200)] = 20,
              as_json: Json = False) -> None:
    """List jobs, newest first."""
    params = {k: v for k, v in (("status", status), ("owner", owner), ("queue", queue)) if v is not None}
    page = Api.from_env().json("GET", "/jobs", params={**params, "limit": limit})
    if as_json:
        emit(page)
    else:
        out.print(render.jobs_table(page["data"]))


@app.command()
def get(job_id: JobId, as_json: Json = False) -> None:
    """Show one job."""
    job = Api.from_env().json("GET", f"/jobs/{job_id}")
    if as_json:
        emit(job)
    else:
        out.print(render.job_table(job))


@app.command()
def watch(job_id: JobId, as_json: Json = False) -> None:
    """Follow a job live (step/total, loss, tokens/s, ETA) until it ends; resumes a dropped stream where it
    stopped. With --json, every event as one JSON line. Exit 0 only if the job succeeded."""
    api = Api.from_env()
    job = api.json("GET", f"/jobs/{job_id}")
    if as_json:
        for e in api.events(job_id, on_reconnect=reconnecting(True)):
            emit(e)
    else:
        with render.Watch(out, job) as bar:
            for e in api.events(job_id, on_reconnect=reconnecting(False)):
                bar.event(e)
    job = api.json("GET", f"/jobs/{job_id}")
    if not as_json:
        out.print(f"{job_id} {render.status_text(job['status'])}")
    if job["status"] != JobStatus.SUCCEEDED:
        raise typer.Exit(EXIT_JOB_NOT_SUCCEEDED)


@app.command()
def logs(job_id: JobId,
         follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream until the job ends")] = False,
         as_json: Json = False) -> None:
    """Print every rank's output."""
    api = Api.from_env()
    if as_json:  # the log events themselves, one per line
        after = 0
        while True:
            page = api.json("GET", f"/jobs/{job_id}/events",
                            params={"type": EventKind.LOG, "after": after, "limit": 1000})
            for e in page["data"]:
                emit(e)
            after = page["next_after"]
            if not page["has_more"]:
                break
        if follow:
            for e in api.events(job_id, after=after, types=[EventKind.LOG], on_reconnect=reconnecting(True)):
                emit(e)
        return
    if follow:
        for chunk in api.stream_text(f"/jobs/{job_id}/logs", {"follow": "true"}):
            sys.stdout.write(chunk)
            sys.stdout.flush()
    else:
        sys.stdout.write(api.request("GET", f"/jobs/{job_id}/logs").text)


@app.command()
def cancel(job_id: JobId, as_json: Json = False) -> None:
    """Cancel a job (a queued one at once, a running one at its next step)."""
    job = Api.from_env().json("POST", f"/jobs/{job_id}/cancel")
    if as_json:
        emit(job)
    else:
        out.print(f"{job_id} {render.status_text(job['status'])}")


@app.command()
def nodes(as_json: Json = False) -> None:
    """List the cluster's nodes: kind, state, free slots, queues, placed jobs."""
    answer = Api.from_env().json("GET", "/nodes")
    if as_json:
        emit(answer)
    else:
        out.print(render.nodes_table(answer["data"]))


@app.command()
def download(job_id: JobId,
             dest: Annotated[Path | None, typer.Argument(help="The folder to write into (default: ./JOB_ID)")] = None,
             parallel: Annotated[int, typer.Option(min=1, max=16, help="Files downloaded at once")] = 4,
             checkpoint: Annotated[int | None, typer.Option(
                 min=0, help="A committed checkpoint's files (its step) instead of the export")] = None,
             chunk_size: Annotated[str, typer.Option(
                 help="A larger file comes in ranged requests of this size (bytes, or with K, M, G)")] = "64M",
             connections: Annotated[int, typer.Option(min=1, max=16, help="Chunks of one file fetched at once")] = 4,
             as_json: Json = False) -> None:
    """Download a succeeded job's export, or a committed checkpoint of any job: every file checked against its
    SHA-256, a large one in chunks over a few connections; an interrupted download continues where it stopped (its
    .part file, only the chunks missing), and files already there and verified are skipped."""
    folder = dest or Path(job_id if checkpoint is None else f"{job_id}-step-{checkpoint}")
    fetched = downloads.download(Api.from_env(), job_id, folder, parallel=parallel,
                                 console=None if as_json else err, checkpoint=checkpoint,
                                 chunk_bytes=downloads.parse_size(chunk_size, "--chunk-size"),
                                 connections=connections)
    if as_json:
        emit({"job_id": job_id, "dir": str(folder), "files": [vars(f) for f in fetched]})
        return
    for f in fetched:
        out.print(f"{f.status:10} {f.bytes:>12}  {escape(f.path)}", highlight=False)
    out.print(f"{len(fetched)} files in {escape(str(folder))}, each matching its SHA-256")


@app.command("wait")
def wait_(job_id: JobId, as_json: Json = False) -> None:
    """Wait for a job to end; exit 0 only if it succeeded."""
    finished(wait_for_end(Api.from_env(), job_id, as_json), as_json)


app.command("upload")(files.upload)
app.command("files")(files.list_files)


def main() -> None:
    """The entry point: the service's errors are printed as it gave them, not as a traceback."""
    as_json = "--json" in sys.argv[1:]
    try:
        # Outside standalone mode click returns typer.Exit's code instead of exiting.
        sys.exit(app(standalone_mode=False) or 0)
    except CliError as exc:
        if as_json:
            emit(exc.as_json())
        where = f" (field: {exc.field})" if exc.field else ""
        code = f"{exc.code}: " if exc.code else ""
        err.print(f"[red]error[/] {escape(code + exc.message + where)}", highlight=False)
        sys.exit(EXIT_SERVICE_ERROR)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err.print("aborted")
        sys.exit(130)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as exc:  # click's usage errors, and anything unforeseen, as one line
        import click

        if isinstance(exc, click.ClickException):
            exc.show()
            sys.exit(exc.exit_code)
        err.print(f"[red]error[/] {escape(f'{type(exc).__name__}: {exc}')}", highlight=False)
        sys.exit(EXIT_SERVICE_ERROR)


if __name__ == "__main__":
    main()
