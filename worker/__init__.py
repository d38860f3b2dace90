"""The data plane: a Celery worker that supervises one fine-tune job at a time."""
