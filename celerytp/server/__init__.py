"""The serving surface above the leader client: the OpenAI-compatible HTTP API, the Celery
front door (`celerytp.generate`), health and metrics. Imports no torch."""
