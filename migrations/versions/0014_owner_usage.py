"""What each owner holds, kept as counters: its unfinished jobs, their GPUs and the bytes of its files.

A submit or an upload under a quota locks its owner's row and compares it with the limit instead of counting the
owner's jobs or summing its files under a lock, so its cost does not grow with what the owner holds. Triggers on
`jobs` and `files` keep the counters in the transaction of every write that changes them, whoever writes: a job
is counted while its status is unfinished, so the write that makes it terminal takes it off once (terminal
statuses never change), a requeue (still unfinished) changes nothing, and a rolled-back write takes its change
back with it. Nothing outside a transaction holds a count, so a control-plane restart cannot leave one behind.

`ft_recount_owner_usage()` rebuilds every row from the tables: the backfill here, and an operator's repair after
writing the tables with triggers disabled (`session_replication_role = replica`).

Revision ID: 0014
Revises: 0013
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

# The statuses a job quota counts (contract.codes.UNFINISHED_STATUSES at this revision).
UNFINISHED = "('queued', 'starting', 'running', 'cancelling')"


def upgrade() -> None:
    op.create_table(
        "owner_usage",
        sa.Column("owner", sa.String(64), primary_key=True),
        sa.Column("active_jobs", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("gpus", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("stored_bytes", sa.BigInteger(), nullable=False, server_default="0"),
    )
    # An unfinished job counts once for its owner: a row that enters the set adds itself, one that leaves it (its
    # terminal status, a delete) takes itself off, and a change of owner or GPUs moves it. An update that
    # changes none of these does not call the function at all (the triggers' WHEN).
    op.execute(f"""
        CREATE FUNCTION ft_count_jobs() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP <> 'INSERT' AND OLD.status IN {UNFINISHED} THEN
                UPDATE owner_usage SET active_jobs = active_jobs - 1, gpus = gpus - OLD.gpus WHERE owner = OLD.owner;
            END IF;
            IF TG_OP <> 'DELETE' AND NEW.status IN {UNFINISHED} THEN
                UPDATE owner_usage SET active_jobs = active_jobs + 1, gpus = gpus + NEW.gpus WHERE owner = NEW.owner;
                IF NOT FOUND THEN
                    INSERT INTO owner_usage (owner, active_jobs, gpus) VALUES (NEW.owner, 1, NEW.gpus)
                    ON CONFLICT (owner) DO UPDATE SET active_jobs = owner_usage.active_jobs + 1,
                                                      gpus = owner_usage.gpus + EXCLUDED.gpus;
                END IF;
            END IF;
            RETURN NULL;
        END $$""")
    op.execute(f"CREATE TRIGGER jobs_count_insert AFTER INSERT ON jobs FOR EACH ROW "
               f"WHEN (NEW.status IN {UNFINISHED}) EXECUTE FUNCTION ft_count_jobs()")
    op.execute(f"""
        CREATE TRIGGER jobs_count_update AFTER UPDATE OF status, owner, gpus ON jobs FOR EACH ROW
        WHEN ((OLD.status IN {UNFINISHED}) <> (NEW.status IN {UNFINISHED})
              OR (NEW.status IN {UNFINISHED} AND (OLD.owner <> NEW.owner OR OLD.gpus <> NEW.gpus)))
        EXECUTE FUNCTION ft_count_jobs()""")
    op.execute(f"CREATE TRIGGER jobs_count_delete AFTER DELETE ON jobs FOR EACH ROW "
               f"WHEN (OLD.status IN {UNFINISHED}) EXECUTE FUNCTION ft_count_jobs()")
    op.execute("""
        CREATE FUNCTION ft_count_files() RETURNS trigger LANGUAGE plpgsql AS $$
        BEGIN
            IF TG_OP <> 'INSERT' THEN
                UPDATE owner_usage SET stored_bytes = stored_bytes - OLD.bytes WHERE owner = OLD.owner;
            END IF;
            IF TG_OP <> 'DELETE' THEN
                UPDATE owner_usage SET stored_bytes = stored_bytes + NEW.bytes WHERE owner = NEW.owner;
                IF NOT FOUND THEN
                    INSERT INTO owner_usage (owner, stored_bytes) VALUES (NEW.owner, NEW.bytes)
                    ON CONFLICT (owner) DO UPDATE SET stored_bytes = owner_usage.stored_bytes + EXCLUDED.stored_bytes;
                END IF;
            END IF;
            RETURN NULL;
        END $$""")
    op.execute("CREATE TRIGGER files_count_insert AFTER INSERT ON files FOR EACH ROW "
               "EXECUTE FUNCTION ft_count_files()")
    op.execute("CREATE TRIGGER files_count_update AFTER UPDATE OF owner, bytes ON files FOR EACH ROW "
               "WHEN (OLD.owner <> NEW.owner OR OLD.bytes <> NEW.bytes) EXECUTE FUNCTION ft_count_files()")
    op.execute("CREATE TRIGGER files_count_delete AFTER DELETE ON files FOR EACH ROW "
               "EXECUTE FUNCTION ft_count_files()")
    # Under a lock that stops every write to both tables while it counts, so no write falls between the count
    # and the counters it replaces.
    op.execute(f"""
        CREATE FUNCTION ft_recount_owner_usage() RETURNS void LANGUAGE plpgsql AS $$
        BEGIN
            LOCK TABLE jobs, files, owner_usage IN SHARE ROW EXCLUSIVE MODE;
            DELETE FROM owner_usage;
            INSERT INTO owner_usage (owner, active_jobs, gpus, stored_bytes)
            SELECT owner, sum(active_jobs), sum(gpus), sum(stored_bytes) FROM (
                SELECT owner, count(*) AS active_jobs, sum(gpus) AS gpus, 0 AS stored_bytes FROM jobs
                WHERE status IN {UNFINISHED} GROUP BY owner
                UNION ALL
                SELECT owner, 0, 0, sum(bytes) FROM files GROUP BY owner
            ) AS held GROUP BY owner;
        END $$""")
    op.execute("SELECT ft_recount_owner_usage()")


def downgrade() -> None:
    op.execute("DROP FUNCTION ft_recount_owner_usage()")
    for trigger in ("files_count_insert", "files_count_update", "files_count_delete"):
        op.execute(f"DROP TRIGGER {trigger} ON files")
    for trigger in ("jobs_count_insert", "jobs_count_update", "jobs_count_delete"):
        op.execute(f"DROP TRIGGER {trigger} ON jobs")
    op.execute("DROP FUNCTION ft_count_files()")
    op.execute("DROP FUNCTION ft_count_jobs()")
    op.drop_table("owner_usage")
