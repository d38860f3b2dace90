"""What a backend gives the store's client (store/objects.py `Store`) for one config, and the error of a config it
cannot open."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from obstore.store import ObjectStore

from contract.storage import StoreConfig


class BadConfig(ValueError):
    """A store config that names no backend, or one that the backend cannot open; nothing was contacted."""


@dataclass(frozen=True)
class Opened:
    store: ObjectStore
    url: str  # the URL another process names this store by from any folder (a relative folder resolved)
    where: str  # where it is, for messages: a folder, a bucket's URL
    # A folder whose files reads may open directly rather than stream through the client; None: every read streams.
    root: Path | None = None


class Backend(Protocol):
    """One module per backend (store/backends/file.py, s3.py) is one of these."""

    FORM: str  # its URL as a message shows it: "s3://<bucket>/<prefix>"
    OPTIONS: frozenset[str]  # the options it takes; any other is refused

    def build(self, config: StoreConfig) -> Opened:
        """The client of the store `config` names, contacting nothing yet; BadConfig where the URL is unusable."""
        ...
