"""The Lua scripts that keep a tenant's limits in Redis.

NOTE: every decision reads the clock of the Redis server (`TIME`), never the caller's, so
replicas with skewed clocks agree on windows, lease expiry and the month. A script runs
atomically: all of one admission's checks, then all of its takes, or none of them.

Keys of one tenant (all in one cluster slot through the `{tenant}` hash tag):
  <prefix>{t}:rpm      hash  second -> requests admitted in that second
  <prefix>{t}:tpm      hash  second -> tokens reserved (then settled) in that second
  <prefix>{t}:leases   zset  lease id -> expiry (unix ms)
  <prefix>{t}:monthly  hash  "YYYY-MM" -> tokens (only the current month is kept)
Every key carries a TTL that outlives what it holds, so idle tenants leave nothing.
Same semantics as `memory.InMemoryLimiter` (the tests run both through the same cases).
"""

# Days since 1970-01-01 <-> the UTC calendar (H. Hinnant's civil-date algorithms):
# civil_month(days) -> year, month; first_day(year, month) -> days of its first day.
CALENDAR = """
local function civil_month(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local function first_day(y, m)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5)
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end
"""

# KEYS: rpm, tpm, leases, monthly.
# ARGV: rpm limit, tpm limit, concurrency limit, monthly limit (-1: no such limit),
#       tokens, lease id, lease ttl (ms), window (s).
# Returns {reason ('' = admitted), now (s), rpm used, rpm reset (ms), tpm used, tpm reset (ms),
#          limit, used, requested, retry after (ms, -1: never fits), month, month end (ms)}.
ADMIT = (
    CALENDAR
    + """
local rpm_limit = tonumber(ARGV[1])
local tpm_limit = tonumber(ARGV[2])
local conc_limit = tonumber(ARGV[3])
local monthly_limit = tonumber(ARGV[4])
local tokens = tonumber(ARGV[5])
local lease_id = ARGV[6]
local lease_ttl = tonumber(ARGV[7])
local window = tonumber(ARGV[8])

local clock = redis.call('TIME')
local now_s = tonumber(clock[1])
local now_ms = now_s * 1000 + math.floor(tonumber(clock[2]) / 1000)
-- A count made in second b counts until b + window + 1: any `window` seconds hold at most
-- the limit (the window is up to a second longer than nominal, never shorter).
local function expiry_ms(sec) return (sec + window + 1) * 1000 end

local function load_window(key)
  local raw = redis.call('HGETALL', key)
  local items, total, stale = {}, 0, {}
  local oldest = now_s - window
  for i = 1, #raw, 2 do
    local sec, n = tonumber(raw[i]), tonumber(raw[i + 1])
    if sec < oldest then
      stale[#stale + 1] = raw[i]
    else
      items[#items + 1] = {sec, n}
      total = total + n
    end
  end
  if #stale > 0 then redis.call('HDEL', key, unpack(stale)) end
  table.sort(items, function(a, b) return a[1] < b[1] end)
  return items, total
end

local function reset_ms(items)
  for i = #items, 1, -1 do
    if items[i][2] > 0 then return math.max(0, expiry_ms(items[i][1]) - now_ms) end
  end
  return 0
end

local function retry_ms(items, total, need, limit)
  if total + need <= limit then return 0 end
  if need > limit then return -1 end
  local freed = 0
  for i = 1, #items do
    freed = freed + items[i][2]
    if total - freed + need <= limit then
      return math.max(0, expiry_ms(items[i][1]) - now_ms)
    end
  end
  return -1
end

local rpm_items, rpm_used = {}, 0
local tpm_items, tpm_used = {}, 0
local running = 0
local month, month_end, month_used = '', 0, 0
if rpm_limit >= 0 then rpm_items, rpm_used = load_window(KEYS[1]) end
if tpm_limit >= 0 then tpm_items, tpm_used = load_window(KEYS[2]) end
if conc_limit >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now_ms)
  running = redis.call('ZCARD', KEYS[3])
end
if monthly_limit >= 0 then
  local y, m = civil_month(math.floor(now_s / 86400))
  month = string.format('%04d-%02d', y, m)
  if m == 12 then y, m = y + 1, 1 else m = m + 1 end
  month_end = first_day(y, m) * 86400000
  month_used = tonumber(redis.call('HGET', KEYS[4], month) or 0)
end

local reason, limit, used, need, retry = '', 0, 0, 0, 0
if monthly_limit >= 0 and month_used + tokens > monthly_limit then
  reason, limit, used, need, retry = 'monthly_tokens', monthly_limit, month_used, tokens,
    month_end - now_ms
elseif tpm_limit >= 0 and tokens > tpm_limit then
  reason, limit, used, need, retry = 'tpm', tpm_limit, tpm_used, tokens, -1
elseif rpm_limit >= 0 and rpm_used + 1 > rpm_limit then
  reason, limit, used, need = 'rpm', rpm_limit, rpm_used, 1
  retry = retry_ms(rpm_items, rpm_used, 1, rpm_limit)
elseif tpm_limit >= 0 and tpm_used + tokens > tpm_limit then
  reason, limit, used, need = 'tpm', tpm_limit, tpm_used, tokens
  retry = retry_ms(tpm_items, tpm_used, tokens, tpm_limit)
elseif conc_limit >= 0 and running >= conc_limit then
  reason, limit, used, need, retry = 'concurrency', conc_limit, running, 1, 1000
end

local rpm_reset, tpm_reset
if reason ~= '' then
  rpm_reset, tpm_reset = reset_ms(rpm_items), reset_ms(tpm_items)
else
  local keep_until = expiry_ms(now_s) + 1000
  if rpm_limit >= 0 then
    redis.call('HINCRBY', KEYS[1], now_s, 1)
    redis.call('PEXPIREAT', KEYS[1], keep_until)
    rpm_used = rpm_used + 1
  end
  rpm_reset = math.max(0, expiry_ms(now_s) - now_ms)
  if tpm_limit >= 0 then
    redis.call('HINCRBY', KEYS[2], now_s, tokens)
    redis.call('PEXPIREAT', KEYS[2], keep_until)
    tpm_used = tpm_used + tokens
  end
  if tokens > 0 then tpm_reset = math.max(0, expiry_ms(now_s) - now_ms)
  else tpm_reset = reset_ms(tpm_items) end
  if conc_limit >= 0 then
    redis.call('ZADD', KEYS[3], now_ms + lease_ttl, lease_id)
    if redis.call('PTTL', KEYS[3]) < lease_ttl + 1000 then
      redis.call('PEXPIRE', KEYS[3], lease_ttl + 1000)
    end
  end
  if monthly_limit >= 0 then
    redis.call('HINCRBY', KEYS[4], month, tokens)
    if redis.call('HLEN', KEYS[4]) > 1 then
      for _, other in ipairs(redis.call('HKEYS', KEYS[4])) do
        if other ~= month then redis.call('HDEL', KEYS[4], other) end
      end
    end
    -- A day past the month's end, for settles of requests that straddle it.
    redis.call('PEXPIREAT', KEYS[4], month_end + 86400000)
  end
end
return {reason, now_s, rpm_used, rpm_reset, tpm_used, tpm_reset, limit, used, need, retry,
        month, month_end}
"""
)

# KEYS: leases. ARGV: lease id, lease ttl (ms). Returns 1 if renewed, 0 if the lease is gone.
# NOTE: a lease that is gone stays gone: recreating it could race with its settle and keep
# a slot taken until the lease expires.
RENEW = """
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then return 0 end
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], now_ms + ttl, ARGV[1])
if redis.call('PTTL', KEYS[1]) < ttl + 1000 then redis.call('PEXPIRE', KEYS[1], ttl + 1000) end
return 1
"""

# KEYS: tpm, leases, monthly. ARGV: tpm bucket ('' = none), used - reserved tokens,
# lease id ('' = none), month ('' = none). A bucket or month that has already expired is
# left alone (it no longer limits anything).
SETTLE = """
local delta = tonumber(ARGV[2])
local function adjust(key, field)
  if delta ~= 0 and redis.call('HEXISTS', key, field) == 1 then
    if redis.call('HINCRBY', key, field, delta) < 0 then redis.call('HSET', key, field, 0) end
  end
end
if ARGV[1] ~= '' then adjust(KEYS[1], ARGV[1]) end
if ARGV[3] ~= '' then redis.call('ZREM', KEYS[2], ARGV[3]) end
if ARGV[4] ~= '' then adjust(KEYS[3], ARGV[4]) end
return 1
"""
