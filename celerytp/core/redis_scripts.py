"""Lua scripts shared by the leader and the ranks."""

# Delete a lock or lease key only while we still hold it (its value is our token).
RELEASE_IF_HOLDER = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# ARGV: holder token, new TTL in milliseconds. 1: extended; 0: the lock is someone else's or gone.
RENEW_IF_HOLDER = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"

# A model's request queue (keys.queue_key) is shared by the groups that serve the model. A
# request is in exactly one place: the queue, or the in-flight list of the group whose loop took
# it (keys.inflight_key), moved between them only by these scripts, so it is never lost and
# never held twice. A group's loop flag (keys.loop_key) is its lease on its in-flight list:
# when it lapses (the loop's rank 0 died or stalled), any other loop gives the list back.

# KEYS: queue, the request's marker (keys.request_key). ARGV: request JSON, queue limit, marker TTL.
# Returns 0: queued; -1: the queue is full; a string: a request with this id is already queued or
# running (its JSON): follow it instead of running it twice.
SUBMIT = """
local held = redis.call('GET', KEYS[2])
if held then return held end
if redis.call('LLEN', KEYS[1]) >= tonumber(ARGV[2]) then return -1 end
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('SET', KEYS[2], ARGV[1], 'EX', ARGV[3])
return 0
"""

# Rank 0 taking work for free rows. KEYS: queue, this group's in-flight list. ARGV: how many.
# Returns the requests taken, oldest first.
TAKE = """
local taken = {}
for i = 1, tonumber(ARGV[1]) do
  local item = redis.call('LMOVE', KEYS[1], KEYS[2], 'LEFT', 'RIGHT')
  if not item then break end
  taken[i] = item
end
return taken
"""

# A group's in-flight requests go back to the head of the queue, in their order (its loop failed).
# KEYS: in-flight list, queue. Returns how many.
GIVE_BACK = """
local n = 0
while redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT') do n = n + 1 end
return n
"""

# In-flight requests of groups whose lease lapsed go back to the queue. KEYS: queue, then pairs of
# (in-flight list, loop flag), one per group. Returns how many requests went back.
RECLAIM = """
local n = 0
for i = 2, #KEYS, 2 do
  if redis.call('EXISTS', KEYS[i + 1]) == 0 then
    while redis.call('LMOVE', KEYS[i], KEYS[1], 'RIGHT', 'LEFT') do n = n + 1 end
  end
end
return n
"""

# Rank 0 ending an idle loop. KEYS: queue, loop flag. ARGV: this loop's id.
# Returns 0: requests arrived, keep serving; 1: the flag is cleared, end the loop. A submitter
# queues first and then sets a free flag, so either this sees its request or it starts a loop.
EXIT_IF_IDLE = """
if redis.call('LLEN', KEYS[1]) > 0 then return 0 end
if redis.call('GET', KEYS[2]) == ARGV[1] then redis.call('DEL', KEYS[2]) end
return 1
"""
