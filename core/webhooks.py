"""Webhooks, the parts without a database: which receivers may be called (SSRF rules), how a delivery is
signed and verified, and what each job event is called.

A job's URL is the caller's input, and the control plane calls it from inside the network: without rules
it could reach the cloud metadata service (169.254.169.254), Postgres, Redis or any internal admin page.
So every address the URL's host resolves to must be a public unicast address, unless the operator's
allow-list (`FT_WEBHOOK_ALLOW_NETS`) names it. The check runs at submit and again at every delivery,
and the delivery connects to the very address it checked: a name that resolved to a public address at
submit and to 127.0.0.1 later (DNS rebinding) is refused then too.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import secrets
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from contract.codes import WebhookEvent
from contract.spec import text_problem

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SIGNATURE_HEADER = "X-FT-Signature"
EVENT_HEADER = "X-FT-Event"
DELIVERY_HEADER = "X-FT-Delivery"
TOLERANCE_SECONDS = 300  # what receivers are told to accept; older signatures are replays
SECRET_PREFIX = "whsec_"
SHOWN_PREFIX = 10  # "whsec_" and 4 characters: tells an owner's secrets apart, 24 of its 256 bits
RESOLVE_TIMEOUT_SECONDS = 3.0
MAX_URL_CHARS = 2048

# Job events a receiver is told about: a state the job row reached, a requeue, a committed checkpoint.
EVENT_TYPES = tuple(e.value for e in WebhookEvent)


class Refused(ValueError):
    """A URL or address the service will not call; the message says why and what would be accepted."""


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)


def parse_allow_nets(text: str) -> tuple[IPNetwork, ...]:
    """`FT_WEBHOOK_ALLOW_NETS`: comma-separated CIDRs (a bare address is one host)."""
    nets = []
    for part in (p.strip() for p in text.split(",")):
        if part:
            try:
                nets.append(ipaddress.ip_network(part, strict=False))
            except ValueError as exc:
                raise ValueError(f"{part!r} is not a CIDR such as 10.0.0.0/8 or fd00::/8 ({exc})") from None
    return tuple(nets)


def _plain(address: IPAddress) -> IPAddress:
    """An IPv4-mapped (::ffff:a.b.c.d) or IPv4-compatible-by-NAT64-translation address is judged as the IPv4
    address it reaches: ::ffff:127.0.0.1 is loopback, whatever the IPv6 tables say."""
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return address.ipv4_mapped
        if address in ipaddress.IPv6Network("64:ff9b::/96"):  # NAT64: the last 32 bits are the IPv4 target
            return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address


def blocked(address: IPAddress) -> str | None:
    """Why the service must not call this address (its range), or None for a public unicast address."""
    ip = _plain(address)
    for name, test in (("unspecified", ip.is_unspecified), ("loopback", ip.is_loopback),
                       ("link-local", ip.is_link_local), ("multicast", ip.is_multicast),
                       ("private", ip.is_private), ("reserved", ip.is_reserved),
                       ("not globally routable", not ip.is_global)):
        if test:
            return name
    return None


def allowed(address: IPAddress, allow: Sequence[IPNetwork]) -> str | None:
    """None when the address may be called; else why not, naming the setting that would permit it."""
    reason = blocked(address)
    if reason is None:
        return None
    ip = _plain(address)
    if any(ip.version == net.version and ip in net for net in allow) or \
            any(address.version == net.version and address in net for net in allow):
        return None
    return (f"{address} is a {reason} address; the service calls only public addresses unless the operator "
            "allows a range with FT_WEBHOOK_ALLOW_NETS")


@dataclass(frozen=True)
class Target:
    """A receiver URL taken apart: where to connect and what to name in Host and TLS."""

    url: str
    scheme: str
    host: str  # without brackets
    port: int
    path: str  # path and query, at least "/"

    @property
    def receiver(self) -> str:
        """The unit of the per-receiver bound: one slow receiver holds only its own slots."""
        return f"{self.scheme}://{self.host}:{self.port}"

    @property
    def host_header(self) -> str:
        name = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return name if self.port == default else f"{name}:{self.port}"

    def url_for(self, address: IPAddress) -> str:
        """The URL with the checked address in place of the name: the connection goes where the check looked."""
        where = f"[{address}]" if address.version == 6 else str(address)
        return f"{self.scheme}://{where}:{self.port}{self.path}"


def syntax_problem(url: str) -> str | None:
    """Why `url` is not a webhook URL at all (before any look-up), or None."""
    if len(url) > MAX_URL_CHARS:
        return f"is longer than {MAX_URL_CHARS} characters"
    if any(c.isspace() or ord(c) < 0x20 or ord(c) == 0x7F for c in url):
        return "contains whitespace or control characters"
    stored = text_problem(url)
    if stored:
        return stored
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"is not a URL ({exc})"
    if parts.scheme not in ("http", "https"):
        return f"must be an http:// or https:// URL (got scheme {parts.scheme or 'none'!r})"
    if not parts.hostname:
        return "names no host; give a URL such as https://hooks.example.com/ft"
    if port == 0:
        return "names port 0"
    if parts.fragment:
        return "has a #fragment, which is never sent; remove it"
    return None


def target(url: str) -> Target:
    problem = syntax_problem(url)
    if problem:
        raise Refused(problem)
    parts = urlsplit(url)
    host = (parts.hostname or "").rstrip(".")
    port = parts.port or (443 if parts.scheme == "https" else 80)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return Target(url=url, scheme=parts.scheme, host=host, port=port, path=path)


async def resolve(where: Target, timeout: float = RESOLVE_TIMEOUT_SECONDS) -> list[IPAddress]:
    """Every address the host resolves to (a literal address is itself), through the system resolver."""
    try:
        return [ipaddress.ip_address(where.host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(where.host, where.port, type=socket.SOCK_STREAM), timeout)
    except asyncio.TimeoutError:
        raise Refused(f"host {where.host!r} did not resolve within {timeout:g} s") from None
    except OSError as exc:
        raise Refused(f"host {where.host!r} does not resolve ({exc.strerror or exc})") from None
    except ValueError as exc:  # UnicodeError included: a name IDNA cannot encode, an empty label
        raise Refused(f"host {where.host!r} is not a valid host name ({exc})") from None
    found: list[IPAddress] = []
    for info in infos:
        address = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        if address not in found:
            found.append(address)
    if not found:
        raise Refused(f"host {where.host!r} resolves to no address")
    return found


async def vet(url: str, allow: Sequence[IPNetwork]) -> tuple[Target, list[IPAddress]]:
    """The URL's target and its addresses, every one of them callable; else Refused. One blocked address is
    enough to refuse: the resolver's order is not ours, and a name may mix a public and an internal one."""
    where = target(url)
    addresses = await resolve(where)
    for address in addresses:
        reason = allowed(address, allow)
        if reason:
            raise Refused(f"host {where.host!r} resolves to {reason}" if address != _literal(where.host)
                          else reason)
    return where, addresses


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The X-FT-Signature value: HMAC-SHA256 with the owner's secret over `timestamp + "." + body`."""
    mac = hmac.new(secret.encode(), str(timestamp).encode() + b"." + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(secret: str, header: str, body: bytes, *, tolerance: float = TOLERANCE_SECONDS,
           now: float | None = None) -> bool:
    """What a receiver does (docs/webhooks.md shows the same in a few lines): the signature matches this body and
    secret, and its timestamp is recent, so a captured delivery cannot be replayed later."""
    try:
        fields = dict(part.split("=", 1) for part in header.split(","))
        timestamp = int(fields["t"])
        given = fields["v1"]
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - timestamp) > tolerance:
        return False
    expected = signature(secret, timestamp, body).split("v1=", 1)[1]
    return hmac.compare_digest(expected, given)
