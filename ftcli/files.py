"""`ft upload` and `ft files`: send a data file to the service, streamed with a progress bar, and list the files.

The multipart body is written here from the file, one chunk at a time, with its length known in advance: the file
is never read whole, and the service sees an honest Content-Length.
"""

from __future__ import annotations

import json
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from contract.files import FileFormat, FilePurpose, FileStatus
from ftcli.http import Api

CHUNK_BYTES = 1 << 20
STATUS_STYLE = {FileStatus.PROCESSED: "green", FileStatus.ERROR: "red", FileStatus.UPLOADED: "white"}
FORMATS = ", ".join(f.value for f in FileFormat)

out = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)


def _quoted(name: str) -> str:
    return name.replace("\\", "\\\\").replace('"', '\\"')


def multipart(path: Path, fields: dict[str, str], boundary: str,
              sent: Callable[[int], None]) -> tuple[int, Iterator[bytes]]:
    """(length, chunks) of a multipart/form-data body: the fields, then the file as the part `file`."""
    head = b"".join(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
                    for name, value in fields.items())
    head += (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{_quoted(path.name)}"\r\n'
             "Content-Type: application/octet-stream\r\n\r\n").encode()
    tail = f"\r\n--{boundary}--\r\n".encode()

    def chunks() -> Iterator[bytes]:
        yield head
        with path.open("rb") as f:
            while chunk := f.read(CHUNK_BYTES):
                sent(len(chunk))
                yield chunk
        yield tail

    return len(head) + path.stat().st_size + len(tail), chunks()


def upload(file: Annotated[Path, typer.Argument(exists=True, dir_okay=False, readable=True,
                                                help="The data: text, JSONL ({\"text\": ...}) or chat JSONL")],
           format_: Annotated[str | None, typer.Option("--format", help=f"{FORMATS}; absent: detected")] = None,
           as_json: Annotated[bool, typer.Option("--json", help="Print the API's answer as JSON")] = False) -> None:
    """Upload a data file (streamed, with a progress bar); prints its id. The service then checks every line:
    `ft files` shows it processed, or in error with the lines at fault."""
    fields = {"purpose": FilePurpose.FINE_TUNE.value, **({"format": format_} if format_ else {})}
    boundary = "ft-" + secrets.token_hex(16)
    size = file.stat().st_size
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task(file.name, total=size)
        length, body = multipart(file, fields, boundary, lambda n: bar.advance(task, n))
        created = Api.from_env().json("POST", "/files", content=body, headers={
            "Content-Type": f"multipart/form-data; boundary={boundary}", "Content-Length": str(length)})
    if as_json:
        sys.stdout.write(json.dumps(created) + "\n")
        return
    err.print(f"uploaded [bold]{created['id']}[/] ({created['bytes']} bytes, sha256 {created['sha256'][:12]}…)")
    out.print(created["id"])


def files_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(box=None, header_style="bold")
    for column in ("ID", "FILENAME", "BYTES", "FORMAT", "STATUS", "EXAMPLES", "CREATED"):
        table.add_column(column, no_wrap=column in ("ID", "STATUS"))
    for f in rows:
        stats = f.get("stats") or {}
        status = f"[{STATUS_STYLE.get(f['status'], 'white')}]{f['status']}[/]"
        if f.get("errors"):
            first = f["errors"][0]
            where = f"line {first['line']}: " if first.get("line") else ""
            status += f" ({where}{first['message']})"
        table.add_row(f["id"], f["filename"], str(f["bytes"]), f.get("format") or "-", status,
                      str(stats.get("examples", "-")), (f.get("created_at") or "")[:19].replace("T", " "))
    return table


def list_files(limit: Annotated[int, typer.Option(min=1, max=200)] = 20,
               after: Annotated[str | None, typer.Option(help="The last id of the previous page")] = None,
               as_json: Annotated[bool, typer.Option("--json", help="Print the API's answer as JSON")] = False) -> None:
    """List your files, newest first: status, format, examples, and the first problem of a file in error."""
    params: dict[str, Any] = {"limit": limit, **({"after": after} if after else {})}
    page = Api.from_env().json("GET", "/files", params=params)
    if as_json:
        sys.stdout.write(json.dumps(page) + "\n")
    else:
        out.print(files_table(page["data"]))
