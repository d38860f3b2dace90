"""A real S3-protocol server for the tests: moto's standalone server, started on this machine on a free port.

The service speaks to it as to any S3-compatible store (FT_STORE_URL=s3://..., FT_S3_ENDPOINT_URL); nothing in
the service knows it is moto.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Mapping
from pathlib import Path

import httpx

from contract.storage import StoreConfig
from core.settings import SharedSettings
from tests.helpers import free_port, wait_for

# Any credentials: the server accepts all; the service reads them from the standard variables.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "tests", "AWS_SECRET_ACCESS_KEY": "tests-secret", "AWS_REGION": "us-east-1"}


class S3Server:
    def __init__(self, log_dir: Path, host: str = "127.0.0.1", port: int | None = None) -> None:
        # A port given: the server comes back where its clients knew it (an outage test restarts it).
        self.host, self.port = host, port or free_port()
        self.endpoint = f"http://{host}:{self.port}"
        self.log_path = log_dir / f"s3-{self.port}.log"
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", host, "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **CREDENTIALS})
        wait_for(self._up, 60, f"the S3 server on {self.endpoint}")

    def start_again(self, buckets: list[str]) -> None:
        """After `stop`: a new server on the same address, with these (empty) buckets; the old one kept nothing."""
        self._log = self._log if not self._log.closed else (self.log_path).open("ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", self.host, "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **CREDENTIALS})
        wait_for(self._up, 60, f"the S3 server on {self.endpoint}")
        for name in buckets:
            assert httpx.put(f"{self.endpoint}/{name}", timeout=10).status_code == 200

    def _up(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the S3 server exited with {self.proc.returncode}")
        try:
            return httpx.get(self.endpoint, timeout=2).status_code < 500
        except httpx.HTTPError:
            return False

    def bucket(self, name: str | None = None) -> str:
        """A new, empty bucket (named `name`: one a restarted server, which keeps nothing, had before)."""
        name = name or f"ft-{uuid.uuid4().hex[:12]}"
        answer = httpx.put(f"{self.endpoint}/{name}", timeout=10)
        assert answer.status_code == 200, answer.text
        return name

    def env(self, bucket: str, prefix: str = "service") -> dict[str, str]:
        """What a process of the service needs to use `bucket` as its store."""
        return {"FT_STORE_URL": f"s3://{bucket}/{prefix}", "FT_S3_ENDPOINT_URL": self.endpoint, **CREDENTIALS}

    def config(self, bucket: str, prefix: str = "service") -> StoreConfig:
        """The config of `bucket`'s store, as a process given `env(bucket, prefix)` builds it."""
        return store_config(self.env(bucket, prefix))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def store_config(env: Mapping[str, str]) -> StoreConfig:
    """The store config a process of the service builds from `env`'s store settings (core/settings.py)."""
    return SharedSettings(store_url=env["FT_STORE_URL"], s3_endpoint_url=env.get("FT_S3_ENDPOINT_URL"),
                          store_options=env.get("FT_STORE_OPTIONS", "")).store_config()
