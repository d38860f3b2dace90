"""Access: API keys, an owner on every job (existing jobs go to `default`), quotas per owner, idempotency
keys for submits, and the audit log.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

UNFINISHED = "status IN ('queued', 'starting', 'running', 'cancelling')"


def upgrade() -> None:
    # Existing jobs were submitted under the one shared token: they belong to the `default` owner. The API
    # always names the owner; the server default serves rows written around it (bulk loads, the benchmark's
    # 100,000-job fixture), which land where existing jobs did.
    op.add_column("jobs", sa.Column("owner", sa.String(64), nullable=False, server_default="default"))
    op.add_column("jobs", sa.Column("gpus", sa.Integer(), nullable=False, server_default="1"))
    op.execute("UPDATE jobs SET gpus = (request->'resources'->>'num_gpus')::int "
               "WHERE request->'resources' ? 'num_gpus' AND jsonb_typeof(request->'resources'->'num_gpus') = 'number'")
    # A caller's list: WHERE owner = $1 [AND seq < cursor] ORDER BY seq DESC LIMIT n reads n entries.
    op.create_index("ix_jobs_owner_seq", "jobs", ["owner", "seq"])
    # A quota check counts the owner's unfinished jobs and their GPUs from this index alone.
    op.create_index("ix_jobs_owner_unfinished", "jobs", ["owner"], postgresql_include=["gpus"],
                    postgresql_where=sa.text(UNFINISHED))

    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("secret_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("scopes", postgresql.ARRAY(sa.String(16)), nullable=False),
        sa.Column("name", sa.String(200), nullable=False, server_default=""),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("created_by", sa.String(40), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_api_keys_secret_hash")),
    )
    op.create_index("ix_api_keys_owner", "api_keys", ["owner"])
    # Every API process caches keys; a change to one (revoked, expiry or scopes edited by hand, deleted) is
    # announced so each drops it at once. A trigger, so the CLI and a manual UPDATE announce it too.
    op.execute("""
        CREATE FUNCTION ft_notify_keys() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('ft_keys', encode(OLD.secret_hash, 'hex'));
            RETURN NULL;
        END $$""")
    op.execute("""
        CREATE TRIGGER api_keys_notify AFTER UPDATE OF revoked_at, expires_at, scopes, owner, secret_hash OR DELETE
        ON api_keys FOR EACH ROW EXECUTE FUNCTION ft_notify_keys()""")

    op.create_table(
        "owner_quotas",
        sa.Column("owner", sa.String(64), primary_key=True),
        sa.Column("max_active_jobs", sa.Integer(), nullable=True),
        sa.Column("max_gpus", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
    )
    op.create_table(
        "idempotency_keys",
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("key", sa.String(255), nullable=False),
        sa.Column("request_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=True),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("response", sa.Text(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("owner", "key", name="pk_idempotency_keys"),
    )
    op.create_index("ix_idempotency_keys_created_at", "idempotency_keys", ["created_at"])
    op.create_table(
        "audit_log",
        sa.Column("seq", sa.BigInteger(), autoincrement=True, primary_key=True),
        sa.Column("at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("key_id", sa.String(40), nullable=True),
        sa.Column("owner", sa.String(64), nullable=True),
        sa.Column("action", sa.String(32), nullable=False),
        sa.Column("subject", sa.String(64), nullable=False),
        sa.Column("data", postgresql.JSONB(astext_type=sa.Text()), nullable=False, server_default="{}"),
    )


def downgrade() -> None:
    op.drop_table("audit_log")
    op.drop_index("ix_idempotency_keys_created_at", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
    op.drop_table("owner_quotas")
    op.execute("DROP TRIGGER api_keys_notify ON api_keys")
    op.execute("DROP FUNCTION ft_notify_keys()")
    op.drop_index("ix_api_keys_owner", table_name="api_keys")
    op.drop_table("api_keys")
    op.drop_index("ix_jobs_owner_unfinished", table_name="jobs")
    op.drop_index("ix_jobs_owner_seq", table_name="jobs")
    op.drop_column("jobs", "gpus")
    op.drop_column("jobs", "owner")
