"""Wake-ups from the database itself: `ft_events` names each job that gained events, `ft_dispatch` says a
job is waiting to be sent to the workers.

Triggers, not calls in each writer: the ingester, the API's submit and cancel, and the reaper all write
events and requeue jobs, and a writer that forgot to notify would leave followers polling or a job
unsent until the next periodic pass. A notification is delivered when its transaction commits (never
for one rolled back), and Postgres folds identical ones within a transaction, so a batch of 500 events
of one job is one wake-up.

Revision ID: 0003
Revises: 0002
"""

from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # Statement-level, over the inserted rows: one notification per job per statement, not per event.
    op.execute("""
        CREATE FUNCTION ft_notify_events() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('ft_events', job_id) FROM (SELECT DISTINCT job_id FROM new_events) AS jobs;
            RETURN NULL;
        END $$""")
    op.execute("""
        CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
        REFERENCING NEW TABLE AS new_events FOR EACH STATEMENT EXECUTE FUNCTION ft_notify_events()""")
    # A new job, and one put back in the queue (requeued, re-driven), has no dispatched_at yet.
    op.execute("""
        CREATE FUNCTION ft_notify_dispatch() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            PERFORM pg_notify('ft_dispatch', '');
            RETURN NULL;
        END $$""")
    op.execute("""
        CREATE TRIGGER jobs_notify_dispatch AFTER INSERT OR UPDATE ON jobs FOR EACH ROW
        WHEN (NEW.status = 'queued' AND NEW.dispatched_at IS NULL) EXECUTE FUNCTION ft_notify_dispatch()""")


def downgrade() -> None:
    op.execute("DROP TRIGGER jobs_notify_dispatch ON jobs")
    op.execute("DROP FUNCTION ft_notify_dispatch()")
    op.execute("DROP TRIGGER job_events_notify ON job_events")
    op.execute("DROP FUNCTION ft_notify_events()")
