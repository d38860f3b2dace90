"""`ft_jobs` names every job whose row a statement changed: the API processes' job caches drop it.

Statement-level over the changed rows, like `ft_events` (0003): one notification per job per statement,
and Postgres folds identical ones within a transaction. Delivered at commit, never for a rollback.

Revision ID: 0008
Revises: 0007
"""

from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("""
        CREATE FUNCTION ft_notify_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('ft_jobs', id) FROM (SELECT DISTINCT id FROM changed_jobs) AS jobs;
            RETURN NULL;
        END $$""")
    op.execute("""
        CREATE TRIGGER jobs_notify_update AFTER UPDATE ON jobs
        REFERENCING NEW TABLE AS changed_jobs FOR EACH STATEMENT EXECUTE FUNCTION ft_notify_jobs()""")
    op.execute("""
        CREATE TRIGGER jobs_notify_delete AFTER DELETE ON jobs
        REFERENCING OLD TABLE AS changed_jobs FOR EACH STATEMENT EXECUTE FUNCTION ft_notify_jobs()""")


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_notify_delete ON jobs")
    op.execute("DROP TRIGGER jobs_notify_update ON jobs")
    op.execute("DROP FUNCTION ft_notify_jobs()")
