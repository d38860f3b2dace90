"""Keyset indexes for the job list: newest first within a status and within a queue.

Revision ID: 0002
Revises: 0001
"""

from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # `WHERE status = $1 ORDER BY seq DESC LIMIT n` (and with `seq < cursor`) reads n index entries.
    op.create_index("ix_jobs_status_seq", "jobs", ["status", "seq"])
    op.create_index("ix_jobs_queue_seq", "jobs", ["queue", "seq"])
    # The status-only index is a prefix of the new one.
    op.drop_index("ix_jobs_status", table_name="jobs")


def downgrade() -> None:
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.drop_index("ix_jobs_queue_seq", table_name="jobs")
    op.drop_index("ix_jobs_status_seq", table_name="jobs")
