"""Engine, sessions and the declarative base (with a constraint naming convention for Alembic)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

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
