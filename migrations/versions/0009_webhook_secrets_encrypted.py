"""Owners' webhook signing secrets encrypted at rest (core/secretbox.py) with FT_SECRETS_KEY; the few characters
the API shows to tell secrets apart get a column of their own, since the ciphertext's would tell nothing.

The upgrade encrypts every plain-text secret with the first key of FT_SECRETS_KEY (in development, unset: the
development key), so the migration needs the same setting as the API. The downgrade decrypts them back to plain
text for the older version, and stops, naming the owners, where a secret opens with no configured key.

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

from core import secretbox
from api.settings import get_settings
from core.webhooks import SECRET_PREFIX, SHOWN_PREFIX

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("webhook_owners", sa.Column("secret_prefix", sa.Text(), nullable=True))
    ring = secretbox.keyring(get_settings())
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT owner, secret FROM webhook_owners FOR UPDATE")).fetchall()
    for owner, secret in rows:
        if not secret.startswith(SECRET_PREFIX):
            raise RuntimeError(f"webhook_owners.secret of owner {owner!r} is not a plain webhook secret; "
                               "this migration encrypts only those")
        conn.execute(sa.text("UPDATE webhook_owners SET secret = :sealed, secret_prefix = :prefix "
                             "WHERE owner = :owner"),
                     {"sealed": ring.seal(secret, context=secretbox.webhook_context(owner)),
                      "prefix": secret[:SHOWN_PREFIX], "owner": owner})
    op.alter_column("webhook_owners", "secret_prefix", nullable=False)


def downgrade() -> None:
    ring = secretbox.keyring(get_settings())
    conn = op.get_bind()
    rows = conn.execute(sa.text("SELECT owner, secret FROM webhook_owners FOR UPDATE")).fetchall()
    unreadable = []
    for owner, stored in rows:
        try:
            plain = ring.open(stored, context=secretbox.webhook_context(owner))
        except secretbox.Unreadable as exc:
            unreadable.append(f"{owner!r} ({exc})")
            continue
        conn.execute(sa.text("UPDATE webhook_owners SET secret = :plain WHERE owner = :owner"),
                     {"plain": plain, "owner": owner})
    if unreadable:
        raise RuntimeError("cannot decrypt the webhook secrets of owners " + ", ".join(unreadable)
                           + f"; set {secretbox.SETTING} to the keys they were encrypted with")
    op.drop_column("webhook_owners", "secret_prefix")
