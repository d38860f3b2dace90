"""The contract every process shares, torch-free (the standard library and pydantic only): the job spec
(spec.py), the Redis/Celery protocol (protocol.py), the codes (codes.py: job statuses, event kinds, failure
codes), the field problems a request is refused with (problems.py), and the DeepSpeed field table, merge, batch
arithmetic and renderer (deepspeed/).

Imports nothing itself, so a process that needs only the protocol gets no pydantic.
"""
