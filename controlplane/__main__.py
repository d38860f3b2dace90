"""`python -m controlplane`: the control plane's loops (controlplane/main.py)."""

from controlplane.main import main

main()
