"""The control plane: HTTP API, job store, event ingester and reaper. The only writer of Postgres."""
