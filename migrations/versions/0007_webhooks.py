"""Webhooks: each owner's signing secret and default URL, and the outbox of deliveries, written in the
transaction that records the job event it tells about and sent by the control plane's deliverer.

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # The secret is kept as it is, not hashed like an API key: the service must compute an HMAC with it on
    # every delivery. The API shows it only in the answer that created or rotated it.
    op.create_table(
        "webhook_owners",
        sa.Column("owner", sa.String(64), primary_key=True),
        sa.Column("url", sa.Text(), nullable=True),
        sa.Column("secret", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.Column("rotated_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_table(
        "webhook_deliveries",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("job_id", sa.String(40), sa.ForeignKey("jobs.id", ondelete="CASCADE"), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("event_seq", sa.Integer(), nullable=False),
        sa.Column("event", sa.String(32), nullable=False),
        sa.Column("url", sa.Text(), nullable=False),
        # scheme://host:port: the unit the deliverer bounds, so one slow receiver holds only its own slots.
        sa.Column("receiver", sa.Text(), nullable=False),
        sa.Column("payload", postgresql.JSONB(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False, server_default="pending"),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True, server_default=sa.func.now()),
        sa.Column("last_attempt_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_status_code", sa.Integer(), nullable=True),
        sa.Column("last_error", sa.Text(), nullable=True),
        sa.Column("delivered_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
        sa.CheckConstraint("status IN ('pending', 'delivered', 'failed')", name="status_valid"),
        # One delivery per job event: an event stored twice (it cannot be, but) never notifies twice.
        sa.UniqueConstraint("job_id", "event_seq", name="uq_webhook_deliveries_job_event"),
    )
    # What the deliverer scans: pending rows by when they are due.
    op.create_index("ix_webhook_deliveries_due", "webhook_deliveries", ["next_attempt_at"],
                    postgresql_where=sa.text("status = 'pending'"))
    # A delivery waits for its job's earlier pending ones (events arrive in order).
    op.create_index("ix_webhook_deliveries_job_pending", "webhook_deliveries", ["job_id", "event_seq"],
                    postgresql_where=sa.text("status = 'pending'"))
    op.execute("""
        CREATE FUNCTION ft_notify_webhooks() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('ft_webhooks', '');
            RETURN NULL;
        END $$""")
    op.execute("""
        CREATE TRIGGER webhook_deliveries_notify AFTER INSERT ON webhook_deliveries
        FOR EACH STATEMENT EXECUTE FUNCTION ft_notify_webhooks()""")


def downgrade() -> None:
    op.execute("DROP TRIGGER webhook_deliveries_notify ON webhook_deliveries")
    op.execute("DROP FUNCTION ft_notify_webhooks()")
    op.drop_index("ix_webhook_deliveries_job_pending", table_name="webhook_deliveries")
    op.drop_index("ix_webhook_deliveries_due", table_name="webhook_deliveries")
    op.drop_table("webhook_deliveries")
    op.drop_table("webhook_owners")
