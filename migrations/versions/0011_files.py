"""Uploaded files: one row per file the artifact store holds under files/<id>, written only once the object is
stored whole, with its size and SHA-256; the control plane's validator sets its status, stats and problems. A
quota of stored bytes per owner beside the job quotas, and a notification that wakes the validator on upload.

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("format", sa.String(16), nullable=True),  # null until given or detected
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("stats", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("errors", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        # While the validator reads the file: a control plane that died leaves it to be claimed again after this.
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.CheckConstraint("status IN ('uploaded', 'processed', 'error')", name=op.f("ck_files_status_valid")),
    )
    # A caller's list: WHERE owner = $1 AND (created_at, id) < cursor ORDER BY created_at DESC, id DESC; an
    # admin's list of every owner uses the second.
    op.create_index("ix_files_owner_created", "files", ["owner", "created_at", "id"])
    op.create_index("ix_files_created", "files", ["created_at", "id"])
    # The validator's look for work: only the files not yet checked, however many there are.
    op.create_index("ix_files_uploaded", "files", ["created_at"], postgresql_where=sa.text("status = 'uploaded'"))
    op.execute("""
        CREATE FUNCTION ft_notify_files() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('ft_files', NEW.id);
            RETURN NULL;
        END $$""")
    op.execute("CREATE TRIGGER files_notify AFTER INSERT ON files FOR EACH ROW EXECUTE FUNCTION ft_notify_files()")
    op.add_column("owner_quotas", sa.Column("max_stored_bytes", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    op.drop_column("owner_quotas", "max_stored_bytes")
    op.execute("DROP TRIGGER files_notify ON files")
    op.execute("DROP FUNCTION ft_notify_files()")
    op.drop_index("ix_files_uploaded", table_name="files")
    op.drop_index("ix_files_created", table_name="files")
    op.drop_index("ix_files_owner_created", table_name="files")
    op.drop_table("files")
