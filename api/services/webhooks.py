"""Webhooks as the API checks and sets them: a submit's URL (the SSRF rules, an owner who can sign), and an owner's
default URL and signing secret. The rows are db/webhooks.py's."""

from __future__ import annotations

from typing import Any

from api.access import Principal
from api.errors import ApiError, ErrorCode, invalid
from api.settings import ApiSettings
from contract.problems import FieldError
from contract.spec import JobSpec
from core import secretbox, webhooks
from db import webhooks as store

FIELD = "notifications.webhook_url"


def refused(field: str, message: str) -> ApiError:
    return invalid([FieldError(field, message)])


async def vet(url: str, settings: ApiSettings, field: str) -> None:
    """A 422 naming `field` unless every address of the URL's host may be called (the SSRF rules)."""
    try:
        await webhooks.vet(url, webhooks.parse_allow_nets(settings.webhook_allow_nets))
    except webhooks.Refused as exc:
        raise refused(field, str(exc)) from None


async def check_job(*, spec: JobSpec, caller: Principal, settings: ApiSettings) -> None:
    """A submit's webhook checks (dry runs too): the URL is callable and its owner can sign for it."""
    url = spec.notifications.webhook_url if spec.notifications else None
    if url is None:
        return
    problem = webhooks.syntax_problem(url)
    if problem:
        raise refused(FIELD, problem)
    if not await store.owner_has_secret(caller.owner):
        raise refused(FIELD, f"owner {caller.owner!r} has no webhook secret to sign deliveries with; create it "
                             f"with PUT /owners/{caller.owner}/webhook (its answer shows the secret once)")
    await vet(url, settings, FIELD)


def _may_act_for(caller: Principal, owner: str) -> None:
    if not caller.admin and caller.owner != owner:
        raise ApiError(403, ErrorCode.FORBIDDEN, f"a key of owner {caller.owner!r} may manage only its own owner's "
                                                 "webhook; another owner's needs the scope 'admin'", "owner")


async def get_owner(*, owner: str, caller: Principal) -> dict[str, Any]:
    _may_act_for(caller, owner)
    return await store.get_owner(owner)


async def put_owner(*, owner: str, url: str | None, rotate: bool, caller: Principal,
                    settings: ApiSettings) -> dict[str, Any]:
    """Set the owner's default URL (null: none) and make its secret on first use or when asked to rotate; the
    secret is in this answer only."""
    _may_act_for(caller, owner)
    if url is not None:
        await vet(url, settings, "url")
    secret = webhooks.new_secret()
    sealed = secretbox.keyring(settings).seal(secret, context=secretbox.webhook_context(owner))
    found, made = await store.put_owner(owner=owner, url=url, rotate=rotate, sealed=sealed,
                                        prefix=secret[:webhooks.SHOWN_PREFIX], actor=caller.actor())
    return {**found, "secret": secret if made else None}
