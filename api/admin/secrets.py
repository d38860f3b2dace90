"""The operator's secrets tool (FT_SECRETS_KEY, core/secretbox.py):

    python -m api.admin.secrets new-key   # print a new key for FT_SECRETS_KEY
    python -m api.admin.secrets rotate    # re-encrypt every stored webhook secret with the list's first key

`rotate` writes to Postgres directly (FT_DATABASE_URL) and runs beside a serving API and control plane.
"""

from __future__ import annotations

import asyncio
import sys

from core import secretbox
from core.settings import StoreSettings, settings_or_exit
from db.webhooks import reseal_all

USAGE = "usage: python -m api.admin.secrets new-key | rotate"


def main(argv: list[str]) -> int:
    if argv == ["new-key"]:
        print(secretbox.new_key())
        return 0
    if argv == ["rotate"]:
        settings = settings_or_exit(StoreSettings, "secrets tool")
        changed, total, unreadable = asyncio.run(reseal_all(settings))
        print(f"{changed} of {total} webhook secrets re-encrypted with key {secretbox.keyring(settings).sealing_id}")
        for owner, why in unreadable.items():
            print(f"owner {owner!r}: its webhook secret cannot be decrypted: {why}", file=sys.stderr)
        if unreadable:
            print(f"{len(unreadable)} secrets were left as they are; keep the old keys in {secretbox.SETTING} until "
                  "they are re-encrypted, or have those owners rotate their secrets", file=sys.stderr)
            return 1
        return 0
    print(USAGE, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
