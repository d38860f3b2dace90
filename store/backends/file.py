"""`file://<folder>`: a folder on this machine (one host, or a folder every node mounts). A relative folder is
resolved against the process's working directory once, here, so the config another process is given names it
absolutely."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlparse

from obstore.store import LocalStore

from contract.storage import StoreConfig
from store.backends.base import Opened

FORM = "file://<folder>"
OPTIONS: frozenset[str] = frozenset()


def build(config: StoreConfig) -> Opened:
    parsed = urlparse(config.url)
    root = Path(parsed.netloc + parsed.path).resolve()
    # Reads open the file itself: obstore's streamed local reads are several times slower than a plain read, and a
    # download is bounded by hashing anyway.
    return Opened(LocalStore(root, mkdir=True), url=f"file://{root}", where=str(root), root=root)
