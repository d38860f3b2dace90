"""The operator's command lines (`python -m api.admin.keys`, `python -m api.admin.secrets`): what is done to the
API's data from a shell, with no key, beside the HTTP process rather than inside it."""
