"""One SQL text for both drivers: statements are written once with asyncpg's positional `$n` parameters (the
API's pool), and the control plane's SQLAlchemy sessions run the same text with `$n` renamed to `:pn`."""

from __future__ import annotations

import re
from typing import Any

# `$n` with an optional `::type` cast: SQLAlchemy's `text()` reads `::` after a named parameter poorly, so the
# cast is written out as CAST(... AS type).
_PARAM = re.compile(r"\$(\d+)(?:::(\w+))?")


def named(sql: str) -> str:
    """`sql` with `$n` as `:pn` and `$n::type` as `CAST(:pn AS type)`."""
    def one(match: re.Match[str]) -> str:
        name = f":p{match.group(1)}"
        return f"CAST({name} AS {match.group(2)})" if match.group(2) else name
    return _PARAM.sub(one, sql)


def named_params(*values: Any) -> dict[str, Any]:
    """Positional values as `named`'s parameters: the first is `p1`."""
    return {f"p{i}": value for i, value in enumerate(values, 1)}
