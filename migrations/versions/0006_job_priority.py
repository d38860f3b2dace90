"""A job's priority as a column (from its spec's `resources.priority`), and the index the scheduler reads
waiting jobs through: each owner's jobs of a queue, highest priority first, then oldest first.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

# Rows written around the API (benchmarks, old rows) may hold anything there: only an integer the spec could
# have accepted is taken, anything else counts as the default 0 rather than failing the migration.
# CASE, not AND: only CASE guarantees the cast is never tried on a value the pattern refused.
BACKFILL = """
UPDATE jobs SET priority = CASE WHEN (resolved->'spec'->'resources'->>'priority') ~ '^-?[0-9]{1,4}$'
                                THEN (resolved->'spec'->'resources'->>'priority')::int ELSE 0 END
WHERE resolved->'spec'->'resources' ? 'priority'"""


def upgrade() -> None:
    op.add_column("jobs", sa.Column("priority", sa.Integer(), nullable=False, server_default="0"))
    op.execute(BACKFILL)
    # The scheduler's read (controlplane/scheduler.py): for each queue and each owner with waiting jobs, that owner's
    # first jobs by priority then age, so a pass reads a bounded number of entries however long the queue.
    # Only waiting, unplaced jobs are in it: it stays as small as the backlog.
    op.create_index("ix_jobs_waiting", "jobs", ["queue", "owner", sa.text("priority DESC"), "seq"],
                    postgresql_where=sa.text("status = 'queued' AND placement IS NULL"))


def downgrade() -> None:
    op.drop_index("ix_jobs_waiting", table_name="jobs")
    op.drop_column("jobs", "priority")
