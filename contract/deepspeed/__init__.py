"""A job's DeepSpeed side, torch-free: DeepSpeed's own field table (fields.py, built by fields_gen.py), what the
service does with each field of a raw config (policy.py), the merge of a raw config into the job (merge.py), the
batch arithmetic (batch.py), the renderer (render.py), and `resolve`, which runs them in order (resolver.py)."""

from contract.deepspeed.batch import ResolveLimits
from contract.deepspeed.policy import AUTO, DANGEROUS_KEYS, DS
from contract.deepspeed.resolver import optimizer_problems, resolve

__all__ = ["AUTO", "DANGEROUS_KEYS", "DS", "ResolveLimits", "optimizer_problems", "resolve"]
