"""What the leader and the ranks share: wire protocol, errors, Redis keys, the Celery app. No torch."""
