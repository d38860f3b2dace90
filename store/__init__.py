"""The artifact store: uploaded files, committed checkpoints and exports, in one place every node reaches.

`FT_STORE_URL` names it: `file://<folder>` (the default, a folder on this machine) or `s3://<bucket>/<prefix>` for
any S3-compatible server. `objects.py` speaks to it, `layout.py` names its keys, `cache.py` keeps a node's copies,
`push.py` uploads a checkpoint's files from a process of its own.
"""
