"""Webhooks: signed deliveries of a job's state changes and checkpoints, retries, a hanging receiver, the SSRF
rules at submit and at delivery, and an owner's default URL.

The receivers are HTTP servers on 127.0.0.1 in this process; the shared stack allows 127.0.0.1/32
(FT_WEBHOOK_ALLOW_NETS, tests/conftest.py), and the refusals run against an API of their own without that
list. Only one job trains (to success, with checkpoints); the other events come from cancelling jobs parked
on a queue no worker serves, which costs no training.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import ssl
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest

from api.settings import ApiSettings
from controlplane.deliverer import Claimed, Deliverer, backoff
from controlplane.settings import ControlPlaneSettings
from core import secretbox, webhooks
from db.models import Job
from db.outbox import event_type
from tests.apiproc import ApiProcess, add_key, fixed_key
from tests.helpers import wait_for, wait_status

PARKED = "webhooks-parked"  # no worker serves it


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    at: float


@dataclass
class Receiver:
    """A webhook receiver: `/ok` answers 200, `/flaky` 500 twice per delivery and then 200, `/hang` answers
    nothing until released."""

    server: ThreadingHTTPServer
    got: list[Received] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)
    sni: list[str | None] = field(default_factory=list)  # the TLS server names clients sent

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def at(self, path: str) -> list[Received]:
        return [r for r in self.got if r.path == path]


def start_receiver(tls: ssl.SSLContext | None = None) -> Receiver:
    receiver: Receiver

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (the standard library's name)
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            receiver.got.append(Received(self.path, dict(self.headers.items()), body, time.monotonic()))
            if self.path == "/hang":
                receiver.release.wait(60)
                status = 200
            elif self.path == "/flaky":
                delivery = self.headers["X-FT-Delivery"]
                tries = [r for r in receiver.at("/flaky") if r.headers["X-FT-Delivery"] == delivery]
                status = 500 if len(tries) <= 2 else 200
            else:
                status = 200
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_: Any) -> None:
            pass

    receiver = Receiver(ThreadingHTTPServer(("127.0.0.1", 0), Handler))
    receiver.server.daemon_threads = True
    if tls is not None:
        tls.sni_callback = lambda _sock, name, _ctx: receiver.sni.append(name)  # type: ignore[assignment]
        receiver.server.socket = tls.wrap_socket(receiver.server.socket, server_side=True)
    threading.Thread(target=receiver.server.serve_forever, daemon=True).start()
    return receiver


@pytest.fixture(scope="module")
def rx() -> Iterator[Receiver]:
    receiver = start_receiver()
    yield receiver
    receiver.release.set()
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def hanging() -> Iterator[Receiver]:
    """A second receiver (another port, so another receiver to the per-receiver bound) that hangs."""
    receiver = start_receiver()
    yield receiver
    receiver.release.set()
    receiver.server.shutdown()


@pytest.fixture(scope="module")
def secret(api: httpx.Client) -> str:
    r = api.put("/owners/default/webhook", json={"url": None, "rotate_secret": True})
    assert r.status_code == 200, r.text
    assert r.json()["secret"].startswith("whsec_")
    again = api.get("/owners/default/webhook")
    assert again.status_code == 200 and again.json()["secret"] is None  # shown only when made or rotated
    return str(r.json()["secret"])


def test_the_stored_secret_is_encrypted_and_only_its_prefix_shown(api: httpx.Client, secret: str,
                                                                  stack_env: dict[str, str]) -> None:
    with psycopg.connect(stack_env["FT_DATABASE_URL"].replace("+psycopg", ""), autocommit=True) as conn:
        stored, whole = conn.execute("SELECT secret, row_to_json(w)::text FROM webhook_owners AS w "
                                     "WHERE owner = 'default'").fetchone() or (None, None)
    assert stored and whole and secret not in whole and secret[6:] not in whole, whole  # nowhere in the row
    assert stored.startswith("v1:") and not stored.startswith(webhooks.SECRET_PREFIX), stored
    assert api.get("/owners/default/webhook").json()["secret_prefix"] == secret[:10]


def parked(api: httpx.Client, make_job: Callable[..., dict[str, Any]], url: str | None) -> str:
    body = make_job(resources={"queue": PARKED}, name="webhook-parked",
                    **({"notifications": {"webhook_url": url}} if url else {}))
    r = api.post("/jobs", json=body)
    assert r.status_code == 201, r.text
    return str(r.json()["id"])


def deliveries(api: httpx.Client, job_id: str) -> list[dict[str, Any]]:
    r = api.get(f"/jobs/{job_id}/deliveries")
    assert r.status_code == 200, r.text
    return list(r.json()["data"])


def settled(api: httpx.Client, job_id: str, count: int) -> list[dict[str, Any]] | None:
    found = deliveries(api, job_id)
    return found if len(found) >= count and all(d["status"] != "pending" for d in found) else None


# -- without a stack ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.10", "169.254.169.254", "10.1.2.3", "172.16.0.1",
                                     "192.168.1.1", "100.64.0.1", "0.0.0.0", "224.0.0.1", "240.0.0.1",
                                     "255.255.255.255", "::1", "::", "fe80::1", "fc00::1", "fd12:3456::1", "ff02::1",
                                     "::ffff:127.0.0.1", "::ffff:169.254.169.254", "::ffff:10.0.0.1",
                                     "64:ff9b::7f00:1"])
def test_internal_addresses_are_blocked(address: str) -> None:
    ip = ipaddress.ip_address(address)
    assert webhooks.blocked(ip) is not None
    reason = webhooks.allowed(ip, ())
    assert reason is not None and "FT_WEBHOOK_ALLOW_NETS" in reason


@pytest.mark.parametrize("address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_pass(address: str) -> None:
    assert webhooks.blocked(ipaddress.ip_address(address)) is None


def test_allow_list_permits_only_its_ranges() -> None:
    allow = webhooks.parse_allow_nets("127.0.0.1/32, 10.20.0.0/16,fd00::/8")
    assert webhooks.allowed(ipaddress.ip_address("127.0.0.1"), allow) is None
    assert webhooks.allowed(ipaddress.ip_address("::ffff:127.0.0.1"), allow) is None  # the same host
    assert webhooks.allowed(ipaddress.ip_address("10.20.3.4"), allow) is None
    assert webhooks.allowed(ipaddress.ip_address("fd00::5"), allow) is None
    assert webhooks.allowed(ipaddress.ip_address("127.0.0.2"), allow) is not None
    assert webhooks.allowed(ipaddress.ip_address("10.21.0.1"), allow) is not None
    assert webhooks.allowed(ipaddress.ip_address("169.254.169.254"), allow) is not None
    with pytest.raises(ValueError, match="not a CIDR"):
        webhooks.parse_allow_nets("10.0.0.0/33")
    with pytest.raises(ValueError, match="FT_WEBHOOK_ALLOW_NETS|webhook_allow_nets"):
        ApiSettings(webhook_allow_nets="localhost")


@pytest.mark.parametrize(("url", "problem"), [("ftp://example.com/x", "http:// or https://"),
                                              ("http:///path", "names no host"), ("https://a b.com/", "whitespace"),
                                              ("http://example.com:99999/", "not a URL"),
                                              ("https://example.com/#frag", "fragment"),
                                              ("https://example.com/\ud800", "surrogate")])
def test_url_syntax_is_checked(url: str, problem: str) -> None:
    assert problem in (webhooks.syntax_problem(url) or "")


def test_names_resolve_and_internal_names_are_refused() -> None:
    # localhost resolves (/etc/hosts) to loopback: refused without the allow-list, by its address, not its name.
    with pytest.raises(webhooks.Refused, match="loopback"):
        asyncio.run(webhooks.vet("http://localhost:8080/hook", ()))
    with pytest.raises(webhooks.Refused, match="does not resolve"):
        asyncio.run(webhooks.vet("http://no-such-host.invalid/hook", ()))
    with pytest.raises(webhooks.Refused, match="not a valid host name"):
        asyncio.run(webhooks.vet("http://a..b/hook", ()))
    where, addresses = asyncio.run(webhooks.vet("http://localhost:8080/hook?x=1", webhooks.parse_allow_nets(
        "127.0.0.0/8,::1/128")))
    assert addresses and all(a.is_loopback for a in addresses)
    assert where.url_for(ipaddress.ip_address("::1")) == "http://[::1]:8080/hook?x=1"
    assert where.host_header == "localhost:8080" and where.receiver == "http://localhost:8080"
    assert webhooks.target("https://h.example/").host_header == "h.example"


def test_signature_verifies_and_tampering_or_replay_does_not() -> None:
    body = b'{"type":"job.succeeded"}'
    now = int(time.time())
    header = webhooks.signature("whsec_x", now, body)
    assert header.startswith(f"t={now},v1=")
    assert webhooks.verify("whsec_x", header, body)
    assert not webhooks.verify("whsec_y", header, body)
    assert not webhooks.verify("whsec_x", header, body.replace(b"succeeded", b"failed"))
    assert not webhooks.verify("whsec_x", header, body, now=now + webhooks.TOLERANCE_SECONDS + 1)  # a replay
    forged = webhooks.signature("whsec_x", now - 1000, body).replace(f"t={now - 1000}", f"t={now}")
    assert not webhooks.verify("whsec_x", forged, body)  # the timestamp is signed too
    assert not webhooks.verify("whsec_x", "garbage", body)


def test_the_readme_snippet_verifies_as_the_service_signs() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "webhooks.md").read_text()
    snippet = page.split("To verify, in Python:\n\n```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, Any] = {}
    exec(compile(snippet, "docs/webhooks.md", "exec"), scope)  # noqa: S102 (the page's own code, run as a reader would)
    body = b'{"type":"job.running"}'
    header = webhooks.signature("whsec_readme", int(time.time()), body)
    assert scope["verify"]("whsec_readme", header, body)
    assert not scope["verify"]("whsec_readme", header, body + b" ")
    assert not scope["verify"]("whsec_other", header, body)
    old = webhooks.signature("whsec_readme", int(time.time()) - 301, body)
    assert not scope["verify"]("whsec_readme", old, body)


def certificates(where: Path) -> tuple[Path, Path, Path]:
    """A CA of the test's own and a certificate it signed for `localhost` (CA, certificate, key)."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True, timeout=60)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1", "-subj", "/CN=ft test CA")
    openssl("req", *ec, "-keyout", "leaf.key", "-out", "leaf.csr", "-subj", "/CN=localhost")
    (where / "san.ext").write_text("subjectAltName=DNS:localhost\n")
    openssl("x509", "-req", "-in", "leaf.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "leaf.pem", "-days", "1", "-extfile", "san.ext")
    return where / "ca.pem", where / "leaf.pem", where / "leaf.key"


def test_https_goes_to_the_checked_address_named_in_sni_and_verified(tmp_path: Path) -> None:
    ca, cert, key = certificates(tmp_path)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    receiver = start_receiver(tls)
    try:
        # Every address localhost resolves to is checked (and allowed here); the one listening is reached.
        allow = "127.0.0.1/32,::1/128"

        def send(url: str, ca_file: str = str(ca), nets: str = allow) -> tuple[int | None, str | None]:
            deliverer = Deliverer(ControlPlaneSettings(webhook_allow_nets=nets, webhook_ca_file=ca_file))
            sealed = deliverer.keys.seal("whsec_tls", context=secretbox.webhook_context("tls-owner"))
            row = Claimed(id="whd_tls", url=url, receiver="", event="job.running", body=b'{"type":"job.running"}',
                          attempts=1, owner="tls-owner", secret=sealed)

            async def go() -> tuple[int | None, str | None]:
                async with deliverer.client() as client:
                    return await deliverer._send(client, row)

            return asyncio.run(go())

        assert send(f"https://localhost:{receiver.port}/ok") == (200, None)
        [got] = receiver.got
        assert receiver.sni == ["localhost"]  # the name went in TLS although the connection went to an address
        assert got.headers["Host"] == f"localhost:{receiver.port}"
        assert webhooks.verify("whsec_tls", got.headers["X-FT-Signature"], got.body)
        # Without the CA the certificate is not trusted; by address it does not match the name: both refused.
        code, error = send(f"https://localhost:{receiver.port}/ok", ca_file="")
        assert code is None and error and "CERTIFICATE_VERIFY_FAILED" in error, error
        code, error = send(f"https://127.0.0.1:{receiver.port}/ok")
        assert code is None and error and "CERTIFICATE_VERIFY_FAILED" in error, error
        # The same receiver without the allow-list: refused before any connection.
        code, error = send(f"https://localhost:{receiver.port}/ok", nets="10.0.0.0/8")
        assert code is None and error and error.startswith("refused: ") and "loopback" in error, error
        assert len(receiver.got) == 1
    finally:
        receiver.server.shutdown()


def test_backoff_doubles_with_jitter_up_to_its_cap() -> None:
    s = ControlPlaneSettings(webhook_backoff_seconds=1.0, webhook_backoff_max_seconds=8.0)
    for attempts, ceiling in ((1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)):
        waits = [backoff(attempts, s) for _ in range(200)]
        assert all(ceiling / 2 <= w <= ceiling for w in waits)
        assert max(waits) - min(waits) > ceiling / 10  # jittered, not one fixed pause


def test_which_job_events_are_announced() -> None:
    job = Job(id="job_x", status="running", attempt=1, request={}, owner="o")
    assert event_type(job, "state", {"status": "running"}) == "job.running"
    assert event_type(job, "checkpoint", {"step": 4, "committed": True}) == "job.checkpoint"
    assert event_type(job, "checkpoint", {"step": 4, "committed": False}) is None
    assert event_type(job, "progress", {"step": 4}) is None
    assert event_type(job, "state", {"status": "starting"}) is None
    job.status = "queued"
    assert event_type(job, "state", {"status": "queued", "previous_attempt": 1}) == "job.requeued"
    job.status = "failed"
    assert event_type(job, "state", {"status": "failed"}) == "job.failed"
    assert event_type(job, "state", {"status": "succeeded", "ignored": "the job had already ended"}) is None
    assert event_type(job, "checkpoint", {"step": 8, "committed": True}) is None  # after the end


# -- against the stack ---------------------------------------------------------------------------------------

def test_a_job_run_to_success_delivers_signed_events_in_order(api: httpx.Client, make_job: Callable[..., Any],
                                                               rx: Receiver, secret: str) -> None:
    # One CPU process and eight steps: the cheapest run that commits checkpoints and succeeds.
    body = make_job(name="webhook-run", notifications={"webhook_url": f"{rx.url}/ok"},
                    hyperparameters={"max_steps": 8}, checkpointing={"every_steps": 4, "keep_last": 2},
                    resources={"num_gpus": 1})
    body["data"].pop("validation")
    r = api.post("/jobs", json=body)
    assert r.status_code == 201, r.text
    job_id = r.json()["id"]
    assert r.json()["request"]["notifications"]["webhook_url"] == f"{rx.url}/ok"
    wait_status(api, job_id, {"succeeded", "failed", "cancelled"}, 240)
    assert api.get(f"/jobs/{job_id}").json()["status"] == "succeeded"
    done = wait_for(lambda: settled(api, job_id, 4), 30, "the job's deliveries to settle")
    assert [d["status"] for d in done] == ["delivered"] * len(done), done
    assert all(d["attempts"] == 1 and d["last_status_code"] == 200 for d in done), done

    got = [g for g in rx.at("/ok") if json.loads(g.body)["job"]["id"] == job_id]
    types = [json.loads(g.body)["type"] for g in got]
    assert types[0] == "job.running" and types[-1] == "job.succeeded", types
    assert types[1:-1] and set(types[1:-1]) == {"job.checkpoint"}, types
    steps = [json.loads(g.body)["data"]["step"] for g in got[1:-1]]
    assert steps == sorted(steps) and 4 in steps, steps
    assert [d["event"] for d in done] == types  # what the job shows is what arrived, in event order
    for g, d in zip(got, done, strict=True):
        payload = json.loads(g.body)
        assert g.headers["X-FT-Event"] == payload["type"] == d["event"]
        assert g.headers["X-FT-Delivery"] == payload["id"] == d["id"]
        assert g.headers["Content-Type"] == "application/json"
        header = g.headers["X-FT-Signature"]
        assert webhooks.verify(secret, header, g.body)
        assert not webhooks.verify(secret, header, g.body.replace(b"job.", b"jab."))  # tampered
        stamp = int(header.split(",")[0].removeprefix("t="))
        assert not webhooks.verify(secret, header, g.body, now=stamp + 301)  # replayed 5 minutes later
    assert json.loads(got[-1].body)["data"]["output"]  # the succeeded event says where the model is


def test_a_failing_receiver_is_retried_with_backoff(api: httpx.Client, make_job: Callable[..., Any], rx: Receiver,
                                                    secret: str) -> None:
    job_id = parked(api, make_job, f"{rx.url}/flaky")
    assert api.post(f"/jobs/{job_id}/cancel").json()["status"] == "cancelled"
    [done] = wait_for(lambda: settled(api, job_id, 1), 30, "the flaky delivery to settle")
    assert done["status"] == "delivered" and done["attempts"] == 3 and done["last_status_code"] == 200, done
    assert done["event"] == "job.cancelled" and done["next_attempt_at"] is None and done["last_error"] is None
    tries = [g for g in rx.at("/flaky") if g.headers["X-FT-Delivery"] == done["id"]]
    assert len(tries) == 3
    gaps = [b.at - a.at for a, b in zip(tries, tries[1:], strict=False)]
    # FT_WEBHOOK_BACKOFF_SECONDS 1: the first pause is 0.5-1 s, the second 1-2 s (plus a poll of up to 1 s).
    assert 0.5 <= gaps[0] <= 2.5 and 1.0 <= gaps[1] <= 3.5, gaps
    assert len({g.headers["X-FT-Signature"] for g in tries}) >= 2  # each try is signed afresh, with its own time
    assert all(webhooks.verify(secret, g.headers["X-FT-Signature"], g.body) for g in tries)


def test_a_hanging_receiver_delays_neither_reads_nor_other_receivers(api: httpx.Client, make_job: Callable[..., Any],
                                                                     rx: Receiver, hanging: Receiver,
                                                                     secret: str) -> None:
    slow = parked(api, make_job, f"{hanging.url}/hang")
    other = parked(api, make_job, f"{rx.url}/ok")
    api.post(f"/jobs/{slow}/cancel")
    wait_for(lambda: hanging.at("/hang"), 15, "the hanging receiver to be called")
    started = time.monotonic()
    api.post(f"/jobs/{other}/cancel")
    wait_for(lambda: [g for g in rx.at("/ok") if json.loads(g.body)["job"]["id"] == other], 5,
             "the other receiver's delivery while one hangs")
    other_took = time.monotonic() - started
    reads = []
    for _ in range(5):
        t0 = time.monotonic()
        assert api.get(f"/jobs/{slow}").status_code == 200
        reads.append(time.monotonic() - t0)
    [pending] = deliveries(api, slow)
    assert pending["status"] == "pending" and pending["attempts"] == 1 and pending["last_error"] is None
    assert other_took < 3.0, other_took
    assert max(reads) < 0.5, reads
    # The deadline (FT_WEBHOOK_TIMEOUT_SECONDS, 5 s) ends the hung attempt; it is retried later.
    timed_out = wait_for(lambda: (d := deliveries(api, slow)[0])["last_error"] and d, 15, "the attempt's deadline")
    assert timed_out["status"] == "pending" and "no answer within 5 s" in timed_out["last_error"], timed_out
    assert timed_out["next_attempt_at"] is not None and timed_out["last_status_code"] is None
    hanging.release.set()


def test_owner_default_url_and_the_delivery_time_check(api: httpx.Client, make_job: Callable[..., Any],
                                                       rx: Receiver, secret: str, stack_env: dict[str, str]) -> None:
    r = api.put("/owners/default/webhook", json={"url": f"{rx.url}/ok"})
    assert r.status_code == 200 and r.json()["url"] == f"{rx.url}/ok" and r.json()["secret"] is None, r.text
    database = stack_env["FT_DATABASE_URL"].replace("+psycopg", "")
    try:
        job_id = parked(api, make_job, None)
        api.post(f"/jobs/{job_id}/cancel")
        [done] = wait_for(lambda: settled(api, job_id, 1), 15, "the default URL's delivery")
        assert done["status"] == "delivered" and done["url"] == f"{rx.url}/ok", done
        got = [g for g in rx.at("/ok") if json.loads(g.body)["job"]["id"] == job_id]
        assert len(got) == 1 and webhooks.verify(secret, got[0].headers["X-FT-Signature"], got[0].body)
        # A default written around the API to an internal address (or a name that now resolves to one): the
        # deliverer checks again before it connects, and refuses.
        with psycopg.connect(database, autocommit=True) as conn:
            conn.execute("UPDATE webhook_owners SET url = 'http://169.254.169.254/latest' WHERE owner = 'default'")
        job_id = parked(api, make_job, None)
        api.post(f"/jobs/{job_id}/cancel")
        refused = wait_for(lambda: (d := deliveries(api, job_id)) and d[0]["last_error"] and d[0], 15,
                           "the refused delivery")
        assert refused["last_error"].startswith("refused: ") and "link-local" in refused["last_error"], refused
        assert refused["last_status_code"] is None
    finally:
        assert api.put("/owners/default/webhook", json={"url": None}).status_code == 200


def test_the_allow_list_lets_only_its_range_through(api: httpx.Client, make_job: Callable[..., Any],
                                                    secret: str) -> None:
    # The stack allows 127.0.0.1/32 only: 127.0.0.2 and the metadata address stay refused.
    for url in ("http://127.0.0.2:9/", "http://169.254.169.254/"):
        r = api.post("/jobs", json=make_job(resources={"queue": PARKED}, notifications={"webhook_url": url}))
        assert r.status_code == 422 and r.json()["error"]["field"] == "notifications.webhook_url", r.text


def test_a_team_key_manages_only_its_own_owners_webhook(stack_env: dict[str, str], stack: Any, secret: str,
                                                      api: httpx.Client, make_job: Callable[..., Any]) -> None:
    key = fixed_key("team")
    add_key(stack_env["FT_DATABASE_URL"], key, owner="webhook-team", scopes=("jobs:write",))
    job_id = parked(api, make_job, None)  # owner default's
    with httpx.Client(base_url=stack.api_url, timeout=30, headers={"Authorization": f"Bearer {key}"}) as team:
        made = team.put("/owners/webhook-team/webhook", json={"url": None})
        assert made.status_code == 200 and made.json()["secret"].startswith("whsec_"), made.text
        assert made.json()["secret"] != secret  # a secret per owner
        assert team.get("/owners/webhook-team/webhook").json()["secret"] is None
        for r in (team.put("/owners/default/webhook", json={"url": None}), team.get("/owners/default/webhook")):
            assert r.status_code == 403 and r.json()["error"]["field"] == "owner", r.text
        assert team.get(f"/jobs/{job_id}/deliveries").status_code == 404  # another owner's job
    api.post(f"/jobs/{job_id}/cancel")


@pytest.fixture(scope="module")
def bare_api(stack: Any, stack_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiProcess]:
    """A second API process on the stack's database, without the allow-list; its callers act for an owner of
    their own, which has no webhook secret yet."""
    proc = ApiProcess({**stack_env, "FT_WEBHOOK_ALLOW_NETS": ""}, tmp_path_factory.mktemp("webhooks-bare") / "api.log")
    add_key(stack_env["FT_DATABASE_URL"], BARE_KEY, owner="ssrf-owner", scopes=("jobs:write",))
    try:
        yield proc.start()
    finally:
        proc.stop()


BARE_KEY = fixed_key("ssrf")


INTERNAL = [("http://127.0.0.1:8080/hook", "loopback"), ("http://localhost/hook", "loopback"),
            ("http://169.254.169.254/latest/meta-data/", "link-local"), ("http://10.0.0.7/hook", "private"),
            ("http://[::1]:8080/hook", "loopback"), ("http://[::ffff:127.0.0.1]/hook", "loopback"),
            ("https://0.0.0.0/", "unspecified")]


def test_internal_urls_are_refused_at_submit_without_the_allow_list(bare_api: ApiProcess,
                                                                    make_job: Callable[..., Any]) -> None:
    job = make_job(resources={"queue": PARKED})
    with httpx.Client(base_url=bare_api.url, timeout=30, headers={"Authorization": f"Bearer {BARE_KEY}"}) as c:
        r = c.post("/jobs", json={**job, "notifications": {"webhook_url": "http://127.0.0.1/hook"}})
        assert r.status_code == 422 and "no webhook secret" in r.json()["error"]["message"], r.text
        assert c.put("/owners/ssrf-owner/webhook", json={}).json()["secret"].startswith("whsec_")
        for url, why in INTERNAL:
            for path in ("/jobs", "/jobs?dry_run=true"):
                r = c.post(path, json={**job, "notifications": {"webhook_url": url}})
                error = r.json()["error"]
                assert r.status_code == 422 and error["field"] == "notifications.webhook_url", (url, r.text)
                assert why in error["message"] and "FT_WEBHOOK_ALLOW_NETS" in error["message"], (url, error)
            r = c.put("/owners/ssrf-owner/webhook", json={"url": url})
            assert r.status_code == 422 and r.json()["error"]["field"] == "url", r.text
        r = c.post("/jobs", json={**job, "notifications": {"webhook_url": "gopher://example.com/"}})
        assert r.status_code == 422 and r.json()["error"]["field"] == "notifications.webhook_url", r.text
        assert c.get("/jobs").json()["data"] == []  # nothing was created
