"""`s3://<bucket>/<prefix>`: AWS S3 or any S3-compatible server (MinIO, Ceph RGW). Option `endpoint`: the server's
URL (FT_S3_ENDPOINT_URL), unset for AWS itself. Credentials and region come from the standard AWS_* variables."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlparse

from obstore.store import S3Store

from contract.storage import StoreConfig
from store.backends.base import BadConfig, Opened

FORM = "s3://<bucket>/<prefix>"
OPTIONS = frozenset({"endpoint"})


def build(config: StoreConfig) -> Opened:
    parsed = urlparse(config.url)
    if not parsed.netloc:
        raise BadConfig(f"{config.url!r} names no bucket: {FORM}")
    endpoint = config.options.get("endpoint")
    settings: dict[str, Any] = {"endpoint": endpoint} if endpoint else {}
    # A server on the local network (MinIO in the compose file, moto in the tests) may speak plain HTTP.
    client = {"allow_http": True} if endpoint and endpoint.startswith("http://") else None
    store = S3Store(parsed.netloc, prefix=parsed.path.strip("/") or None, client_options=client, **settings)
    return Opened(store, url=config.url, where=config.url)
