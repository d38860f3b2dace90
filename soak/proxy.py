"""A fault-injecting TCP proxy in front of each service a process talks to: the nemesis's network.

Network namespaces with iptables would fault the kernel's own paths, but they need root and a host set up for them;
a proxy per link works anywhere and faults exactly one link (one worker's Redis, say) while its neighbours go on.
Modes: `pass`; `delay` (each chunk held `delay` seconds: a slow or distant link); `drop` (nothing flows either way
and new connections hang: a partition that drops packets, where only timeouts notice); `cut` (every connection is
reset and new ones are closed at once: a link that refuses).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from concurrent.futures import Future
from typing import Any

MODES = ("pass", "delay", "drop", "cut")
CHUNK = 64 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class FaultProxy:
    def __init__(self, name: str, upstream_port: int, upstream_host: str = "127.0.0.1") -> None:
        self.name = name
        self.upstream = (upstream_host, upstream_port)
        self.port = free_port()
        self.mode = "pass"
        self.delay = 0.0
        self.connections = 0
        self._open: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self._cut_all()

    def set(self, mode: str, delay: float = 0.0) -> None:
        """Called on the proxy's loop (ProxyHub.set)."""
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {MODES}")
        self.mode, self.delay = mode, delay
        if mode == "cut":
            self._cut_all()

    def _cut_all(self) -> None:
        for writer in list(self._open):
            with contextlib.suppress(Exception):
                # An abort, not a close: the peer sees a reset, as from a host that went away.
                writer.transport.abort()
        self._open.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while self.mode == "drop":
            await asyncio.sleep(0.05)
        if self.mode == "cut":
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        self._open |= {writer, up_writer}
        try:
            await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        finally:
            self._open -= {writer, up_writer}
            for w in (writer, up_writer):
                with contextlib.suppress(Exception):
                    w.close()

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(CHUNK):
                while self.mode == "drop":
                    await asyncio.sleep(0.05)
                if self.mode == "delay":
                    await asyncio.sleep(self.delay)
                if self.mode == "cut" or writer.is_closing():
                    break
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof() and not writer.is_closing():
                writer.write_eof()
        except (OSError, RuntimeError):
            pass
        finally:
            if self.mode == "cut":
                writer.transport.abort()


class ProxyHub:
    """Every proxy of a run on one event loop in a thread of its own, so a busy workload never slows the links."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.proxies: dict[str, FaultProxy] = {}
        self._thread = threading.Thread(target=self.loop.run_forever, name="soak-proxies", daemon=True)
        self._thread.start()

    def _call(self, coro: Any) -> Any:
        done: Future[Any] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        return done.result(30)

    def add(self, name: str, upstream_port: int) -> FaultProxy:
        proxy = FaultProxy(name, upstream_port)
        self._call(proxy.start())
        self.proxies[name] = proxy
        return proxy

    def set(self, name: str, mode: str, delay: float = 0.0) -> None:
        proxy = self.proxies[name]

        async def apply() -> None:
            proxy.set(mode, delay)

        self._call(apply())

    def close(self) -> None:
        for proxy in self.proxies.values():
            with contextlib.suppress(Exception):
                self._call(proxy.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)
