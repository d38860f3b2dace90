"""A job's description (its spec's `description`) as a column of its own, kept by Postgres from the stored
request: lists show it without reading the request, the bulk of a row.

Revision ID: 0010
Revises: 0009
"""

from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN description text GENERATED ALWAYS AS (request->>'description') STORED")


def downgrade() -> None:
    op.drop_column("jobs", "description")
