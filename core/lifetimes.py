"""How long the service's Redis control keys live: written by the API and re-asserted by the control plane, so
both read the figure from here."""

from __future__ import annotations

# A cancel request (contract.protocol.cancel_key): long enough to outlive any attempt it may still have to stop.
CANCEL_KEY_TTL = 30 * 24 * 3600
