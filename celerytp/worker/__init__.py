"""The rank worker: one Celery worker process per rank, its state, and its task adapters."""
