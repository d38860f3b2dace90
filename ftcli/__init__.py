"""`ft`, the service's command line: a client of the REST API only (httpx, typer, rich). It imports nothing of
the server, the worker or the trainer, so it installs and starts without torch."""
