#!lua name=kvbus
--[[
kvbus residency view: Redis functions (Redis >= 7.0). Key layout: docs/sinks-layout.md.

All functions take the key prefix P as ARGV[1] and derive their keys from it, so
they run on a standalone Redis (or its replicas), not on Redis Cluster.

Terms
  holder  (replica, dp_rank), interned as a small integer hid (0, 1, ...)
  tier    (medium, ownership, group_idx), interned as a code 0..K-1
  member  hid * K + tier code: one (holder, tier) holding a block
  raw     a block hash: 8 raw bytes, big-endian (schemas.events.canonical_hash)
  dec     the same hash as a signed 64-bit decimal string (member of the intset index)

Keys (P = prefix)
  P meta                 HASH  hid_next, tier_next, bL, bS (block table split state), blocks, entries
  P hid / P hname        HASH  holder name "<replica>#<dp>" <-> hid
  P rh                   HASH  replica -> space-separated hids of its dp ranks
  P tid / P tname / P trc  HASH  tier descriptor "<MEDIUM>|<ownership>|<group>" <-> code; code -> "1" if ref-counted
  P B:<bucket>           HASH  block table: field raw (8 bytes) -> packed members (3 bytes each, big-endian),
                               or "" when the block is "wide" (its members live in P W:<raw>)
  P W:<raw>              SET   members of a wide block (intset)
  P H:<hid>              HASH  holder state: p:<topic> -> "epoch seq index" (applied position),
                               f -> reset floor epoch, t:<code> -> "n L S origin_topic" per tier held
  P I:<hid>:<code>:<b>   SET   per (holder, tier) index of its blocks, dec members (intset)
  P R:<hid>:<code>       HASH  extra reference counts (count - 1) of ref-counted tiers: raw -> n
  P seen                 ZSET  hid -> last event ts (epoch seconds)
  P stale                ZSET  holder name -> when it was expired (epoch seconds)

The block table and each (holder, tier) index are linear-hashing tables: bucket of x (low 32 bits
of the hash) = x mod 2^L, or x mod 2^(L+1) if that is < S; a bucket is split when the table holds
more than LOAD entries per bucket on average, so buckets stay small enough for Redis's compact
encodings (listpack HASH, intset SET) whatever the number of blocks.
]]

local VERSION = '@VERSION@' -- replaced at load by a digest of this file (sinks/functions.py)
local K = 64               -- tier codes per holder; member = hid * K + code
local MAX_HOLDERS = 262144 -- 2^24 / K: members fit 3 bytes
local BLOCK_LOAD = 40      -- block-table fields per bucket (hash-max-listpack-entries >= 128)
local INDEX_LOAD = 160     -- index members per bucket (set-max-intset-entries >= 512)
local WIDE = 60            -- packed value bytes beyond which a block becomes wide (hash-max-listpack-value >= 64)
local TWO32 = 4294967296
local PAD_LEN = 1100 -- > hash-max-listpack-value: see holder_id
local function floor(x) return math.floor(x) end -- math is not reachable while the library loads

-- ---------------------------------------------------------------- hashes

local function raw_hilo(r)
  local b1, b2, b3, b4, b5, b6, b7, b8 = string.byte(r, 1, 8)
  return ((b1 * 256 + b2) * 256 + b3) * 256 + b4, ((b5 * 256 + b6) * 256 + b7) * 256 + b8
end

-- raw 8 bytes -> signed 64-bit decimal string (exact: works on 32-bit halves)
local function raw_to_dec(r)
  local hi, lo = raw_hilo(r)
  local sign = ''
  if hi >= 2147483648 then
    sign = '-'
    if lo == 0 then hi = TWO32 - hi else hi = TWO32 - 1 - hi; lo = TWO32 - lo end
  end
  -- v = hi * 2^32 + lo, 2^32 = 429496 * 10^4 + 7296
  local b = hi * 7296 + lo
  local b1 = floor(b / 10000)
  local top = hi * 429496 + b1
  local b0 = b - b1 * 10000
  if top > 0 then return string.format('%s%.0f%04d', sign, top, b0) end
  return string.format('%s%d', sign, b0)
end

-- signed 64-bit decimal string -> (hi, lo) 32-bit halves of its two's complement
local function dec_hilo(s)
  local neg = string.byte(s, 1) == 45
  local i = neg and 2 or 1
  local n = #s
  local len = (n - i + 1) % 5
  if len == 0 then len = 5 end
  local hi, lo = 0, 0
  while i <= n do
    local mul = 10 ^ len
    lo = lo * mul + tonumber(string.sub(s, i, i + len - 1))
    local carry = floor(lo / TWO32)
    lo = lo - carry * TWO32
    hi = hi * mul + carry
    i = i + len
    len = 5
  end
  if neg then
    if lo == 0 then hi = (TWO32 - hi) % TWO32 else hi = TWO32 - 1 - hi; lo = TWO32 - lo end
  end
  return hi, lo
end

local function dec_to_raw(s)
  local hi, lo = dec_hilo(s)
  return string.char(floor(hi / 16777216), floor(hi / 65536) % 256, floor(hi / 256) % 256, hi % 256,
    floor(lo / 16777216), floor(lo / 65536) % 256, floor(lo / 256) % 256, lo % 256)
end

-- low 32 bits of a raw hash (what the linear-hashing tables hash on)
local function lo32(r)
  local b5, b6, b7, b8 = string.byte(r, 5, 8)
  return ((b5 * 256 + b6) * 256 + b7) * 256 + b8
end

-- bucket of x in a linear-hashing table with m = 2^L and split pointer S
local function lh_bucket(x, m, S)
  local b = x % m
  if b < S then b = x % (m * 2) end
  return b
end

local function pack3(m)
  return string.char(floor(m / 65536), floor(m / 256) % 256, m % 256)
end

-- position of the 3-byte member code in packed string v (aligned), or nil
local function find3(v, code)
  local start = 1
  while true do
    local p = string.find(v, code, start, true)
    if not p then return nil end
    if (p - 1) % 3 == 0 then return p end
    start = p + 1
  end
end

local function unpack3(v)
  local out = {}
  for j = 1, #v, 3 do
    local a, b, c = string.byte(v, j, j + 2)
    out[#out + 1] = (a * 256 + b) * 256 + c
  end
  return out
end

-- ---------------------------------------------------------------- context

-- Shared state of one call: prefix, block-table split state and counters (written back by ctx_save).
local function ctx_load(P)
  local m = redis.call('HMGET', P .. 'meta', 'bL', 'bS', 'blocks', 'entries')
  local c = {P = P, L = tonumber(m[1]) or 0, S = tonumber(m[2]) or 0, blocks = tonumber(m[3]) or 0,
    entries0 = tonumber(m[4]) or 0, entries = tonumber(m[4]) or 0, blocks0 = tonumber(m[3]) or 0,
    L0 = tonumber(m[1]) or 0, S0 = tonumber(m[2]) or 0, tiers = {}, BP = P .. 'B:', bk = {}}
  c.m = 2 ^ c.L
  c.cap = BLOCK_LOAD * (c.m + c.S)
  return c
end

local function ctx_save(c)
  if c.L ~= c.L0 or c.S ~= c.S0 or c.blocks ~= c.blocks0 or c.entries ~= c.entries0 then
    redis.call('HSET', c.P .. 'meta', 'bL', c.L, 'bS', c.S, 'blocks', c.blocks, 'entries', c.entries)
  end
end

-- ---------------------------------------------------------------- block table

local function block_key(c, raw)
  local b = lh_bucket(lo32(raw), c.m, c.S)
  local k = c.bk[b]
  if not k then k = c.BP .. b; c.bk[b] = k end
  return k
end

local function split_block_bucket(c)
  local m = c.m
  local old = c.P .. 'B:' .. c.S
  local new = c.P .. 'B:' .. (c.S + m)
  local all = redis.call('HGETALL', old)
  local set, del = {}, {}
  for k = 1, #all, 2 do
    if lo32(all[k]) % (m * 2) >= m then
      set[#set + 1] = all[k]; set[#set + 1] = all[k + 1]; del[#del + 1] = all[k]
    end
  end
  if #del > 0 then
    redis.call('HSET', new, unpack(set))
    redis.call('HDEL', old, unpack(del))
  end
  c.S = c.S + 1
  if c.S >= m then c.L = c.L + 1; c.S = 0; c.m = m * 2 end
  c.cap = BLOCK_LOAD * (c.m + c.S)
end

-- add member m (packed: code) to block raw; true if it was not there
local function block_add(c, raw, m, code)
  local bkey = block_key(c, raw)
  local v = redis.call('HGET', bkey, raw)
  if not v then
    redis.call('HSET', bkey, raw, code)
    c.blocks = c.blocks + 1
    while c.blocks > c.cap do split_block_bucket(c) end
    return true
  end
  if v == '' then return redis.call('SADD', c.P .. 'W:' .. raw, m) == 1 end
  if find3(v, code) then return false end
  if #v + 3 > WIDE then
    local members = unpack3(v)
    members[#members + 1] = m
    redis.call('SADD', c.P .. 'W:' .. raw, unpack(members))
    redis.call('HSET', bkey, raw, '')
  else
    redis.call('HSET', bkey, raw, v .. code)
  end
  return true
end

-- remove member m (packed: code) from block raw; true if it was there
local function block_rem(c, raw, m, code)
  local bkey = block_key(c, raw)
  local v = redis.call('HGET', bkey, raw)
  if not v then return false end
  if v == '' then
    local wkey = c.P .. 'W:' .. raw
    if redis.call('SREM', wkey, m) == 0 then return false end
    if redis.call('EXISTS', wkey) == 0 then
      redis.call('HDEL', bkey, raw)
      c.blocks = c.blocks - 1
    end
    return true
  end
  local p = find3(v, code)
  if not p then return false end
  if #v == 3 then
    redis.call('HDEL', bkey, raw)
    c.blocks = c.blocks - 1
  else
    redis.call('HSET', bkey, raw, string.sub(v, 1, p - 1) .. string.sub(v, p + 3))
  end
  return true
end

-- ---------------------------------------------------------------- holders and tiers

local function holder_id(c, replica, name, create)
  local hid = redis.call('HGET', c.P .. 'hid', name)
  if hid then return tonumber(hid) end
  if not create then return nil end
  hid = redis.call('HINCRBY', c.P .. 'meta', 'hid_next', 1) - 1
  if hid >= MAX_HOLDERS then return nil end
  if hid == 0 then
    -- a long value makes Redis keep these tables as real hash tables (O(1) field access) instead of
    -- listpacks (linear scans: ~1 us per lookup at 256 holders); field "" is never a holder
    for _, t in ipairs({'hid', 'hname', 'rh'}) do redis.call('HSET', c.P .. t, '', string.rep('-', PAD_LEN)) end
  end
  redis.call('HSET', c.P .. 'hid', name, hid)
  redis.call('HSET', c.P .. 'hname', hid, name)
  local rh = redis.call('HGET', c.P .. 'rh', replica)
  redis.call('HSET', c.P .. 'rh', replica, rh and (rh .. ' ' .. hid) or tostring(hid))
  return hid
end

-- tier code and ref-count flag of a descriptor; creates it when asked (first flag wins)
local function tier_code(c, desc, rc, create)
  local t = c.tiers[desc]
  if t then return t[1], t[2] end
  local code = redis.call('HGET', c.P .. 'tid', desc)
  local flag
  if code then
    code = tonumber(code)
    flag = redis.call('HGET', c.P .. 'trc', code) == '1'
  else
    if not create then return nil, false end
    local nxt = tonumber(redis.call('HGET', c.P .. 'meta', 'tier_next') or '0')
    if nxt >= K then return nil, false end
    code = redis.call('HINCRBY', c.P .. 'meta', 'tier_next', 1) - 1
    redis.call('HSET', c.P .. 'tid', desc, code)
    redis.call('HSET', c.P .. 'tname', code, desc)
    redis.call('HSET', c.P .. 'trc', code, rc)
    flag = rc == '1'
  end
  c.tiers[desc] = {code, flag}
  return code, flag
end

-- derived fields of a (holder, tier) index state t: m = 2^L, split threshold, key prefix
local function tier_init(c, hid, code, t)
  t.m = 2 ^ t.L
  t.cap = INDEX_LOAD * (t.m + t.S)
  t.IP = c.P .. 'I:' .. hid .. ':' .. code .. ':'
  t.kc = {}
  return t
end

-- Holder state: {hid, key, pos = {topic -> {e, s, i}}, floor, tiers = {code -> {n, L, S, origin}}, dirty, gone}
local function holder_load(c, hid)
  local h = {hid = hid, key = c.P .. 'H:' .. hid, pos = {}, floor = -1, tiers = {}, dirty = {}, gone = {}}
  local all = redis.call('HGETALL', h.key)
  for k = 1, #all, 2 do
    local f, v = all[k], all[k + 1]
    local kind, rest = string.sub(f, 1, 2), string.sub(f, 3)
    if kind == 'p:' then
      local e, s, i = string.match(v, '^(%S+) (%S+) (%S+)$')
      h.pos[rest] = {tonumber(e), tonumber(s), tonumber(i)}
    elseif kind == 't:' then
      local n, L, S, o = string.match(v, '^(%d+) (%d+) (%d+) (.*)$')
      local code = tonumber(rest)
      h.tiers[code] = tier_init(c, hid, code, {n = tonumber(n), L = tonumber(L), S = tonumber(S), o = o})
    elseif f == 'f' then
      h.floor = tonumber(v)
    end
  end
  return h
end

local function holder_save(h)
  local set = {}
  for f, _ in pairs(h.dirty) do
    local kind, rest = string.sub(f, 1, 2), string.sub(f, 3)
    if kind == 'p:' then
      local p = h.pos[rest]
      set[#set + 1] = f; set[#set + 1] = string.format('%.0f %.0f %.0f', p[1], p[2], p[3])
    elseif kind == 't:' then
      local t = h.tiers[tonumber(rest)]
      if t then
        set[#set + 1] = f; set[#set + 1] = string.format('%.0f %d %d %s', t.n, t.L, t.S, t.o)
      end
    elseif f == 'f' then
      set[#set + 1] = f; set[#set + 1] = string.format('%.0f', h.floor)
    end
  end
  if #set > 0 then redis.call('HSET', h.key, unpack(set)) end
  local del = {}
  for f, _ in pairs(h.gone) do del[#del + 1] = f end
  if #del > 0 then redis.call('HDEL', h.key, unpack(del)) end
end

-- ---------------------------------------------------------------- per (holder, tier) index

local function split_index_bucket(t)
  local m = t.m
  local old = t.IP .. t.S
  local moved = {}
  for _, d in ipairs(redis.call('SMEMBERS', old)) do
    local _, lo = dec_hilo(d)
    if lo % (m * 2) >= m then moved[#moved + 1] = d end
  end
  if #moved > 0 then
    redis.call('SADD', t.IP .. (t.S + m), unpack(moved))
    redis.call('SREM', old, unpack(moved))
  end
  t.S = t.S + 1
  if t.S >= m then t.L = t.L + 1; t.S = 0; t.m = m * 2 end
  t.cap = INDEX_LOAD * (t.m + t.S)
end

local function index_key(t, raw)
  local b = lh_bucket(lo32(raw), t.m, t.S)
  local k = t.kc[b]
  if not k then k = t.IP .. b; t.kc[b] = k end
  return k
end

local function index_add(t, raw)
  redis.call('SADD', index_key(t, raw), raw_to_dec(raw))
  t.n = t.n + 1
  while t.n > t.cap do split_index_bucket(t) end
end

local function index_rem(t, raw)
  redis.call('SREM', index_key(t, raw), raw_to_dec(raw))
  t.n = t.n - 1
end

-- drop every entry of tier code of holder h; returns entries removed
local function clear_tier(c, h, code)
  local t = h.tiers[code]
  if not t then return 0 end
  local m = h.hid * K + code
  local packed = pack3(m)
  local removed = 0
  for b = 0, t.m + t.S - 1 do
    local key = t.IP .. b
    local decs = redis.call('SMEMBERS', key)
    for _, d in ipairs(decs) do
      if block_rem(c, dec_to_raw(d), m, packed) then removed = removed + 1 end
    end
    if #decs > 0 then redis.call('UNLINK', key) end
  end
  redis.call('UNLINK', c.P .. 'R:' .. h.hid .. ':' .. code)
  h.tiers[code] = nil
  h.dirty['t:' .. code] = nil
  h.gone['t:' .. code] = true
  c.entries = c.entries - removed
  return removed
end

local function clear_all(c, h)
  local codes = {}
  for code, _ in pairs(h.tiers) do codes[#codes + 1] = code end
  for _, code in ipairs(codes) do clear_tier(c, h, code) end
end

-- ---------------------------------------------------------------- events

local function store(c, h, topic, desc, rc, hashes)
  if hashes == '' then return end
  local code, counted = tier_code(c, desc, rc, true)
  local t = h.tiers[code]
  if not t then
    t = tier_init(c, h.hid, code, {n = 0, L = 0, S = 0, o = topic})
    h.tiers[code] = t
    h.gone['t:' .. code] = nil
  end
  h.dirty['t:' .. code] = true
  local m = h.hid * K + code
  local packed = pack3(m)
  for j = 1, #hashes, 8 do
    local raw = string.sub(hashes, j, j + 7)
    if block_add(c, raw, m, packed) then
      index_add(t, raw)
      c.entries = c.entries + 1
    elseif counted then
      redis.call('HINCRBY', c.P .. 'R:' .. h.hid .. ':' .. code, raw, 1)
    end
  end
end

local function remove(c, h, desc, hashes)
  local code, counted = tier_code(c, desc, '0', false)
  local t = code and h.tiers[code]
  if not t then return end
  h.dirty['t:' .. code] = true
  local m = h.hid * K + code
  local packed = pack3(m)
  local rkey = c.P .. 'R:' .. h.hid .. ':' .. code
  for j = 1, #hashes, 8 do
    local raw = string.sub(hashes, j, j + 7)
    local extra = counted and redis.call('HGET', rkey, raw)
    if extra then
      if tonumber(extra) <= 1 then redis.call('HDEL', rkey, raw) else redis.call('HINCRBY', rkey, raw, -1) end
    elseif block_rem(c, raw, m, packed) then
      index_rem(t, raw)
      c.entries = c.entries - 1
    end
  end
end

-- HMGET in chunks (Lua's unpack is limited to a few thousand values)
local function hmget(key, fields)
  local out = {}
  for j = 1, #fields, 1000 do
    local part = redis.call('HMGET', key, unpack(fields, j, math.min(j + 999, #fields)))
    for _, v in ipairs(part) do out[#out + 1] = v end
  end
  return out
end

local function newer(e, s, i, p)
  if not p then return true end
  if e ~= p[1] then return e > p[1] end
  if s ~= p[2] then return s > p[2] end
  return i > p[3]
end

--[[
kvbus_apply: apply a batch of consolidated events of ONE holder, exactly once.
ARGV[1] prefix, ARGV[2] replica, ARGV[3] dp_rank,
then 9 values per event, in delivery order (each topic's events in partition order):
  kind   S (BlockStored), R (BlockRemoved), C (AllBlocksCleared), X (Reset marker)
  topic  the Kafka topic it was read from (positions are kept per holder and topic)
  epoch, seq, index   the event's position
  ts     engine wall-clock seconds (last-seen time of the holder)
  tier   descriptor "<MEDIUM>|<ownership>|<group>" (S, R; "" otherwise)
  rc     "1" if the tier is ref-counted (used when the tier is first created), else "0"
  hashes concatenated 8-byte block hashes (S, R; "" otherwise)
An event is applied only if its position is greater than the holder's stored position for this topic
and its epoch is not below the holder's reset floor; the new position is stored in the same call.
C drops the holder's tiers that came from this topic. X drops them too, plus the tiers from other
topics whose applied epoch is older than the marker's, and raises the floor to the marker's epoch.
Returns {applied, skipped, entries_delta, resets, clears}.
]]
local function apply(keys, args)
  local c = ctx_load(args[1])
  local replica = args[2]
  local name = replica .. '#' .. args[3]
  local hid = holder_id(c, replica, name, true)
  if not hid then return redis.error_reply('kvbus: holder table full') end
  -- validate first: a function is not rolled back on error, so nothing may fail after a write
  for k = 4, #args, 9 do
    local kind = args[k]
    if not (tonumber(args[k + 2]) and tonumber(args[k + 3]) and tonumber(args[k + 4]) and tonumber(args[k + 5]))
      or not args[k + 8] or #args[k + 8] % 8 ~= 0 then
      return redis.error_reply('kvbus: malformed event at argument ' .. k)
    end
    if kind == 'S' then
      if args[k + 8] ~= '' and not tier_code(c, args[k + 6], args[k + 7], true) then
        return redis.error_reply('kvbus: tier table full (' .. K .. ' tiers), cannot add ' .. args[k + 6])
      end
    elseif kind ~= 'R' and kind ~= 'C' and kind ~= 'X' then
      return redis.error_reply('kvbus: unknown event kind ' .. tostring(kind))
    end
  end
  local h = holder_load(c, hid)
  local applied, skipped, resets, clears = 0, 0, 0, 0
  local maxts = nil
  for k = 4, #args, 9 do
    local kind, topic = args[k], args[k + 1]
    local e, s, i = tonumber(args[k + 2]), tonumber(args[k + 3]), tonumber(args[k + 4])
    if e < h.floor or not newer(e, s, i, h.pos[topic]) then
      skipped = skipped + 1
    else
      if kind == 'S' then
        store(c, h, topic, args[k + 6], args[k + 7], args[k + 8])
      elseif kind == 'R' then
        remove(c, h, args[k + 6], args[k + 8])
      elseif kind == 'C' then
        for code, t in pairs(h.tiers) do
          if t.o == topic then clear_tier(c, h, code) end
        end
        clears = clears + 1
      else -- 'X'
        for code, t in pairs(h.tiers) do
          local p = h.pos[t.o]
          if t.o == topic or not p or p[1] < e then clear_tier(c, h, code) end
        end
        if e > h.floor then h.floor = e; h.dirty['f'] = true end
        resets = resets + 1
      end
      h.pos[topic] = {e, s, i}
      h.dirty['p:' .. topic] = true
      applied = applied + 1
      local ts = tonumber(args[k + 5])
      if not maxts or ts > maxts then maxts = ts end
    end
  end
  holder_save(h)
  if maxts then
    redis.call('ZADD', c.P .. 'seen', 'GT', maxts, h.hid)
    redis.call('ZREM', c.P .. 'stale', name)
  end
  local delta = c.entries - c.entries0
  ctx_save(c)
  return {applied, skipped, delta, resets, clears}
end

--[[
kvbus_lookup (read-only, FCALL_RO): longest cached prefix of a chain of block hashes per holder.
ARGV[1] prefix, ARGV[2] chain: concatenated 8-byte hashes, block 0 first,
ARGV[3] W, then W pairs (name, weight): weight of a tier = weight of its ownership if given, else of
its medium, else of "*"; then candidate names (replica or "<replica>#<dp>"; none = every holder).
For every holder holding block 0: matched = number of leading blocks it holds in any tier; per tier,
the number of leading blocks held in that tier; score = sum over the matched blocks of the best
weight among the tiers holding it. Stops at the first block no remaining holder holds.
Returns {names, rids, nums, descs}: names[j] = "<replica>#<dp>" of the j-th holder, rids[j] = the hids
of all dp ranks of its replica ("h1 h2 ..."), nums = per holder: matched, score * 10^6 (integer),
n, then n pairs (tier code, run); descs = {code, descriptor, ...} for the codes used.
]]
local function lookup(keys, args)
  local c = ctx_load(args[1])
  local chain = args[2]
  local nw = tonumber(args[3])
  local weights = {}
  for k = 4, 3 + 2 * nw, 2 do weights[args[k]] = tonumber(args[k + 1]) end
  local cand = nil
  if #args > 3 + 2 * nw then
    cand = {}
    local names, rest = {}, {}
    for k = 4 + 2 * nw, #args do names[#names + 1] = args[k] end
    for j, hid in ipairs(hmget(c.P .. 'hid', names)) do
      if hid then cand[tonumber(hid)] = true else rest[#rest + 1] = names[j] end
    end
    if #rest > 0 then
      for _, rh in ipairs(hmget(c.P .. 'rh', rest)) do
        if rh then for x in string.gmatch(rh, '%d+') do cand[tonumber(x)] = true end end
      end
    end
  end
  local tw, tdesc = {}, {}
  local function weight(code)
    local w = tw[code]
    if w then return w end
    local d = redis.call('HGET', c.P .. 'tname', code) or '||0'
    local medium, own = string.match(d, '^([^|]*)|([^|]*)|')
    w = (own ~= '' and weights[own]) or weights[medium] or weights['*'] or 1
    tw[code] = w
    tdesc[code] = d
    return w
  end
  local matched, score, runs, order = {}, {}, {}, {}
  -- A block whose members are exactly those of the previous block (same packed string, or equal
  -- wide sets: same SCARD and SINTERCARD) extends the same holders and tiers: counted in `pend`
  -- and applied in one go, so a prefix shared by hundreds of holders costs O(1) per block.
  local last_best, last_ext = {}, {}
  local prev_v, prev_w, prev_card = nil, nil, 0
  local pend = 0
  local function flush()
    if pend == 0 then return end
    for hid, w in pairs(last_best) do
      matched[hid] = matched[hid] + pend
      score[hid] = score[hid] + w * pend
    end
    for j = 1, #last_ext, 2 do
      local r = runs[last_ext[j]]
      r[last_ext[j + 1]] = r[last_ext[j + 1]] + pend
    end
    pend = 0
  end
  for i = 1, #chain / 8 do
    local raw = string.sub(chain, 8 * i - 7, 8 * i)
    local v = redis.call('HGET', block_key(c, raw), raw)
    if not v then break end
    local wkey, card = nil, 0
    if v == '' then
      wkey = c.P .. 'W:' .. raw
      card = redis.call('SCARD', wkey)
    end
    if (v ~= '' and v == prev_v) or (wkey and prev_w and card == prev_card
        and redis.call('SINTERCARD', 2, prev_w, wkey) == card) then
      pend = pend + 1
    else
      flush()
      local members
      if wkey then
        members = redis.call('SMEMBERS', wkey)
        for j = 1, #members do members[j] = tonumber(members[j]) end
      else
        members = unpack3(v)
      end
      local best, ext = {}, {}
      local any = false
      for _, m in ipairs(members) do
        local hid = floor(m / K)
        local code = m - hid * K
        local ok
        if i == 1 then ok = (not cand) or cand[hid] else ok = matched[hid] == i - 1 end
        if ok then
          local w = weight(code)
          local b = best[hid]
          if not b then
            best[hid] = w
            any = true
            if i == 1 then order[#order + 1] = hid; runs[hid] = {}; matched[hid] = 0; score[hid] = 0 end
          elseif w > b then best[hid] = w end
          local r = runs[hid]
          if (r[code] or 0) == i - 1 then r[code] = i; ext[#ext + 1] = hid; ext[#ext + 1] = code end
        end
      end
      if not any then break end
      for hid, w in pairs(best) do
        matched[hid] = i
        score[hid] = score[hid] + w
      end
      last_best, last_ext = best, ext
      prev_v, prev_w, prev_card = v, wkey, card
    end
  end
  flush()
  local names, rhs, nums = {}, {}, {}
  if #order > 0 then
    names = hmget(c.P .. 'hname', order)
    local replicas = {}
    for j, n in ipairs(names) do replicas[j] = string.match(n, '^(.*)#%d+$') or n end
    rhs = hmget(c.P .. 'rh', replicas)
    for _, hid in ipairs(order) do
      nums[#nums + 1] = matched[hid]
      nums[#nums + 1] = floor(score[hid] * 1000000 + 0.5)
      local at = #nums + 1
      nums[at] = 0
      local k = 0
      for code, run in pairs(runs[hid]) do nums[#nums + 1] = code; nums[#nums + 1] = run; k = k + 1 end
      nums[at] = k
    end
  end
  local descs = {}
  for code, d in pairs(tdesc) do descs[#descs + 1] = code; descs[#descs + 1] = d end
  return {names, rhs, nums, descs}
end

local function expire_holder(c, hid, now)
  local h = holder_load(c, hid)
  clear_all(c, h)
  holder_save(h)
  redis.call('ZREM', c.P .. 'seen', hid)
  local name = redis.call('HGET', c.P .. 'hname', hid)
  if name then redis.call('ZADD', c.P .. 'stale', now, name) end
  return name
end

--[[
kvbus_expire: expire holders last seen at or before a cutoff (no events or heartbeat since).
ARGV[1] prefix, ARGV[2] cutoff (epoch s), ARGV[3] now (epoch s), ARGV[4] max holders to expire.
Drops all their entries, removes them from P seen, adds them to P stale (score = now); their
applied positions are kept (a redelivered old event stays a duplicate).
Returns the names expired.
]]
local function expire(keys, args)
  local c = ctx_load(args[1])
  local hids = redis.call('ZRANGEBYSCORE', c.P .. 'seen', '-inf', args[2], 'LIMIT', 0, tonumber(args[4]))
  local out = {}
  for _, hid in ipairs(hids) do out[#out + 1] = expire_holder(c, tonumber(hid), args[3]) end
  ctx_save(c)
  return out
end

--[[
kvbus_drop: forget one holder now (dead replica): drop its entries, list it as stale.
ARGV[1] prefix, ARGV[2] holder name "<replica>#<dp>", ARGV[3] now. Returns entries removed.
]]
local function drop(keys, args)
  local c = ctx_load(args[1])
  local hid = redis.call('HGET', c.P .. 'hid', args[2])
  if not hid then return 0 end
  local before = c.entries
  expire_holder(c, tonumber(hid), args[3])
  ctx_save(c)
  return before - c.entries
end

--[[
kvbus_heartbeat: the holder is alive at ts (no events needed).
ARGV[1] prefix, ARGV[2] replica, ARGV[3] dp_rank, ARGV[4] ts. Returns the holder id.
]]
local function heartbeat(keys, args)
  local c = ctx_load(args[1])
  local name = args[2] .. '#' .. args[3]
  local hid = holder_id(c, args[2], name, true)
  redis.call('ZADD', c.P .. 'seen', 'GT', args[4], hid)
  redis.call('ZREM', c.P .. 'stale', name)
  return hid
end

-- kvbus_version (read-only): the library version, to detect a stale or missing library.
local function version(keys, args) return VERSION end

redis.register_function('kvbus_apply', apply)
redis.register_function('kvbus_expire', expire)
redis.register_function('kvbus_drop', drop)
redis.register_function('kvbus_heartbeat', heartbeat)
redis.register_function{function_name = 'kvbus_lookup', callback = lookup, flags = {'no-writes'}}
redis.register_function{function_name = 'kvbus_version', callback = version, flags = {'no-writes'}}
