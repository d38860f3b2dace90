"""A seeded chaos soak: the real stack under a steady workload while a nemesis faults every component, with named
invariants checked while it runs and at the end (docs/guarantees.md#the-soak). `make soak MINUTES=.. SEED=..`."""
