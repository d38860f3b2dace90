"""The steady workload: clients that submit small supervised and preference jobs, cancel some, upload and download
files, follow jobs' event streams (dropping and resuming each connection with Last-Event-ID), poll job states, and a
webhook receiver. Every answer and every event read is recorded for the checks (soak/checks.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
from collections import Counter
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from contract.codes import TERMINAL_STATUSES
from soak.checks import Answer, Delivery, FollowerStream, Received
from soak.cluster import spec
from soak.history import History

TIMEOUT = httpx.Timeout(20.0, connect=5.0)


@dataclass
class Job:
    id: str
    kind: str
    submitted: float
    status: str = "queued"
    attempt: int = 1
    terminal_at: float | None = None
    followers: int = 0


@dataclass
class Record:
    """Everything the clients saw, for the checks."""

    jobs: dict[str, Job] = field(default_factory=dict)
    answers: list[Answer] = field(default_factory=list)
    streams: list[FollowerStream] = field(default_factory=list)
    uploads: dict[str, str] = field(default_factory=dict)  # acknowledged file id -> sha256 of what was sent
    downloads: Counter[str] = field(default_factory=Counter)  # outcome of mid-run downloads: same, differs, failed
    cancels: int = 0
    connection_errors: int = 0
    client_errors: Counter[str] = field(default_factory=Counter)  # exceptions a client survived, by type

    def terminal_since(self) -> dict[str, float]:
        return {j.id: j.terminal_at for j in list(self.jobs.values()) if j.terminal_at is not None}

    def active(self) -> list[Job]:
        return [j for j in list(self.jobs.values()) if j.terminal_at is None]


class Receiver:
    """The webhook receiver: a local HTTP server answering each POST, now and then with a 500 so that the deliverer's
    retries are exercised."""

    def __init__(self, history: History, seed: int, failure_rate: float = 0.1) -> None:
        self.history = history
        self.received: list[Delivery] = []
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with receiver.lock:
                    status = 500 if receiver.rng.random() < failure_rate else 200
                try:
                    payload = json.loads(body)
                except ValueError:
                    payload = {}
                job = (payload.get("job") or {}).get("id", "")
                delivery = Delivery(history.now(), self.headers.get("X-FT-Delivery", ""),
                                    self.headers.get("X-FT-Event", ""), job, payload.get("event_id"), status)
                with receiver.lock:
                    receiver.received.append(delivery)
                history.add("webhook", f"{delivery.event} {delivery.delivery} -> {status}", job)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, name="soak-webhooks", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Workload:
    def __init__(self, api_url: str, key: str, history: History, seed: int, *, followers: int, active_jobs: int,
                 dpo_share: float = 0.4) -> None:
        self.api_url = api_url
        self.headers = {"Authorization": f"Bearer {key}"}
        self.history = history
        self.rng = random.Random(seed ^ 0x5EED)
        self.followers = followers
        self.active_jobs = active_jobs
        self.dpo_share = dpo_share
        self.record = Record()
        self.producing = True  # submits, cancels and uploads; followers and pollers go on until the end
        self.stopping = False
        self.client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------------------------ HTTP
    async def call(self, method: str, path: str, **kwargs: Any) -> httpx.Response | None:
        assert self.client is not None
        try:
            r = await self.client.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            self.record.connection_errors += 1
            self.history.add("client", f"{method} {path}: {type(exc).__name__}")
            return None
        self.record.answers.append(Answer(self.history.now(), method, path, r.status_code,
                                          r.headers.get("Retry-After")))
        if r.status_code >= 500:
            self.history.add("client", f"{method} {path} -> {r.status_code} Retry-After "
                             f"{r.headers.get('Retry-After')}: {r.text[:120]}")
        return r

    # ------------------------------------------------------------------------------------ actors
    async def submitter(self) -> None:
        n = 0
        pending: tuple[str, int] | None = None  # a submit whose answer was lost: sent again under the same key
        while self.producing:
            if pending is not None or len(self.record.active()) < self.active_jobs:
                if pending is None:
                    n += 1
                    pending = ("dpo" if self.rng.random() < self.dpo_share else "sft", n)
                kind, number = pending
                r = await self.call("POST", "/jobs", json=spec(kind, f"soak-{kind}-{number}"),
                                    headers={"Idempotency-Key": f"soak-{number}"})
                if r is not None and r.status_code in (200, 201):
                    job = r.json()
                    if job["id"] not in self.record.jobs:
                        self.record.jobs[job["id"]] = Job(job["id"], kind, self.history.now())
                        self.history.add("client", f"submitted {kind}", job["id"])
                    pending = None
                elif r is not None and r.status_code not in (409, 503):
                    self.history.add("client", f"submit refused {r.status_code}: {r.text[:200]}")
                    pending = None
            await asyncio.sleep(self.rng.uniform(0.5, 2.0))

    async def poller(self) -> None:
        while not self.stopping:
            try:
                await self.poll()
            except Exception as exc:  # one odd answer must not end the poller: its absence would look like late jobs
                self.record.client_errors[type(exc).__name__] += 1
                self.history.add("client", f"poll failed: {type(exc).__name__}: {exc}")
            await asyncio.sleep(1.0)

    async def poll(self) -> None:
        for job in self.record.active():
            r = await self.call("GET", f"/jobs/{job.id}")
            if r is not None and r.status_code == 200:
                body = r.json()
                if body["status"] != job.status or body["attempt"] != job.attempt:
                    self.history.add("client", f"{body['status']} (attempt {body['attempt']})"
                                     f"{' ' + json.dumps(body.get('error'))[:160] if body.get('error') else ''}",
                                     job.id)
                job.status, job.attempt = body["status"], body["attempt"]
                if job.status in TERMINAL_STATUSES and job.terminal_at is None:
                    job.terminal_at = self.history.now()

    async def canceller(self) -> None:
        while self.producing:
            await asyncio.sleep(self.rng.expovariate(1 / 60))
            active = self.record.active()
            if self.producing and active:
                job = self.rng.choice(active)
                r = await self.call("POST", f"/jobs/{job.id}/cancel")
                if r is not None and r.status_code == 202:
                    self.record.cancels += 1
                    self.history.add("client", "cancel accepted", job.id)

    async def uploader(self) -> None:
        n = 0
        while self.producing:
            await asyncio.sleep(self.rng.uniform(3, 10))
            n += 1
            lines = self.rng.randint(20, 2000)
            data = "".join(f"soak upload {n} line {i} {self.rng.getrandbits(64):x}\n" for i in range(lines)).encode()
            r = await self.call("POST", "/files", files={"file": (f"soak-{n}.txt", data, "text/plain")},
                                data={"purpose": "fine-tune", "format": "text"})
            if r is None or r.status_code != 201:
                continue
            file_id = r.json()["id"]
            self.record.uploads[file_id] = hashlib.sha256(data).hexdigest()
            self.history.add("client", f"uploaded {file_id} ({len(data)} bytes)")
            got = await self.download(file_id)
            self.record.downloads["failed" if got is None else "same" if got == self.record.uploads[file_id]
                                  else "differs"] += 1

    async def download(self, file_id: str) -> str | None:
        r = await self.call("GET", f"/files/{file_id}/content")
        if r is None or r.status_code != 200:
            return None
        return hashlib.sha256(r.content).hexdigest()

    # ------------------------------------------------------------------------------------ followers
    async def follower(self, number: int) -> None:
        name = f"follower-{number}"
        rng = random.Random(self.rng.random())
        while not self.stopping:
            candidates = self.record.active()
            if not candidates:
                if not self.producing:
                    return
                await asyncio.sleep(1.0)
                continue
            job = min(candidates, key=lambda j: (j.followers, rng.random()))
            job.followers += 1
            stream = FollowerStream(name, job.id)
            self.record.streams.append(stream)
            try:
                await self.follow(stream, rng)
            except Exception as exc:  # the follower goes on with another job; what it read so far is checked
                self.record.client_errors[type(exc).__name__] += 1
                self.history.add("follower", f"{name} failed: {type(exc).__name__}: {exc}", job.id)
            finally:
                job.followers -= 1

    async def follow(self, stream: FollowerStream, rng: random.Random) -> None:
        """Read the job's stream to its end, dropping the connection now and then and resuming from the last
        event read, as a browser's EventSource does."""
        while not self.stopping:
            last = stream.events[-1].seq if stream.events else None
            headers = {"Accept": "text/event-stream"}
            if last is not None:
                headers["Last-Event-ID"] = str(last)
                stream.resumed_from.append(last)
            try:
                ended = await asyncio.wait_for(self._read(stream, headers), rng.uniform(2.0, 12.0))
            except asyncio.TimeoutError:
                continue  # dropped on purpose: resume
            if ended:
                job = self.record.jobs[stream.job]
                if job.terminal_at is not None or await self._terminal(stream.job):
                    return
            await asyncio.sleep(0.5)

    async def _terminal(self, job_id: str) -> bool:
        r = await self.call("GET", f"/jobs/{job_id}")
        return r is not None and r.status_code == 200 and r.json()["status"] in TERMINAL_STATUSES

    async def _read(self, stream: FollowerStream, headers: dict[str, str]) -> bool:
        """True when the server ended the stream cleanly (the job ended and every event was sent)."""
        assert self.client is not None
        try:
            async with self.client.stream("GET", f"/jobs/{stream.job}/events", headers=headers,
                                          timeout=httpx.Timeout(30.0, connect=5.0)) as r:
                self.record.answers.append(Answer(self.history.now(), "GET", f"/jobs/{stream.job}/events",
                                                  r.status_code, r.headers.get("Retry-After")))
                if r.status_code != 200:
                    return False
                frame: dict[str, str] = {}
                async for line in r.aiter_lines():
                    if line == "":
                        if "id" in frame:
                            data = json.loads(frame.get("data", "{}"))
                            stream.events.append(Received(int(frame["id"]), frame.get("event", ""),
                                                          int(data.get("attempt", 0))))
                            stream.t_last = self.history.now()
                        frame = {}
                    elif not line.startswith(":") and ":" in line:
                        k, _, v = line.partition(":")
                        frame[k] = v.removeprefix(" ")
                return True
        except httpx.HTTPError:
            return False

    # ------------------------------------------------------------------------------------ run
    async def run(self, produce_for: float, done: asyncio.Event) -> None:
        async with httpx.AsyncClient(base_url=self.api_url, headers=self.headers, timeout=TIMEOUT,
                                     limits=httpx.Limits(max_connections=self.followers + 20)) as client:
            self.client = client
            producers = [asyncio.create_task(c()) for c in (self.submitter, self.canceller, self.uploader)]
            others = [asyncio.create_task(self.poller())]
            others += [asyncio.create_task(self.follower(i)) for i in range(self.followers)]
            try:
                await asyncio.wait_for(done.wait(), produce_for)
            except asyncio.TimeoutError:
                pass
            self.producing = False
            self.history.add("client", "workload stops producing; followers and pollers go on")
            for t in producers:
                t.cancel()
            await asyncio.gather(*producers, return_exceptions=True)
            await done.wait()
            self.stopping = True
            for t in others:
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
