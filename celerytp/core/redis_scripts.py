"""Lua scripts shared by the leader and the ranks."""

# Delete a lock or lease key only while we still hold it (its value is our token).
RELEASE_IF_HOLDER = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
