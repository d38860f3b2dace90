"""Secrets the service must read back (owners' webhook signing secrets), sealed at rest with AES-256-GCM.

An API key is stored as a hash because the service only ever compares it; a webhook secret cannot be, since
every delivery computes an HMAC with it. So it is encrypted with a key Postgres never sees: whoever reads the
table (a backup, a replica, a leaked dump) learns nothing of it without `FT_SECRETS_KEY` too.

`FT_SECRETS_KEY` is a comma-separated list of keys, each 32 random bytes in URL-safe base64
(`python -m api.admin.secrets new-key` prints one). The first seals; all of them open. A sealed value is
`v1:<key id>:<base64 of nonce and ciphertext>`: the key id (a digest of the key, not the key) says which key
sealed it, so a value no configured key opens is named as such instead of failing as "corrupt". The
associated data binds a value to its row (the owner), so a sealed secret copied onto another owner's row
does not open.

Rotation: put the new key first and keep the old one after it, restart, run `python -m api.admin.secrets rotate`
(re-seals every stored secret under the first key), then drop the old key and restart again.

In development (FT_ENV=development) an unset key means a fixed development key, with a warning: the tests and
`make demo` run without configuring anything, and data sealed with it stays readable across `make clean`.
Anywhere else an unset or malformed key stops the API and the control plane at start (core/settings.py).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import logging
import os
from collections.abc import Sequence
from functools import lru_cache
from typing import Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import SecretStr

log = logging.getLogger(__name__)

SETTING = "FT_SECRETS_KEY"
VERSION = "v1"
KEY_BYTES = 32
NONCE_BYTES = 12
# Public on purpose, so it never encrypts outside development (check_setting).
DEVELOPMENT_KEY = "ZnQtZGV2ZWxvcG1lbnQtc2VjcmV0cy1rZXktMzJieXQ="


class KeyProblem(ValueError):
    """FT_SECRETS_KEY is not a list of keys the service can use; the message says what to set."""


class Unreadable(Exception):
    """A stored value none of the configured keys opens (sealed under a key that was dropped, or altered)."""


def new_key() -> str:
    return base64.urlsafe_b64encode(os.urandom(KEY_BYTES)).decode()


def key_id(key: bytes) -> str:
    """Eight hex digits naming a key in stored values and messages without revealing it."""
    return hashlib.sha256(b"ft-secrets-key-id:" + key).hexdigest()[:8]


def parse_keys(text: str) -> list[bytes]:
    """The keys of a FT_SECRETS_KEY value, first the one that seals; KeyProblem naming the setting otherwise."""
    keys: list[bytes] = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            key = base64.urlsafe_b64decode(part + "=" * (-len(part) % 4))
        except (binascii.Error, ValueError):
            key = b""
        if len(key) != KEY_BYTES:
            raise KeyProblem(f"{SETTING}: key {i + 1} of the list is not {KEY_BYTES} bytes in URL-safe base64; "
                             "make one with `python -m api.admin.secrets new-key`")
        keys.append(key)
    if not keys:
        raise KeyProblem(f"{SETTING} is not set; outside development (FT_ENV=development) the service needs it to "
                         "encrypt webhook secrets. Make one with `python -m api.admin.secrets new-key`")
    return keys


def check_setting(text: str, *, development: bool) -> None:
    """KeyProblem unless FT_SECRETS_KEY is usable here: unset only in development, never the development key
    first outside it (it may follow, to read a development database's secrets while they are re-encrypted)."""
    if not text.strip() and development:
        return
    keys = parse_keys(text)
    if not development and keys[0] == parse_keys(DEVELOPMENT_KEY)[0]:
        raise KeyProblem(f"{SETTING}: its first key is the public development key, which encrypts nothing outside "
                         "development; put a key of your own first (`python -m api.admin.secrets new-key`)")


class Keyring:
    def __init__(self, keys: Sequence[bytes]) -> None:
        self._ciphers = {key_id(k): AESGCM(k) for k in keys}
        self.sealing_id = key_id(keys[0])

    @property
    def ids(self) -> list[str]:
        return list(self._ciphers)

    def seal(self, plain: str, *, context: str) -> str:
        nonce = os.urandom(NONCE_BYTES)
        sealed = self._ciphers[self.sealing_id].encrypt(nonce, plain.encode(), context.encode())
        return f"{VERSION}:{self.sealing_id}:{base64.urlsafe_b64encode(nonce + sealed).decode()}"

    def open(self, stored: str, *, context: str) -> str:
        version, kid, body = (stored.split(":", 2) + ["", ""])[:3]
        if version != VERSION or not body:
            raise Unreadable("the stored value is not an encrypted secret (run the migrations, or "
                             "`python -m api.admin.secrets rotate` to encrypt values written by an older version)")
        cipher = self._ciphers.get(kid)
        if cipher is None:
            raise Unreadable(f"it was encrypted with key {kid}, which {SETTING} does not hold (it holds "
                             f"{', '.join(self.ids)}); add that key back after the first one")
        try:
            raw = base64.urlsafe_b64decode(body)
            return cipher.decrypt(raw[:NONCE_BYTES], raw[NONCE_BYTES:], context.encode()).decode()
        except (InvalidTag, binascii.Error, ValueError):
            raise Unreadable(f"key {kid} does not open it: the stored value was altered or belongs to another "
                             "row") from None

    def sealed_with_first(self, stored: str) -> bool:
        return stored.startswith(f"{VERSION}:{self.sealing_id}:")


@lru_cache
def _keyring(text: str, development: bool) -> Keyring:
    if not text.strip() and development:
        log.warning("%s is not set: webhook secrets are encrypted with the public development key, which is "
                    "fine for development only", SETTING)
        return Keyring(parse_keys(DEVELOPMENT_KEY))
    return Keyring(parse_keys(text))


class KeySettings(Protocol):
    """What a keyring is made from: core.settings.StoreSettings (not imported: it imports this module)."""

    secrets_key: SecretStr
    development: bool


def keyring(settings: KeySettings) -> Keyring:
    return _keyring(settings.secrets_key.get_secret_value(), settings.development)


WEBHOOK_CONTEXT = "webhook_owners.secret:"


def webhook_context(owner: str) -> str:
    return WEBHOOK_CONTEXT + owner
