"""The room left on each node's disk, as its worker announces it: a node whose disk is full is placed on no more
(controlplane/scheduler.py) and `GET /nodes` shows it `disk_full`, with its free bytes.

Revision ID: 0015
Revises: 0014
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null: not announced (a worker of an earlier version, or one that could not read its disk).
    op.add_column("nodes", sa.Column("disk_free_bytes", sa.BigInteger(), nullable=True))
    op.add_column("nodes", sa.Column("disk_full", sa.Boolean(), nullable=False, server_default=sa.false()))


def downgrade() -> None:
    op.drop_column("nodes", "disk_full")
    op.drop_column("nodes", "disk_free_bytes")
