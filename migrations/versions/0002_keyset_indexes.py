"""Keyset indexes for the job list (newest first within a status and within a queue), and one for the
reaper's look at jobs never sent.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
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
    # The reaper's look for jobs whose enqueue failed, every pass: only those rows, however long the queue.
    op.create_index("ix_jobs_undispatched", "jobs", ["updated_at"],
                    postgresql_where=sa.text("status = 'queued' AND dispatched_at IS NULL"))


def downgrade() -> None:
    op.drop_index("ix_jobs_undispatched", table_name="jobs")
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.drop_index("ix_jobs_queue_seq", table_name="jobs")
    op.drop_index("ix_jobs_status_seq", table_name="jobs")
