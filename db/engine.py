"""The control plane's database: engine, sessions, the declarative base (with a constraint naming convention for
Alembic), and `run`, which executes a statement text of db/ in a session's transaction.

The control plane's one driver is psycopg: SQLAlchemy's engine runs on it, and so do the deliverer's and the
listener's own connections. A statement text is written once, with Postgres's own `$n` parameters, whichever
process runs it: asyncpg sends it as written (db/pool.py), and `run` sends it as written through psycopg's raw
cursor, on the session's connection, so it commits or rolls back with the ORM's changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import MetaData, create_engine
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Session, sessionmaker

from core.settings import StoreSettings

NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


@lru_cache
def _database_url() -> str:
    """FT_DATABASE_URL as every process that holds the database reads it (core/settings.py StoreSettings)."""
    return StoreSettings().database_url


@lru_cache
def get_engine(url: str | None = None) -> Engine:
    # connect_timeout: an unreachable Postgres (a dropped route, not a refused port) becomes a 503 within
    # seconds instead of hanging the request for the OS's TCP timeout.
    return create_engine(url or _database_url(), pool_pre_ping=True, pool_size=10, max_overflow=20,
                         connect_args={"connect_timeout": 5})


@lru_cache
def _factory(url: str | None = None) -> sessionmaker[Session]:
    return sessionmaker(get_engine(url), expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """A session that commits on success and rolls back on any error: no half-written rows."""
    session = _factory()()
    try:
        yield session
        session.commit()
    except BaseException:
        session.rollback()
        raise
    finally:
        session.close()


def run(session: Session, sql: str, *args: Any) -> psycopg.Cursor[Any]:
    """`sql` with `args` as its `$1`, `$2`, … in the session's transaction; rows read as named tuples. The ORM's
    pending changes are flushed first, as SQLAlchemy's own `execute` does, so the statement sees them."""
    session.flush()
    cursor = psycopg.RawCursor(session.connection().connection.driver_connection, row_factory=namedtuple_row)
    cursor.execute(sql, args)
    return cursor


def scalar(session: Session, sql: str, *args: Any) -> Any:
    """The first column of the first row `sql` returns, or None where it returns none."""
    row = run(session, sql, *args).fetchone()
    return None if row is None else row[0]
