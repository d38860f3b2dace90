"""The artifact store's backends, by URL scheme: one module each (`file.py`, `s3.py`), each a `Backend`
(base.py: its URL's form, the options it takes, and `build`, the client of a config). A new one (gs://, say) is
its module and its line in BACKENDS; FT_STORE_URL accepts its scheme from then on (core/settings.py)."""

from __future__ import annotations

from urllib.parse import urlparse

from contract.storage import StoreConfig
from store.backends import file, s3
from store.backends.base import Backend, BadConfig, Opened

BACKENDS: dict[str, Backend] = {
    "file": file,
    "s3": s3,
}

__all__ = ["BACKENDS", "Backend", "BadConfig", "Opened", "backend_for", "forms", "option_problem"]


def forms() -> str:
    """Every form a store's URL may take, for messages: `file://<folder> or s3://<bucket>/<prefix>`."""
    return " or ".join(backend.FORM for backend in BACKENDS.values())


def option_problem(backend: Backend, scheme: str, options: dict[str, str]) -> str | None:
    """What is wrong with `options` for the backend, or None: a misspelt option must not be silently ignored."""
    unknown = sorted(set(options) - backend.OPTIONS)
    if not unknown:
        return None
    takes = ", ".join(sorted(backend.OPTIONS)) or "none"
    return f"the {scheme}:// store takes no option {', '.join(map(repr, unknown))} (its options: {takes})"


def backend_for(config: StoreConfig) -> Backend:
    """The backend of the config's URL scheme, its options checked; BadConfig otherwise."""
    scheme = urlparse(config.url).scheme
    backend = BACKENDS.get(scheme)
    if backend is None:
        raise BadConfig(f"{config.url!r}: the store is {forms()}")
    if problem := option_problem(backend, scheme, config.options):
        raise BadConfig(problem)
    return backend
