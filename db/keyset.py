"""Keyset pages, newest first: the one way a list's SQL is built (jobs, keys, files). A page is the rows after the
cursor's key in the list's order, `limit + 1` of them so the caller knows whether more follow; its WHERE list and
its `$n` arguments grow together, so a filter can never be numbered wrong."""

from __future__ import annotations

from typing import Any


class Page:
    def __init__(self) -> None:
        self.where: list[str] = []
        self.args: list[Any] = []

    def arg(self, value: Any) -> str:
        """`value` as the next positional parameter."""
        self.args.append(value)
        return f"${len(self.args)}"

    def where_(self, condition: str) -> None:
        self.where.append(condition)

    def equal(self, column: str, value: Any) -> None:
        """`column = value`, where a value is given (None: no filter)."""
        if value is not None:
            self.where.append(f"{column} = {self.arg(value)}")

    def sql(self, select: str, table: str, order: str, limit: int) -> str:
        where = f"WHERE {' AND '.join(self.where)} " if self.where else ""
        return f"SELECT {select} FROM {table} {where}ORDER BY {order} LIMIT {self.arg(limit + 1)}"
