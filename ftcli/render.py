"""How jobs look on a terminal: a table of jobs, one job's fields, and the live progress bar of `ft watch`."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from contract.codes import EventKind, JobStatus
from contract.protocol import NODE_STATE, JobField, NodeState

STATUS_STYLE = {JobStatus.SUCCEEDED: "green", JobStatus.FAILED: "red", JobStatus.CANCELLED: "yellow",
                JobStatus.CANCELLING: "yellow", JobStatus.RUNNING: "cyan", JobStatus.STARTING: "cyan",
                JobStatus.QUEUED: "white"}


def num(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def status_text(status: str) -> str:
    return f"[{STATUS_STYLE.get(status, 'white')}]{status}[/]"


def jobs_table(jobs: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold")
    for column in ("ID", "NAME", "OWNER", "QUEUE", "STATUS", "STEP", "LOSS", "CREATED"):
        table.add_column(column, no_wrap=column in ("ID", "STATUS"))
    for j in jobs:
        p = j.get(JobField.PROGRESS) or {}
        table.add_row(j["id"], j.get("name") or "", j.get("owner") or "", j.get("queue") or "",
                      status_text(j["status"]), f"{p.get('step') or 0}/{p.get('total_steps') or '?'}",
                      num(p.get("loss"), ".4f"), (j.get("created_at") or "")[:19].replace("T", " "))
    return table


def job_table(j: dict[str, Any]) -> Table:
    p = j.get(JobField.PROGRESS) or {}
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    rows: list[tuple[str, str]] = [
        ("id", j["id"]), ("name", j.get("name") or ""), ("owner", j.get("owner") or ""),
        ("queue", j.get("queue") or ""), ("status", status_text(j["status"])), ("attempt", str(j.get("attempt"))),
        ("step", f"{p.get('step') or 0}/{p.get('total_steps') or '?'}"), ("loss", num(p.get("loss"), ".4f")),
        ("tokens/s", num(p.get("tokens_per_second"), ",.0f")), ("eta", eta(p.get("eta_seconds"))),
        # The times, each labelled by its field's name without `_at`.
        *((f.removesuffix("_at"), j.get(f) or ("" if f == "created_at" else "-"))
          for f in ("created_at", "started_at", "finished_at"))]
    if preference_text(p):
        rows.append(("rewards", preference_text(p)))
    if j.get("checkpoints"):
        rows.append(("checkpoints", ", ".join(f"step {c['step']}" for c in j["checkpoints"])))
    if j.get("output"):
        rows.append(("output", str(j["output"].get("path") or j["output"])))
    error = j.get(JobField.ERROR)
    if error:
        rows.append((JobField.ERROR.value, f"[red]{error.get('code')}[/]: {error.get('message', '')}"))
    for k, v in rows:
        table.add_row(k, v)
    return table


def preference_text(figures: dict[str, Any]) -> str:
    """A dpo job's reward figures (trl's names) as one phrase; empty for a supervised job's."""
    accuracy, margin = figures.get("rewards/accuracies"), figures.get("rewards/margins")
    if accuracy is None and margin is None:
        return ""
    return f"accuracy {num(accuracy, '.3f')}, margin {num(margin, '.4f')}"


def eta(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return "-"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


class Watch:
    """The progress bar of one job: step of total, loss, tokens/s, ETA, updated from its events."""

    def __init__(self, console: Console, job: dict[str, Any]) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s  eta {task.fields[eta]}"
                                            "  [bold]{task.fields[status]}[/]"),
                                 TimeElapsedColumn(), console=console, transient=False)
        p = job.get(JobField.PROGRESS) or {}
        self.task = self.progress.add_task(job["id"], total=p.get("total_steps") or None, completed=p.get("step") or 0,
                                           loss=num(p.get("loss"), ".4f"), tps=num(p.get("tokens_per_second"), ",.0f"),
                                           eta=eta(p.get("eta_seconds")), status=job["status"])

    def __enter__(self) -> Watch:
        self.progress.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.progress.stop()

    def event(self, e: dict[str, Any]) -> None:
        kind = e.get("type")
        if kind == EventKind.PROGRESS:
            fields: dict[str, Any] = {"loss": num(e.get("loss"), ".4f"), "tps": num(e.get("tokens_per_second"), ",.0f"),
                                      "eta": eta(e.get("eta_seconds"))}
            if e.get("total_steps"):
                fields["total"] = e["total_steps"]
            self.progress.update(self.task, completed=e.get("step") or 0, **fields)
        elif kind == EventKind.STARTED and e.get("total_steps"):
            self.progress.update(self.task, total=e["total_steps"], completed=e.get("resumed_from_step") or 0)
        elif kind == EventKind.STATE:
            self.progress.update(self.task, status=e.get("status", ""))
        elif kind == EventKind.EVAL:
            figures = preference_text(e)
            self.progress.console.print(f"eval at step {e.get('step')}: loss {num(e.get('loss'), '.4f')}"
                                        + (f", {figures}" if figures else ""))
        elif kind == EventKind.CHECKPOINT and e.get("committed"):
            self.progress.console.print(f"checkpoint at step {e.get('step')} committed")


def gib(n: Any) -> str:
    return f"{n / 2**30:,.1f} GiB" if isinstance(n, (int, float)) else "-"


def dry_run_table(answer: dict[str, Any]) -> Table:
    """What `POST /jobs?dry_run=true` answered: the resolved settings, the memory estimate, where it fits and
    what would make it fit."""
    e = answer.get("estimate") or {}
    resolved = (answer.get("job") or {}).get(JobField.RESOLVED) or {}
    table = Table(box=None, show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("valid", "[green]yes[/] (nothing was created)")
    table.add_row("micro batch", f"{resolved.get('micro_batch_size')} × accumulation "
                                 f"{resolved.get('gradient_accumulation_steps')}")
    table.add_row("parameters", f"{num(e.get('parameters'), ',')} ({e.get('parameters_source') or 'unknown'}); "
                                f"trainable {num(e.get('trainable_parameters'), ',')}")
    table.add_row("GPU memory / device", gib(e.get("gpu_bytes_per_device")))
    table.add_row("host memory / node", gib(e.get("host_bytes_per_node")))
    for f in e.get("fits") or []:
        verdict = "[green]fits[/]" if f.get("fits") else "[red]does not fit[/]"
        table.add_row(f"on {f.get('kind')}", f"{verdict} {'; '.join(f.get('reasons') or [])}")
    for s in e.get("suggestions") or []:
        where = ", ".join(s.get("fits_on") or [])
        table.add_row("would fit with", f"{s.get('change')} → {gib(s.get('gpu_bytes_per_device'))} per device, "
                                        f"{gib(s.get('host_bytes_per_node'))} host ({where})")
    d = e.get("duration_seconds")
    table.add_row("duration", f"{eta(d)} ({e.get('duration_basis')})" if d is not None
                  else f"- ({e.get('duration_basis') or 'no measured throughput'})")
    for note in e.get("notes") or []:
        table.add_row("note", note)
    p = answer.get("placement") or {}
    if p:
        table.add_row("placement", ("[green]" if p.get("placeable_now") else "[yellow]") + f"{p.get('summary')}[/]")
        for n in p.get("nodes") or []:
            verdict = ("[green]free now[/]" if n.get("free_now") else "[yellow]busy[/]") if n.get("fits") \
                else f"[red]cannot[/] {'; '.join(n.get('reasons') or [])}"
            table.add_row(f"  node {n.get('node')}", f"{n.get('kind')}, {n.get('slots_free')}/{n.get('slots_total')} "
                                                    f"slots free: {verdict}")
    return table


def nodes_table(nodes: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold")
    for column in ("NODE", "KIND", "STATE", "SLOTS FREE", "QUEUES", "JOBS", "LAST SEEN"):
        table.add_column(column, no_wrap=column in ("NODE", "STATE"))
    styles = {NodeState.UP.value: "green", NodeState.DRAINING.value: "yellow", NodeState.DISK_FULL.value: "red",
              NodeState.LOST.value: "red"}
    for n in nodes:
        table.add_row(n["name"], n.get("kind") or "", f"[{styles.get(n[NODE_STATE], 'white')}]{n[NODE_STATE]}[/]",
                      f"{n.get('slots_free')}/{n.get('slots_total')}", ",".join(n.get("queues") or []),
                      ", ".join(j["id"] for j in n.get("jobs") or []) or "-",
                      (n.get("last_seen") or "")[:19].replace("T", " "))
    return table
