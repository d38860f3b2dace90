"""Each node's warm trainer (worker/warm.py), as its worker announces it: `GET /nodes` shows whether the node's
next single-node attempt starts its ranks from an imported trainer (ready) or waits for one (importing, none).

Revision ID: 0016
Revises: 0015
"""

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Null: not announced (a worker of an earlier version).
    op.add_column("nodes", sa.Column("warm_trainer", sa.String(16), nullable=True))


def downgrade() -> None:
    op.drop_column("nodes", "warm_trainer")
