"""Lua scripts shared by the leader and the ranks."""

# Delete a lock or lease key only while we still hold it (its value is our token).
RELEASE_IF_HOLDER = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# ARGV: holder token, new TTL in milliseconds. 1: extended; 0: the lock is someone else's or gone.
RENEW_IF_HOLDER = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"

# A model's request queue and its serving-loop flag (keys.queue_key, keys.loop_key) change only
# through these scripts, so a request is never queued with no loop to take it: either the loop
# that is ending sees it (EXIT_IF_IDLE returns 0), or the submitter starts a new loop.

# KEYS: queue, loop flag. ARGV: request JSON, queue limit, new loop id, flag TTL seconds.
# Returns -1: the queue is full; 1: queued, and the caller must start a loop; 0: queued.
SUBMIT = """
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[2]) then return -1 end
redis.call('RPUSH', KEYS[1], ARGV[1])
if redis.call('SET', KEYS[2], ARGV[3], 'NX', 'EX', ARGV[4]) then return 1 end
return 0
"""

# A waiter whose request is still queued while no loop runs (the loop stopped to let another
# op through, or died). KEYS: queue, loop flag, the request's stream. ARGV: request JSON, new
# loop id, flag TTL. Returns 1: the caller must start a loop; -1: the request is lost (not
# queued, no loop, nothing on its stream: Redis lost it); 0: a loop has it or will.
RESTART_IF_STRANDED = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if not redis.call('LPOS', KEYS[1], ARGV[1]) then
  if redis.call('EXISTS', KEYS[3]) == 0 then return -1 end
  return 0
end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"""

# Rank 0 ending an idle loop. KEYS: queue, loop flag. ARGV: this loop's id.
# Returns 0: requests arrived, keep serving; 1: the flag is cleared, end the loop.
EXIT_IF_IDLE = """
if redis.call('LLEN', KEYS[1]) > 0 then return 0 end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""
