"""The database URL of the settings (`postgresql+psycopg://…`, the form SQLAlchemy reads) as the plain libpq URL
that asyncpg and psycopg connections take."""

from __future__ import annotations


def dsn(url: str) -> str:
    """`url` with any `+driver` dropped from its scheme; the rest, password included, as given."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme.split('+', 1)[0]}://{rest}" if sep else url
