"""Nodes and placement: the nodes the control plane has seen (from the workers' heartbeats), and on each
job where it was placed (`placement`) or why it still waits (`queued_reason`).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "nodes",
        sa.Column("name", sa.String(64), primary_key=True),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("slots", sa.Integer(), nullable=False),
        sa.Column("devices", postgresql.JSONB(), nullable=False),
        sa.Column("queues", postgresql.ARRAY(sa.String(64)), nullable=False),
        sa.Column("jobs_max", sa.Integer(), nullable=False),
        sa.Column("draining", sa.Boolean(), nullable=False, server_default=sa.false()),
        sa.Column("worker", sa.String(200), nullable=False, server_default=""),
        # Where the other nodes of a multi-node job reach this one (its FT_NODE_ADDR).
        sa.Column("addr", sa.String(200), nullable=False, server_default="127.0.0.1"),
        sa.Column("first_seen", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("last_seen", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    # [{"node": name, "devices": [...]}, ...]: one entry per node of the job's gang; null while unplaced.
    op.add_column("jobs", sa.Column("placement", postgresql.JSONB(), nullable=True))
    op.add_column("jobs", sa.Column("queued_reason", sa.Text(), nullable=True))
    # What the scheduler counts as held slots: placed jobs that have not ended.
    op.create_index("ix_jobs_placed", "jobs", ["status"],
                    postgresql_where=sa.text("placement IS NOT NULL AND status IN "
                                             "('queued', 'starting', 'running', 'cancelling')"))
    # Slots came free (a placed job ended, or went back to the queue): wake the scheduler at once rather than
    # at its next periodic look.
    op.execute("""
        CREATE TRIGGER jobs_notify_slots_free AFTER UPDATE ON jobs FOR EACH ROW
        WHEN (OLD.placement IS NOT NULL AND (NEW.placement IS NULL OR
              (OLD.status IS DISTINCT FROM NEW.status AND NEW.status IN ('succeeded', 'failed', 'cancelled'))))
        EXECUTE FUNCTION ft_notify_dispatch()""")


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_notify_slots_free ON jobs")
    op.drop_index("ix_jobs_placed", table_name="jobs")
    op.drop_column("jobs", "queued_reason")
    op.drop_column("jobs", "placement")
    op.drop_table("nodes")
