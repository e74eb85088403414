"""Process-group helpers: the tensor-parallel context and the Redis-backed rendezvous store."""
