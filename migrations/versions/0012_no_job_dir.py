"""A job's folder is each node's own choice (under its FT_ARTIFACTS_ROOT), so the submit no longer names one: the
column that held the API host's guess goes.

Revision ID: 0012
Revises: 0011
"""

from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_column("jobs", "job_dir")


def downgrade() -> None:
    op.execute("ALTER TABLE jobs ADD COLUMN job_dir text NOT NULL DEFAULT ''")
