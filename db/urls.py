"""The database URL of the settings (a SQLAlchemy URL) as the plain libpq URL a raw driver connection takes."""

from __future__ import annotations

from sqlalchemy.engine import make_url


def dsn(url: str) -> str:
    """The SQLAlchemy URL of the settings as a plain libpq URL."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)
