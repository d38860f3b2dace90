"""The validator's decision on a file is notified (`ft_file_checked`, the file's id) at its commit, so a `/v1` job
create that names a file still being checked waits for that notification instead of reading the row again and
again.

Revision ID: 0013
Revises: 0012
"""

from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE FUNCTION ft_notify_file_checked() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('ft_file_checked', NEW.id);
            RETURN NULL;
        END $$""")
    op.execute("CREATE TRIGGER files_checked_notify AFTER UPDATE OF status ON files FOR EACH ROW "
               "WHEN (OLD.status IS DISTINCT FROM NEW.status) EXECUTE FUNCTION ft_notify_file_checked()")


def downgrade() -> None:
    op.execute("DROP TRIGGER files_checked_notify ON files")
    op.execute("DROP FUNCTION ft_notify_file_checked()")
