"""The HTTP process: routes, their schemas, auth and the answers' shapes. Its SQL is in db/, the loops that act on
jobs (ingest, reaper, scheduler, dispatcher, deliverer) are the control plane's (controlplane/)."""
