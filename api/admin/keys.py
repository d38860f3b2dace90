"""The operator's key tool: how the first admin key of a fresh install is made, and a way in when every
admin key is lost. It writes to Postgres directly (FT_DATABASE_URL), so it needs no key itself.

    python -m api.admin.keys create --owner platform --scopes admin [--name NAME] [--expires-in-days N]
    python -m api.admin.keys list [--owner NAME]
    python -m api.admin.keys revoke KEY_ID

`create` prints the key alone on stdout (`KEY=$(python -m api.admin.keys create ...)`) and its details on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from datetime import datetime, timedelta, timezone

from api import access
from api.access import Scope
from api.schemas import OWNER_PATTERN
from api.settings import get_settings
from db import keys as service
from db import pool as pg
from db.errors import DbError, Invalid

SCOPES = [s.value for s in Scope]


def _scopes(value: str) -> list[str]:
    scopes = [s.strip() for s in value.split(",") if s.strip()]
    unknown = [s for s in scopes if s not in SCOPES]
    if not scopes or unknown:
        raise argparse.ArgumentTypeError(f"scopes are a comma-separated list of {', '.join(SCOPES)}")
    return scopes


def _owner(value: str) -> str:
    if not re.fullmatch(OWNER_PATTERN.strip("^$"), value):
        raise argparse.ArgumentTypeError("an owner is 1 to 64 letters, digits, '_', '.' or '-'")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m api.admin.keys", description="Create, list and revoke API keys.")
    sub = parser.add_subparsers(dest="command", required=True)
    create = sub.add_parser("create", help="create a key and print it (shown this once)")
    create.add_argument("--owner", required=True, type=_owner, help="the team or project the key acts for")
    create.add_argument("--scopes", required=True, type=_scopes, help=f"comma-separated: {', '.join(SCOPES)}")
    create.add_argument("--name", default="", help="what the key is for")
    create.add_argument("--expires-in-days", type=float, default=None, help="default: never expires")
    listing = sub.add_parser("list", help="list keys (never their secrets)")
    listing.add_argument("--owner", type=_owner, default=None)
    revoke = sub.add_parser("revoke", help="revoke a key by id")
    revoke.add_argument("key_id")
    args = parser.parse_args(argv)

    try:
        asyncio.run(_run(args))
    except DbError as exc:
        # As the API words it (api/errors.py): an invalid value is named by its field.
        print(f"error: {exc.field}: {exc.message}" if isinstance(exc, Invalid) else f"error: {exc.message}",
              file=sys.stderr)
        return 1
    return 0


async def _run(args: argparse.Namespace) -> None:
    pg.configure(database_url=get_settings().database_url, pool_size=1)
    try:
        if args.command == "create":
            expires = (datetime.now(timezone.utc) + timedelta(days=args.expires_in_days)
                       if args.expires_in_days is not None else None)
            key, secret = await access.create_key(owner=args.owner, scopes=args.scopes, name=args.name,
                                                  expires_at=expires, actor=None)
            print(f"created {key['id']} for owner {key['owner']!r} with scopes {', '.join(key['scopes'])}"
                  + (f", expiring {key['expires_at'].isoformat()}" if key["expires_at"] else "")
                  + "; the key (shown this once):", file=sys.stderr)
            print(secret)
        elif args.command == "list":
            page = await service.listing(owner=args.owner, limit=10_000, after=None)
            for k in page["data"]:
                print(json.dumps(k, default=str))
        else:
            key, _ = await service.revoke(key_id=args.key_id, actor=None)
            print(f"revoked {key['id']} (owner {key['owner']!r})", file=sys.stderr)
    finally:
        await pg.close()


if __name__ == "__main__":
    sys.exit(main())
