"""What more than one process needs and is neither the contract (what crosses a process boundary: contract/) nor
the database (db/): the settings two processes must agree on (settings.py), and rules two processes apply alike
so they cannot disagree: where a job's share fits a node (placement.py: the scheduler places by it, the dry run
reports it), which webhook receivers may be called and how a delivery is signed (webhooks.py: the API checks a
URL, the deliverer calls it), how stored secrets are sealed (secretbox.py: the API seals, the deliverer opens),
and how server paths are hidden from clients (serverpaths.py: the API and every worker rewrite alike).

Pure where it can be: no database, no Redis, no torch; tests/test_layers.py keeps it below db/ and the processes."""
