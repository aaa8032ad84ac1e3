#!lua name=kvbus
--[[
kvbus residency view: Redis functions (Redis >= 7.0). Key layout: docs/sinks-layout.md.

All functions take the key prefix P as ARGV[1] and derive their keys from it. They may be called
with no keys (a standalone Redis and its replicas) or with KEYS[1] = P .. 'meta' (and more keys
of P's slot, e.g. a key that never exists: see ShardedRedisStore): on Redis Cluster a P with a hash
tag ("kvbus:{s3}:") keeps every key of a call in one slot, and the declared key routes the call
there (docs/sinks-layout.md, "Redis Cluster"). A declared KEYS[1] that is not P .. 'meta' is refused.

Terms
  holder  (replica, dp_rank), interned as a small integer hid (0, 1, ...)
  tier    (medium, ownership, group_idx), interned as a code 0..K-1
  member  hid * K + tier code: one (holder, tier) holding a block
  raw     a block hash: 8 raw bytes, big-endian (kvbus.schemas.events.canonical_hash)

Keys (P = prefix)
  P meta                 HASH  hid_next, tier_next, bL, bS (block table split state), blocks, entries,
                               layout (LAYOUT: the version of this key layout)
  P hid / P hname        HASH  holder name "<replica>#<dp>" <-> hid
  P rh                   HASH  replica -> space-separated hids of its dp ranks
  P tid / P tname / P trc  HASH  tier descriptor "<MEDIUM>|<ownership>|<group>" <-> code; code -> "1" if ref-counted
  P B:<bucket>           HASH  block table: field raw (8 bytes) -> packed members (3 bytes each, big-endian,
                               sorted ascending), or "" when the block is "wide" (its members live in P W:<raw>)
  P W:<raw>              STRING members of a wide block, packed and sorted the same way
  P H:<hid>              HASH  holder state, binary values (struct formats POS, TSTATE, FLOOR below):
                               p:<topic> -> epoch, seq, index (applied position), f -> reset floor epoch,
                               t:<code> -> n, L, S of its index, then the origin topic, per tier held,
                               m -> the model it serves (absent: unknown), as its latest applied event said,
                               g:<group> -> its KV cache group's spec, text ("KV cache groups of a holder")
  P mh                   HASH  model -> space-separated hids of the live holders whose m is that model
  P gs                   HASH  hid -> its groups' specs, for holders with two groups or more (hybrid models)
  P I:<hid>:<code>:<b>   STRING per (holder, tier) index of its blocks: a toggle log of raws (8 bytes each);
                               a raw is in the index iff it occurs an odd number of times in its bucket
  P R:<hid>:<code>       HASH  extra reference counts (count - 1) of ref-counted tiers: raw -> n
  P seen                 ZSET  hid -> last event ts (epoch seconds)
  P stale                ZSET  holder name -> when it was expired (epoch seconds)
  P off                  HASH  "<topic>:<partition>" -> next Kafka offset to apply, written by kvbus_apply
                               with the batch it ends (where a sink resumes; sinks/consumer.py)
  P status               HASH  state ("ready" | "rebuilding"), since, ...: written by the sinks (sinks/rebuild.py)
  P X:<hid>              ZSET  predicted entries of a holder: raw -> expiry (server ms), written by kvbus_predict
  P xh                   HASH  hid -> "<expiry ms> <model>" of the holders with predicted entries ("predicted entries")
P meta also holds vid: the view's id, set when a view is created or rebuilt (kvbus_apply checks it).

The block table and each (holder, tier) index are linear-hashing tables: bucket of x (low 32 bits
of the hash) = x mod 2^L, or x mod 2^(L+1) if that is < S; a bucket is split when the table holds
more than LOAD entries per bucket on average, so buckets stay small enough for Redis's compact
encodings (listpack HASH) whatever the number of blocks; an index bucket is a plain string, split
(and compacted) the same way.

Why a toggle log: the block table is the truth, and it only ever adds a (holder, tier) member that is
absent or removes one that is present, so for one raw the adds and removes of a (holder, tier)
alternate. Logging each add and each remove as the raw itself keeps the index exact (odd count =
held) while a call writes it with one APPEND per touched bucket, no per-hash command and no decimal
conversion (what the intset index cost: ~2 us of the ~4.5 us per hash). A bucket whose log grows past
twice its expected live size plus INDEX_SLACK records is compacted (rewritten with one record per
live raw), so garbage stays below about the live size: amortized ~2 records of Lua work per toggle.
]]

local VERSION = '@VERSION@' -- replaced at load by a digest of this file and LAYOUT (sinks/view/functions.py)
local K = 64               -- tier codes per holder; member = hid * K + code
local MAX_HOLDERS = 262144 -- 2^24 / K: members fit 3 bytes
local BLOCK_LOAD = 16      -- block-table fields per bucket: short listpack scans (hash-max-listpack-entries >= 128)
local INDEX_LOAD = 1024    -- live index records per bucket on average (split threshold): 8 KB strings
local INDEX_SLACK = 64     -- garbage records a bucket may carry beyond its expected live size
local WIDE = 60            -- packed value bytes beyond which a block becomes wide (hash-max-listpack-value >= 64)
local LAYOUT = '@LAYOUT@'  -- key layout version (meta field layout), filled in at load from
                           -- kvbus.schemas.lookup.LAYOUT; 2: sorted member strings, wide = STRING;
                           -- 3: the per (holder, tier) index is a toggle log of raws in STRING buckets,
                           -- holder state values are binary (struct)
local rcall -- redis.call, set by each entry point (redis.call is not reachable while the library loads)
local byte, sub -- string.byte, string.sub, set likewise
local PAD_LEN = 1100 -- > hash-max-listpack-value: see holder_id
local floor -- math.floor, set by each entry point (math is not reachable while the library loads)

-- ---------------------------------------------------------------- hashes

-- low 32 bits of a raw hash (what the linear-hashing tables hash on)
local function lo32(r)
  local b5, b6, b7, b8 = string.byte(r, 5, 8)
  return ((b5 * 256 + b6) * 256 + b7) * 256 + b8
end

local function pack3(m)
  return string.char(floor(m / 65536), floor(m / 256) % 256, m % 256)
end

-- Member strings are sorted ascending (members are 3-byte big-endian integers), so one set of
-- members has exactly one string: a lookup compares two blocks' member sets with one string compare.

-- binary search for member m in sorted packed string v: (true, byte offset) if present, else
-- (false, byte offset where it would be inserted)
local function msearch(v, m)
  local lo, hi = 0, #v / 3 -- in members, [lo, hi)
  while lo < hi do
    local mid = floor((lo + hi) / 2)
    local p = 3 * mid + 1
    local a, b, c = byte(v, p, p + 2)
    local x = (a * 256 + b) * 256 + c
    if x == m then return true, p end
    if x < m then lo = mid + 1 else hi = mid end
  end
  return false, 3 * lo + 1
end

-- Block-table key pieces kept between calls (the Lua state lives as long as the library): the key
-- of bucket b >= 1000 is KEYQ[BP][(b - b % 1000) / 1000] .. D3[b % 1000], one concat of two cached
-- strings instead of a string.format per block (~0.1 us); KEYQ[BP][-1 - b] caches the keys of b < 1000
local D3 = nil     -- D3[n] = '000' .. '999' (built by the first call: string is not reachable at load)
local KEYQ = {}    -- block-table key prefix BP -> {[q] = BP .. q, [-1 - b] = BP .. b for b < 1000}
local nkeyq = 0

-- the key-piece cache of block-table prefix BP (at most 16 prefixes are kept)
local function key_pieces(BP)
  if not D3 then
    D3 = {}
    for j = 0, 999 do D3[j] = string.format('%03d', j) end
  end
  local KQ = KEYQ[BP]
  if not KQ then
    if nkeyq >= 16 then KEYQ, nkeyq = {}, 0 end
    KQ = {}
    KEYQ[BP] = KQ
    nkeyq = nkeyq + 1
  end
  return KQ
end

-- ---------------------------------------------------------------- context

-- Shared state of one call: prefix, block-table split state and counters (written back by ctx_save).
local function ctx_load(P, keys)
  if keys and keys[1] and keys[1] ~= P .. 'meta' then
    error('kvbus: KEYS[1] must be the prefix .. "meta" (' .. P .. 'meta), got ' .. keys[1])
  end
  local m = rcall('HMGET', P .. 'meta', 'bL', 'bS', 'blocks', 'entries', 'layout')
  if m[3] and m[3] ~= '0' and m[5] ~= LAYOUT then
    error('kvbus: the view under ' .. P .. ' was written with an older key layout; rebuild it (new prefix)')
  end
  local c = {P = P, L = tonumber(m[1]) or 0, S = tonumber(m[2]) or 0, blocks = tonumber(m[3]) or 0,
    entries0 = tonumber(m[4]) or 0, entries = tonumber(m[4]) or 0, blocks0 = tonumber(m[3]) or 0,
    L0 = tonumber(m[1]) or 0, S0 = tonumber(m[2]) or 0, tiers = {}, BP = P .. 'B:', WP = P .. 'W:'}
  c.KQ = key_pieces(c.BP)
  c.m = 2 ^ c.L
  c.cap = BLOCK_LOAD * (c.m + c.S)
  return c
end

local function ctx_save(c)
  if c.L ~= c.L0 or c.S ~= c.S0 or c.blocks ~= c.blocks0 or c.entries ~= c.entries0 then
    rcall('HSET', c.P .. 'meta', 'bL', c.L, 'bS', c.S, 'blocks', c.blocks, 'entries', c.entries, 'layout', LAYOUT)
  end
end

-- ---------------------------------------------------------------- block table

-- key of block-table bucket b (c.KQ: key_pieces(c.BP))
local function bucket_key(c, b)
  local KQ = c.KQ
  if b < 1000 then
    local k = KQ[-1 - b]
    if not k then k = c.BP .. b; KQ[-1 - b] = k end
    return k
  end
  local lo = b % 1000
  local q = (b - lo) / 1000
  local kq = KQ[q]
  if not kq then kq = c.BP .. q; KQ[q] = kq end
  return kq .. D3[lo]
end

-- key of the block-table bucket of a hash whose low 32 bits are x
local function block_key(c, x)
  local m = c.m
  local b = x % m
  if b < c.S then b = x % (m * 2) end
  return bucket_key(c, b)
end

local function split_block_bucket(c)
  local m = c.m
  local old = bucket_key(c, c.S)
  local new = bucket_key(c, c.S + m)
  local all = rcall('HGETALL', old)
  local set, del = {}, {}
  local m2 = m * 2
  for k = 1, #all, 2 do
    local b5, b6, b7, b8 = byte(all[k], 5, 8)
    if (((b5 * 256 + b6) * 256 + b7) * 256 + b8) % m2 >= m then
      set[#set + 1] = all[k]; set[#set + 1] = all[k + 1]; del[#del + 1] = all[k]
    end
  end
  if #del > 0 then
    rcall('HSET', new, unpack(set))
    rcall('HDEL', old, unpack(del))
  end
  c.S = c.S + 1
  if c.S >= m then c.L = c.L + 1; c.S = 0; c.m = m * 2 end
  c.cap = BLOCK_LOAD * (c.m + c.S)
end

-- add member m (packed: code) to block raw (x: its low 32 bits); returns added (it was not there),
-- new (the block was not in the table). guess_new: try HSETNX first (one command when the block is
-- new; one command more than HGET when it is not)
local function block_add(c, raw, x, m, code, guess_new)
  local bkey = block_key(c, x)
  local v
  if guess_new and rcall('HSETNX', bkey, raw, code) == 1 then
    v = nil
  else
    v = rcall('HGET', bkey, raw)
    if not v then rcall('HSET', bkey, raw, code) end
  end
  if not v then
    c.blocks = c.blocks + 1
    while c.blocks > c.cap do split_block_bucket(c) end
    return true, true
  end
  if v == '' then
    local wkey = c.WP .. raw
    local w = rcall('GET', wkey)
    local found, p = msearch(w, m)
    if found then return false, false end
    rcall('SET', wkey, sub(w, 1, p - 1) .. code .. sub(w, p))
    return true, false
  end
  local found, p = msearch(v, m)
  if found then return false, false end
  v = sub(v, 1, p - 1) .. code .. sub(v, p)
  if #v > WIDE then
    rcall('SET', c.WP .. raw, v)
    rcall('HSET', bkey, raw, '')
  else
    rcall('HSET', bkey, raw, v)
  end
  return true, false
end

-- remove member m from block raw (x: its low 32 bits); true if it was there
local function block_rem(c, raw, x, m)
  local bkey = block_key(c, x)
  local v = rcall('HGET', bkey, raw)
  if not v then return false end
  local wkey = nil
  if v == '' then
    wkey = c.WP .. raw
    v = rcall('GET', wkey)
  end
  local found, p = msearch(v, m)
  if not found then return false end
  if #v == 3 then
    if wkey then rcall('DEL', wkey) end
    rcall('HDEL', bkey, raw)
    c.blocks = c.blocks - 1
  elseif wkey then
    rcall('SET', wkey, sub(v, 1, p - 1) .. sub(v, p + 3))
  else
    rcall('HSET', bkey, raw, sub(v, 1, p - 1) .. sub(v, p + 3))
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

-- Strings of a holder and of its (holder, tier) pairs, kept between calls (they depend only on the
-- prefix and the ids; building them cost ~1.5 us per tier per call): NAMES[P][member] =
-- {index key prefix, ref-count key, holder-state field, packed member}, NAMES[P][-1 - hid] = state key
local NAMES, nnames = {}, 0

-- the names cache of prefix P (all of it is dropped past 65536 entries: a bound, not a working set)
local function names_of(P)
  if nnames >= 65536 then NAMES, nnames = {}, 0 end
  local byp = NAMES[P]
  if not byp then
    byp = {}
    NAMES[P] = byp
  end
  return byp
end

local function holder_key(c, hid)
  local byp = names_of(c.P)
  local k = byp[-1 - hid]
  if not k then k = c.P .. 'H:' .. hid; byp[-1 - hid] = k; nnames = nnames + 1 end
  return k
end

-- derived fields of a (holder, tier) index state t: m = 2^L, split threshold, key prefix
local function tier_init(c, hid, code, t)
  local member = hid * K + code
  local byp = names_of(c.P)
  local nm = byp[member]
  if not nm then
    nm = {c.P .. 'I:' .. hid .. ':' .. code .. ':', c.P .. 'R:' .. hid .. ':' .. code, 't:' .. code, pack3(member)}
    byp[member] = nm
    nnames = nnames + 1
  end
  t.m = 2 ^ t.L
  t.cap = INDEX_LOAD * (t.m + t.S)
  t.IP = nm[1]                 -- index bucket key prefix
  t.rkey = nm[2]               -- its reference counts
  t.field = nm[3]              -- its field in the holder state
  t.packed = nm[4]             -- member, 3 bytes
  t.member = member
  t.kc = {}                    -- bucket -> index bucket key, for this call (kept between calls, the
                               -- keys of a large view made the Lua heap ~1.5 MB instead of ~0.2)
  t.pend = {}                  -- toggles (raws) of this call not yet appended to the index (index_flush)
  t.fresh = true               -- whether its last stored block was new to the block table (block_add)
  return t
end

local POS = '>ddd'    -- holder state p:<topic>: epoch, seq, index
local TSTATE = '>dI4I4' -- holder state t:<code>: n, L, S, then the origin topic (after TSTATE_LEN bytes)
local TSTATE_LEN = 16
local FLOOR = '>d'    -- holder state f: the reset floor epoch

-- Holder state: {hid, key, pos = {topic -> {e, s, i}}, floor, tiers = {code -> {n, L, S, origin}},
-- groups = {group -> spec} (see group_note), dirty, gone}
local function holder_load(c, hid)
  local h = {hid = hid, key = holder_key(c, hid), P = c.P, pos = {}, floor = -1, tiers = {}, groups = {}, dirty = {},
    gone = {}, ptouched = {}, model = nil}
  local all = rcall('HGETALL', h.key)
  local unpack_ = struct.unpack
  for k = 1, #all, 2 do
    local f, v = all[k], all[k + 1]
    local kind = byte(f, 1)
    if kind == 112 then -- p:<topic>
      local e, s, i = unpack_(POS, v)
      h.pos[sub(f, 3)] = {e, s, i}
    elseif kind == 116 then -- t:<code>
      local n, L, S = unpack_(TSTATE, v)
      local code = tonumber(sub(f, 3))
      h.tiers[code] = tier_init(c, hid, code, {n = n, L = L, S = S, o = sub(v, TSTATE_LEN + 1)})
    elseif kind == 103 then -- g:<group>
      h.groups[sub(f, 3)] = v
    elseif f == 'f' then
      h.floor = unpack_(FLOOR, v)
    elseif f == 'm' then
      h.model = v
    end
  end
  return h
end

local function holder_save(h)
  local set = {}
  for topic, _ in pairs(h.ptouched) do
    local p = h.pos[topic]
    set[#set + 1] = 'p:' .. topic; set[#set + 1] = struct.pack(POS, p[1], p[2], p[3])
  end
  for f, _ in pairs(h.dirty) do
    if f == 'f' then
      set[#set + 1] = f; set[#set + 1] = struct.pack(FLOOR, h.floor)
    elseif f == 'm' then
      if h.model then set[#set + 1] = f; set[#set + 1] = h.model else h.gone['m'] = true end
    elseif byte(f, 1) == 103 then -- g:<group>
      set[#set + 1] = f; set[#set + 1] = h.groups[sub(f, 3)]
    else -- t:<code>
      local t = h.tiers[tonumber(sub(f, 3))]
      if t then
        set[#set + 1] = f; set[#set + 1] = struct.pack(TSTATE, t.n, t.L, t.S) .. t.o
      end
    end
  end
  if #set > 0 then redis.call('HSET', h.key, unpack(set)) end
  local del = {}
  for f, _ in pairs(h.gone) do del[#del + 1] = f end
  if #del > 0 then redis.call('HDEL', h.key, unpack(del)) end
  if h.gchanged then
    local gs, n = {}, 0
    for g, _ in pairs(h.groups) do n = n + 1; gs[n] = tonumber(g) end
    if n >= 2 then
      table.sort(gs)
      for j = 1, n do gs[j] = gs[j] .. ',' .. h.groups[tostring(gs[j])] end
      redis.call('HSET', h.P .. 'gs', h.hid, table.concat(gs, ';'))
    else
      redis.call('HDEL', h.P .. 'gs', h.hid)
    end
  end
end

-- ---------------------------------------------------------------- KV cache groups of a holder

-- What a holder's BlockStored events said of each of its KV cache groups (vLLM >= 0.22; hybrid models
-- have several): holder state g:<group> -> spec "<kind>,<window>,<bmax>,<bmin>" (kv_cache_spec_kind;
-- kv_cache_spec_sliding_window, "" when none; the largest and smallest block_size its events gave).
-- Derived from it, for lookups: P gs (HASH) hid -> "<group>,<spec>;<group>,<spec>..." (groups
-- ascending) of each holder with two groups or more. A Reset marker and expiry forget the groups.
local EVENT_SPEC = '^([%w_]+),(%d*),(%d+)$' -- a store's spec in kvbus_apply: "<kind>,<window>,<block_size>"
local VALID_SPECS, nvalid = {}, 0 -- the store specs found well-formed (kept between calls)
local GROUP_SPEC = '^[%w_]+,%d*,%d+,%d+$'   -- a group's spec in kvbus_restore

-- the group (a decimal string) of tier descriptor "<MEDIUM>|<ownership>|<group>"
local function desc_group(desc) return string.match(desc, '|(%d+)$') or '0' end

-- set group g's spec to v
local function group_set(h, g, v)
  if h.groups[g] == v then return end
  h.groups[g] = v
  h.dirty['g:' .. g] = true
  h.gone['g:' .. g] = nil
  h.gchanged = true
end

-- an applied BlockStored of tier desc said spec "<kind>,<window>,<block_size>" of its group
local function group_note(h, desc, spec)
  local noted = h.noted -- desc -> the last spec noted in this call: the same again changes nothing
  if not noted then noted = {}; h.noted = noted end
  if noted[desc] == spec then return end
  noted[desc] = spec
  local kind, window, bs = string.match(spec, EVENT_SPEC)
  local g = desc_group(desc)
  local bmax, bmin = tonumber(bs), tonumber(bs)
  local old = h.groups[g]
  if old then
    local omax, omin = string.match(old, ',(%d+),(%d+)$')
    bmax, bmin = math.max(bmax, tonumber(omax)), math.min(bmin, tonumber(omin))
  end
  group_set(h, g, kind .. ',' .. window .. ',' .. bmax .. ',' .. bmin)
end

local function groups_clear(h)
  for g, _ in pairs(h.groups) do
    h.dirty['g:' .. g] = nil
    h.gone['g:' .. g] = true
    h.gchanged = true
  end
  h.groups = {}
end

-- ---------------------------------------------------------------- models

-- the hids listed in string s ("3 17 42"), without hid (a new string; "" when none is left)
local function without_hid(s, hid)
  local out = {}
  for x in string.gmatch(s, '%d+') do
    if tonumber(x) ~= hid then out[#out + 1] = x end
  end
  return table.concat(out, ' ')
end

-- record that holder h serves model (nil or '': unknown), keeping P mh in step with its field m
local function set_model(c, h, model)
  if model == '' then model = nil end
  if h.model == model then return end
  local key = c.P .. 'mh'
  if h.model then
    local rest = without_hid(rcall('HGET', key, h.model) or '', h.hid)
    if rest == '' then rcall('HDEL', key, h.model) else rcall('HSET', key, h.model, rest) end
  end
  if model then
    local list = without_hid(rcall('HGET', key, model) or '', h.hid)
    rcall('HSET', key, model, list == '' and tostring(h.hid) or (list .. ' ' .. h.hid))
  end
  h.model = model
  h.dirty['m'] = true
  h.gone['m'] = nil
end

-- Parsed P mh lists kept between calls: MODELS[P .. '\0' .. model] = {s = the list as read, set = {hid -> true}}:
-- a lookup naming a model reads the list (one HGET) and parses it again only when it changed
local MODELS, nmodels = {}, 0

-- the set of hids of the live holders of model (the table is shared: never change it)
local function model_holders(c, model)
  local s = rcall('HGET', c.P .. 'mh', model) or ''
  local key = c.P .. '\0' .. model
  local e = MODELS[key]
  if e and e.s == s then return e.set end
  if not e then
    if nmodels >= 256 then MODELS, nmodels = {}, 0 end
    nmodels = nmodels + 1
  end
  local set = {}
  for x in string.gmatch(s, '%d+') do set[tonumber(x)] = true end
  MODELS[key] = {s = s, set = set}
  return set
end

-- ---------------------------------------------------------------- per (holder, tier) index

-- Raws of an index bucket's toggle log s that are held (odd count), in order of first occurrence.
local function index_live(s)
  local odd, order, n = {}, {}, 0
  for j = 1, #s, 8 do
    local r = sub(s, j, j + 7)
    local o = odd[r]
    if o == nil then n = n + 1; order[n] = r; odd[r] = true else odd[r] = not o end
  end
  local out, k = {}, 0
  for j = 1, n do
    local r = order[j]
    if odd[r] then k = k + 1; out[k] = r end
  end
  return out
end

-- write bucket key as exactly the raws in list (deleted when empty)
local function index_write(key, list)
  if #list == 0 then rcall('DEL', key) else rcall('SET', key, table.concat(list)) end
end

-- the records of toggle log s whose hash has bit L set (x mod 2m >= m), and the others: (moved, stay),
-- cut in runs of consecutive records going the same way. All records of one raw go the same way, so
-- both logs keep their parity (garbage moves along; index_append compacts it)
local function index_partition(s, m)
  local stay, moved = {}, {}
  local m2 = 2 * m
  local j, n = 1, #s
  while j <= n do
    local b5, b6, b7, b8 = byte(s, j + 4, j + 7)
    local up = (((b5 * 256 + b6) * 256 + b7) * 256 + b8) % m2 >= m
    local k = j + 8
    while k <= n do
      b5, b6, b7, b8 = byte(s, k + 4, k + 7)
      if ((((b5 * 256 + b6) * 256 + b7) * 256 + b8) % m2 >= m) ~= up then break end
      k = k + 8
    end
    if up then moved[#moved + 1] = sub(s, j, k - 1) else stay[#stay + 1] = sub(s, j, k - 1) end
    j = k
  end
  return table.concat(moved), table.concat(stay)
end

local function index_key(t, b)
  local k = t.kc[b]
  if not k then k = t.IP .. b; t.kc[b] = k end
  return k
end

-- split bucket S of index t into S and S + m
local function split_index_bucket(t)
  local m = t.m
  local old, new = index_key(t, t.S), index_key(t, t.S + m)
  local moved, stay = index_partition(rcall('GET', old) or '', m)
  if stay == '' then rcall('DEL', old) else rcall('SET', old, stay) end
  if moved ~= '' then rcall('SET', new, moved) end
  t.S = t.S + 1
  if t.S >= m then t.L = t.L + 1; t.S = 0; t.m = m * 2 end
  t.cap = INDEX_LOAD * (t.m + t.S)
end

-- records bucket b of index t may hold before it is compacted: twice its expected live count
-- (a bucket not split in the current round, S <= b < m, takes twice the hashes of a split one) + slack
local function index_limit(t, b)
  local share = (b >= t.S and b < t.m) and t.n / t.m or t.n / (2 * t.m)
  return 2 * share + INDEX_SLACK
end

-- append bucket key's pending toggles (list of raws); compact it when its log got too long
local function index_append(t, b, list)
  local key = index_key(t, b)
  local len = rcall('APPEND', key, table.concat(list))
  if len / 8 > index_limit(t, b) then index_write(key, index_live(rcall('GET', key))) end
end

-- write index t's pending toggles: split first (t.n already counts them), then one APPEND per bucket
local function index_flush(t)
  local pend = t.pend
  local np = #pend
  if np == 0 then return end
  while t.n > t.cap do split_index_bucket(t) end
  t.pend = {}
  local m, S = t.m, t.S
  if m == 1 and S == 0 then index_append(t, 0, pend); return end
  local groups, order = {}, {}
  local m2 = 2 * m
  for j = 1, np do
    local r = pend[j]
    local b5, b6, b7, b8 = byte(r, 5, 8)
    local x = ((b5 * 256 + b6) * 256 + b7) * 256 + b8
    local b = x % m
    if b < S then b = x % m2 end
    local g = groups[b]
    if not g then g = {}; groups[b] = g; order[#order + 1] = b end
    g[#g + 1] = r
  end
  for _, b in ipairs(order) do index_append(t, b, groups[b]) end
end

-- drop every entry of tier code of holder h; returns entries removed
local function clear_tier(c, h, code)
  local t = h.tiers[code]
  if not t then return 0 end
  index_flush(t)
  local m = h.hid * K + code
  local removed = 0
  for b = 0, t.m + t.S - 1 do
    local key = index_key(t, b)
    local s = rcall('GET', key)
    if s then
      for _, raw in ipairs(index_live(s)) do
        if block_rem(c, raw, lo32(raw), m) then removed = removed + 1 end
      end
      rcall('UNLINK', key)
    end
  end
  rcall('UNLINK', t.rkey)
  h.tiers[code] = nil
  h.dirty[t.field] = nil
  h.gone[t.field] = true
  c.entries = c.entries - removed
  return removed
end

local function clear_all(c, h)
  local codes = {}
  for code, _ in pairs(h.tiers) do codes[#codes + 1] = code end
  for _, code in ipairs(codes) do clear_tier(c, h, code) end
end

-- ---------------------------------------------------------------- events

-- BlockStored of n hashes at blob[p0 ...] (8 bytes each) into tier desc of holder h
local function store(c, h, topic, desc, rc, blob, p0, n)
  if n == 0 then return end
  local code, counted = tier_code(c, desc, rc, true)
  local t = h.tiers[code]
  if not t then
    t = tier_init(c, h.hid, code, {n = 0, L = 0, S = 0, o = topic})
    h.tiers[code] = t
    h.gone[t.field] = nil
  end
  h.dirty[t.field] = true
  local m, packed, pend = t.member, t.packed, t.pend
  local np, added = #pend, 0
  local guess = t.fresh -- was the tier's last stored block new to the table? (a prefill's blocks are, a
                        -- re-announcement's or an offload's are not): then try HSETNX first
  for j = p0, p0 + 8 * n - 1, 8 do
    local raw = sub(blob, j, j + 7)
    local b5, b6, b7, b8 = byte(blob, j + 4, j + 7)
    local add
    add, guess = block_add(c, raw, ((b5 * 256 + b6) * 256 + b7) * 256 + b8, m, packed, guess)
    if add then
      added = added + 1
      pend[np + added] = raw
    elseif counted then
      rcall('HINCRBY', t.rkey, raw, 1)
    end
  end
  t.fresh = guess
  t.n = t.n + added
  c.entries = c.entries + added
end

-- BlockRemoved of n hashes at blob[p0 ...] from tier desc of holder h
local function remove(c, h, desc, blob, p0, n)
  local code, counted = tier_code(c, desc, '0', false)
  local t = code and h.tiers[code]
  if not t then return end
  h.dirty[t.field] = true
  local m, pend = t.member, t.pend
  local np, gone = #pend, 0
  for j = p0, p0 + 8 * n - 1, 8 do
    local raw = sub(blob, j, j + 7)
    local extra = counted and rcall('HGET', t.rkey, raw)
    if extra then
      if tonumber(extra) <= 1 then rcall('HDEL', t.rkey, raw) else rcall('HINCRBY', t.rkey, raw, -1) end
    elseif block_rem(c, raw, lo32(raw), m) then
      gone = gone + 1
      pend[np + gone] = raw
    end
  end
  t.n = t.n - gone
  c.entries = c.entries - gone
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

-- cmd key [opt] args... in chunks of 1000 arguments (an even count keeps ZADD pairs whole)
local function call_chunks(cmd, key, opt, list)
  for j = 1, #list, 1000 do
    local last = math.min(j + 999, #list)
    if opt then rcall(cmd, key, opt, unpack(list, j, last)) else rcall(cmd, key, unpack(list, j, last)) end
  end
end

-- hids of the holders j = 1..nH with used[j] (one HMGET; unknown holders are created); nil if the
-- holder table is full
local function holder_ids(c, replicas, names, used, nH)
  local want, at = {}, {}
  for j = 1, nH do
    if used[j] then want[#want + 1] = names[j]; at[#at + 1] = j end
  end
  local hids = {}
  for k, hid in ipairs(hmget(c.P .. 'hid', want)) do
    local j = at[k]
    hids[j] = hid and tonumber(hid) or holder_id(c, replicas[j], names[j], true)
    if not hids[j] then return nil end
  end
  return hids
end

local function newer(e, s, i, p)
  if not p then return true end
  if e ~= p[1] then return e > p[1] end
  if s ~= p[2] then return s > p[2] end
  return i > p[3]
end

-- ---------------------------------------------------------------- predicted entries

--[[
Predicted entries (docs/lookup-protocol.md, "Predicted entries"): a router that sends a prompt to a
holder may record the prompt's blocks as predicted on that holder (kvbus_predict) for a short while,
until the engine's own BlockStored arrives. They are kept apart from the real entries, in the holder's
view (on Redis Cluster its shard):
  P X:<hid>  ZSET  raw (8 bytes) -> when the prediction expires (server ms, TIME); the key itself
                   expires (PEXPIREAT) with its latest prediction, so what never came goes by itself
  P xh       HASH  hid -> "<expiry ms> <model>" of each holder with predictions (model "" = none named);
                   it expires with its latest entry
The real entries stay the truth: an applied BlockStored of a predicted block drops the prediction (the
real entry counts from then on), an applied BlockRemoved drops it too, an applied AllBlocksCleared or
Reset marker, an expiry or a drop of the holder drops all of its predictions. Only lookups with the
option "\0predicted" W read them (see kvbus_lookup).
]]
local MAX_PREDICT_TTL = 600000 -- ms: a prediction lives a few seconds; anything beyond 10 minutes is refused
local PRED_CODE = K            -- the reply's code of the pseudo tier of predicted blocks (tier codes are < K)
local PRED_DESC = 'predicted||0' -- its descriptor in the reply (label "predicted")

-- the server's clock in ms
local function now_ms()
  local t = rcall('TIME')
  return tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end

-- a value of P xh: expiry (ms) and model ("" = none)
local function pred_entry(v)
  local e, m = string.match(v, '^(%d+) (.*)$')
  return tonumber(e), m
end

-- holder hid's predictions of the n hashes at blob[p0 ...] are gone (a store confirmed them, or a removal)
local function pred_forget(c, hid, blob, p0, n)
  local list = {}
  for j = p0, p0 + 8 * n - 1, 8 do list[#list + 1] = sub(blob, j, j + 7) end
  call_chunks('ZREM', c.P .. 'X:' .. hid, nil, list)
end

-- every prediction of holder hid is gone
local function pred_drop(c, hid)
  rcall('DEL', c.P .. 'X:' .. hid)
  rcall('HDEL', c.P .. 'xh', hid)
end

-- the holders with predictions (hid -> true), nil when the view has none (one EXISTS: what a batch
-- costs while no router predicts)
local function pred_holders(c)
  if rcall('EXISTS', c.P .. 'xh') == 0 then return nil end
  local out = {}
  for _, f in ipairs(rcall('HKEYS', c.P .. 'xh')) do out[tonumber(f)] = true end
  return out
end

-- the best weight among holder hid's tiers holding chain block j (members lo .. hi - 1 are its own),
-- nil when it holds it in none; vals caches the blocks' members (false: not in the table)
local function held_weight(c, chain, j, vals, lo, hi, weight)
  local v = vals[j]
  if v == nil then
    local raw = sub(chain, 8 * j - 7, 8 * j)
    v = rcall('HGET', block_key(c, lo32(raw)), raw) or false
    if v == '' then v = rcall('GET', c.WP .. raw) or false end
    vals[j] = v
  end
  if not v then return nil end
  local _, p = msearch(v, lo)
  local best = nil
  while p + 2 <= #v do
    local a, b, d = byte(v, p, p + 2)
    local x = (a * 256 + b) * 256 + d
    if x >= hi then break end
    local w = weight(x - lo)
    if not best or w > best then best = w end
    p = p + 3
  end
  return best
end

-- Holder hid's answer with its predictions: its answer without them (g: m blocks, score s, runs r) goes
-- on over the chain's next blocks while it holds each (in a tier: that tier's weight) or has it predicted
-- and not expired (weight pw); the pseudo tier PRED_CODE's run is the new matched. nil when no block is
-- added. n: blocks of the chain; now: the server's clock (ms).
local function pred_answer(c, chain, n, hid, g, pw, vals, weight, now)
  local key, lo = c.P .. 'X:' .. hid, hid * K
  local m, s, i, step = g.m, g.s, g.m + 1, 8 -- ZMSCORE 8 blocks, then twice as many each time (up to 512):
                                            -- a holder predicted for other prompts costs one short call
  while i <= n do
    local last = math.min(n, i + step - 1)
    step = math.min(step * 2, 512)
    local raws = {}
    for j = i, last do raws[#raws + 1] = sub(chain, 8 * j - 7, 8 * j) end
    local ex = rcall('ZMSCORE', key, unpack(raws))
    for j = i, last do
      local w = held_weight(c, chain, j, vals, lo, lo + K, weight)
      if not w then
        local e = ex[j - i + 1]
        if e and tonumber(e) > now then w = pw end
      end
      if not w then i = n + 1; break end
      m, s = m + 1, s + w
    end
    if i <= n then i = last + 1 end
  end
  if m == g.m then return nil end
  local r = {}
  for cd, run in pairs(g.r) do r[cd] = run end
  r[PRED_CODE] = m
  return {m = m, s = s, r = r}
end

-- Lookup with option "\0predicted" pw: the answers of the holders with live predictions (of model if
-- one is named; within the candidates cand), put into hy (hid -> answer; created if nil) where a
-- prediction lengthens them; holders only predicted are added to holders[]. Hybrid-model holders keep
-- their answers. G, grp: the walk's nodes and each holder's last one. Returns hy, nholders.
local function predicted_matches(c, chain, pw, model, cand, G, grp, holders, nholders, hy, weight, tdesc)
  if rcall('EXISTS', c.P .. 'xh') == 0 then return hy, nholders end
  local all = rcall('HGETALL', c.P .. 'xh')
  local now = now_ms()
  local hids = {}
  for k = 1, #all, 2 do
    local hid = tonumber(all[k])
    local e, m = pred_entry(all[k + 1])
    if e and e > now and (not model or m == model) and (not cand or cand[hid]) then hids[#hids + 1] = hid end
  end
  if #hids == 0 then return hy, nholders end
  local specs = rcall('EXISTS', c.P .. 'gs') == 1 and hmget(c.P .. 'gs', hids) or {}
  local known = {}
  for j = 1, nholders do known[holders[j]] = true end
  local n, vals, same = floor(#chain / 8), {}, {}
  for j, hid in ipairs(hids) do
    if not specs[j] then
      local gid = grp[hid] or 0
      local a = pred_answer(c, chain, n, hid, G[gid], pw, vals, weight, now)
      if a then
        local key = gid .. ':' .. a.m .. ':' .. a.s -- holders of one answer are one group of the reply
        a = same[key] or a
        same[key] = a
        hy = hy or {}
        hy[hid] = a
        tdesc[PRED_CODE] = PRED_DESC
        if not known[hid] then nholders = nholders + 1; holders[nholders] = hid end
      end
    end
  end
  return hy, nholders
end

--[[
kvbus_predict: record a chain's blocks as predicted on one holder for ttl ms (a router's routing
decision, before the engine's BlockStored; see "predicted entries").
ARGV[1] prefix, ARGV[2] replica, ARGV[3] dp_rank, ARGV[4] ttl (ms, an integer 1 .. MAX_PREDICT_TTL),
ARGV[5] chain (8-byte hashes, concatenated), optionally ARGV[6] the model the request is for ("" = none).
A block predicted again keeps the later expiry. A holder's predictions are for one model: predicting
for another model (or none after one) drops its earlier predictions. A holder the view does not know
(no event or heartbeat yet) gets none.
Returns the number of blocks recorded (0 for an unknown holder).
]]
local function predict(keys, args)
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
  local ttl, chain, model = tonumber(args[4]), args[5], args[6] or ''
  if #args < 5 or #args > 6 or not ttl or ttl < 1 or ttl > MAX_PREDICT_TTL or ttl ~= floor(ttl) then
    return redis.error_reply('kvbus: malformed arguments')
  end
  local hid = holder_id(c, args[2], args[2] .. '#' .. args[3], false)
  local n = floor(#chain / 8)
  if not hid or n == 0 then return 0 end
  local key, xh = c.P .. 'X:' .. hid, c.P .. 'xh'
  local now = now_ms()
  local exp = now + ttl
  local old = rcall('HGET', xh, hid)
  local oexp, omodel = nil, nil
  if old then oexp, omodel = pred_entry(old) end
  if old and omodel ~= model then
    rcall('DEL', key) -- another model's predictions
    oexp = nil
  else
    rcall('ZREMRANGEBYSCORE', key, '-inf', now)
  end
  local zadd, es = {}, string.format('%.0f', exp)
  for j = 1, 8 * n, 8 do zadd[#zadd + 1] = es; zadd[#zadd + 1] = sub(chain, j, j + 7) end
  call_chunks('ZADD', key, 'GT', zadd)
  local kexp = math.max(exp, oexp or 0)
  rcall('PEXPIREAT', key, string.format('%.0f', kexp))
  rcall('HSET', xh, hid, string.format('%.0f', kexp) .. ' ' .. model)
  local all, del, last = rcall('HGETALL', xh), {}, kexp
  for k = 1, #all, 2 do -- the holders whose predictions all expired leave P xh
    local e = pred_entry(all[k + 1]) or 0
    if e <= now then del[#del + 1] = all[k] elseif e > last then last = e end
  end
  if #del > 0 then rcall('HDEL', xh, unpack(del)) end
  rcall('PEXPIREAT', xh, string.format('%.0f', last))
  return n
end

--[[
kvbus_apply: apply a batch of consolidated events of one or more holders, exactly once.
ARGV[1] prefix, ARGV[2] nH, then nH pairs (replica, dp_rank);
then nT, then nT topic names; then nD, then nD pairs (tier descriptor "<MEDIUM>|<ownership>|<group>",
rc = "1" if that tier is reference-counted (used when the tier is first created) else "0");
last ARGV: the events, each holder's in delivery order (each topic's events in partition order), each
a 39-byte big-endian header followed by its hashes (sinks/view/redis_store.py: EVENT_HEADER):
  kind (u8: 1 BlockStored, 2 BlockRemoved, 3 AllBlocksCleared, 4 Reset marker, 5 BlockStored with the
  spec of its KV cache group), holder (u16, 1-based index into the holders), topic (u16, 1-based index
  into the topics), epoch, seq (doubles), index (u32), ts (double, engine seconds), tier (u16, 1-based
  index into the descriptors, 0 if none), n (u32); for kind 5 a spec: one byte, its length, then
  "<kv_cache_spec_kind>,<kv_cache_spec_sliding_window or empty>,<block_size>" (recorded for the
  tier's group when the store is applied: see "KV cache groups of a holder"); then n 8-byte hashes.
An event is applied only if its position (epoch, seq, index) is greater than its holder's stored
position for its topic and its epoch is not below the holder's reset floor; the new positions are
stored in the same call. AllBlocksCleared drops the holder's tiers that came from the same topic; a
Reset marker drops those too, plus the tiers from other topics whose applied epoch is older than the
marker's, and raises the floor to the marker's epoch.
Optional last two ARGV (both or neither): the view id (P meta vid) the caller expects, "" to not
check; then the Kafka offsets, one line "<topic>:<partition>\t<expected>\t<new>" per partition of
the batch: P off must hold <expected> ("" = none, "*" = anything) for it, and <new> ("" = leave it) is stored with
this call's changes, atomically. Either check failing (the view was flushed, lost, rebuilt, rolled
back, or another sink took the partition) fails the call with "view changed" before any write. The
sink resumes from P off, so a view that rolled back (AOF everysec, failover) is replayed forward
from exactly where it stands.
After those two, optionally: nH model names, one per holder in order ("" = not named): each applied
event records its holder's model (P H:<hid> m, P mh), so a holder's model is the one its latest applied
event named; a call without them leaves every model as it is.
Returns {applied, skipped, entries_delta, resets, clears} (totals over all holders).
]]
local HEADER = '>BHHddI4dHI4'
local HEADER_LEN = 39

local function apply(keys, args)
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
  local nH = tonumber(args[2]) or 0
  local replicas, names = {}, {}
  for j = 1, nH do replicas[j] = args[1 + 2 * j]; names[j] = args[1 + 2 * j] .. '#' .. args[2 + 2 * j] end
  local at = 3 + 2 * nH
  local nT = tonumber(args[at]) or 0
  local topics = {}
  for j = 1, nT do topics[j] = args[at + j] end
  at = at + nT + 1
  local nD = tonumber(args[at]) or 0
  local descs, rcs = {}, {}
  for j = 1, nD do descs[j] = args[at + 2 * j - 1]; rcs[j] = args[at + 2 * j] end
  local blob = args[at + 2 * nD + 1]
  local last = at + 2 * nD + 1
  if not blob or (#args ~= last and #args ~= last + 2 and (nH == 0 or #args ~= last + 2 + nH)) then
    return redis.error_reply('kvbus: malformed arguments')
  end
  local vid, offsets = args[last + 1], args[last + 2]
  local models = #args > last + 2 and last + 2 or nil -- models[j] = args[models + j]
  if vid and vid ~= '' and rcall('HGET', args[1] .. 'meta', 'vid') ~= vid then
    return redis.error_reply('kvbus: view changed (expected view ' .. vid .. '): resync')
  end
  local off = {} -- HSET arguments: the new offsets
  if offsets and offsets ~= '' then
    for line in string.gmatch(offsets, '[^\n]+') do
      local f, want, new = string.match(line, '^(.*)\t(.*)\t(.*)$')
      if not f then return redis.error_reply('kvbus: malformed offsets') end
      if want ~= '*' and (rcall('HGET', args[1] .. 'off', f) or '') ~= want then
        return redis.error_reply('kvbus: view changed (' .. f .. ' is not at offset ' .. want .. '): resync')
      end
      if new ~= '' then off[#off + 1] = f; off[#off + 1] = new end
    end
  end
  -- validate everything first: a function is not rolled back on error, so nothing may fail after
  -- the first write (creating a holder id or a tier code is harmless); then decode again while applying
  local pos, len = 1, #blob
  local used = {}
  while pos <= len do
    if pos + HEADER_LEN - 1 > len then return redis.error_reply('kvbus: truncated event header') end
    local kind, hi, ti, _, _, _, _, di, n, nxt = struct.unpack(HEADER, blob, pos)
    if kind == 5 then -- the spec before the hashes
      local sl = byte(blob, nxt) or 0
      local spec = sub(blob, nxt + 1, nxt + sl)
      if not VALID_SPECS[spec] then
        if not string.match(spec, EVENT_SPEC) then
          return redis.error_reply('kvbus: malformed group spec at byte ' .. pos)
        end
        if nvalid >= 256 then VALID_SPECS, nvalid = {}, 0 end
        VALID_SPECS[spec], nvalid = true, nvalid + 1
      end
      nxt = nxt + 1 + sl
    end
    if nxt + 8 * n - 1 > len or not topics[ti] or not names[hi] or kind < 1 or kind > 5 then
      return redis.error_reply('kvbus: malformed event at byte ' .. pos)
    end
    if (kind <= 2 or kind == 5) and not descs[di] then
      return redis.error_reply('kvbus: event without tier at byte ' .. pos)
    end
    if (kind == 1 or kind == 5) and n > 0 and not tier_code(c, descs[di], rcs[di], true) then
      return redis.error_reply('kvbus: tier table full (' .. K .. ' tiers), cannot add ' .. descs[di])
    end
    used[hi] = true
    pos = nxt + 8 * n
  end
  local hids = holder_ids(c, replicas, names, used, nH)
  if not hids then return redis.error_reply('kvbus: holder table full') end
  local preds = pred_holders(c) -- holders with predicted entries (nil: none)
  local hs, order, maxts = {}, {}, {}
  local applied, skipped, resets, clears = 0, 0, 0, 0
  pos = 1
  while pos <= len do
    local kind, hi, ti, e, s, i, ts, di, n, nxt = struct.unpack(HEADER, blob, pos)
    local spec = nil
    if kind == 5 then
      local sl = byte(blob, nxt)
      spec, nxt, kind = sub(blob, nxt + 1, nxt + sl), nxt + 1 + sl, 1
    end
    pos = nxt + 8 * n
    local h = hs[hi]
    if not h then h = holder_load(c, hids[hi]); hs[hi] = h; order[#order + 1] = hi end
    local topic = topics[ti]
    if e < h.floor or not newer(e, s, i, h.pos[topic]) then
      skipped = skipped + 1
    else
      if kind == 1 then
        store(c, h, topic, descs[di], rcs[di], blob, nxt, n)
        if spec then group_note(h, descs[di], spec) end
      elseif kind == 2 then
        remove(c, h, descs[di], blob, nxt, n)
      elseif kind == 3 then
        for code, t in pairs(h.tiers) do
          if t.o == topic then clear_tier(c, h, code) end
        end
        clears = clears + 1
      else
        for code, t in pairs(h.tiers) do
          local p = h.pos[t.o]
          if t.o == topic or not p or p[1] < e then clear_tier(c, h, code) end
        end
        if e > h.floor then h.floor = e; h.dirty['f'] = true end
        groups_clear(h)
        resets = resets + 1
      end
      if preds and preds[h.hid] then -- a store confirms its predicted blocks, anything else drops them
        if kind <= 2 then
          pred_forget(c, h.hid, blob, nxt, n)
        else
          pred_drop(c, h.hid)
          preds[h.hid] = nil
        end
      end
      local p = h.pos[topic]
      if p then p[1], p[2], p[3] = e, s, i else h.pos[topic] = {e, s, i} end
      h.ptouched[topic] = true
      if models then set_model(c, h, args[models + hi]) end
      applied = applied + 1
      if not maxts[hi] or ts > maxts[hi] then maxts[hi] = ts end
    end
  end
  local seen, back = {}, {} -- ZADD arguments (ts, hid, ...); names of holders with applied events
  for _, hi in ipairs(order) do
    for _, t in pairs(hs[hi].tiers) do index_flush(t) end
    holder_save(hs[hi])
    if maxts[hi] then
      seen[#seen + 1] = string.format('%.6f', maxts[hi]); seen[#seen + 1] = hids[hi]
      back[#back + 1] = names[hi]
    end
  end
  call_chunks('ZADD', c.P .. 'seen', 'GT', seen)
  if #back > 0 and rcall('EXISTS', c.P .. 'stale') == 1 then call_chunks('ZREM', c.P .. 'stale', nil, back) end
  local delta = c.entries - c.entries0
  ctx_save(c)
  call_chunks('HSET', c.P .. 'off', nil, off)
  return {applied, skipped, delta, resets, clears}
end

--[[
kvbus_lookup (read-only, FCALL_RO): longest cached prefix of a chain of block hashes per holder.
ARGV[1] prefix, ARGV[2] chain: concatenated 8-byte hashes, block 0 first,
ARGV[3] weights "NAME=W,NAME=W,...": weight of a tier = weight of its ownership if given, else of
its medium, else of "*" (else 1); ARGV[4...] candidate names (replica or "<replica>#<dp>"; none = all),
and options among them: an argument that starts with a NUL byte names an option, the next argument
is its value. Option "\0model" NAME: only holders whose model (P H:<hid> m) is NAME count, within the
candidates if any are named; holders of an unknown model never match a named model. Option "\0predicted"
W (a number >= 0): predicted entries count too ("predicted entries"): a holder's answer goes on past its
last held block over the blocks it has predicted (weight W each) or holds, and the reply lists the pseudo
tier code K (descriptor "predicted||0") with the new matched as its run; holders only predicted are answered
too. Only predictions made naming the lookup's model count when it names one. Hybrid-model holders are
answered without predictions.
For every holder holding block 0: matched = number of leading blocks it holds in any tier; per tier,
the number of leading blocks held in that tier; score = sum over the matched blocks of the best
weight among the tiers holding it. Stops at the first block no remaining holder holds.
A holder with two KV cache groups or more (P gs) has matched = the prefix vLLM's hybrid coordinator
would hit ("lookup: hybrid models"), left out when that is none.
Holders with the same answer are returned as one group (typically: all holders of a shared system
prompt). Returns {head, hids, descs}:
  head  per group: matched, score * 10^6 (integer), n, then n pairs (tier code, run); when an answer is
        hybrid, then per group (same order) k, then k pairs (KV cache group, its run)
  hids  per group: its holder ids, 4-byte big-endian each
  descs {code, descriptor, ...} for the tier codes used
]]
local P2 = {}
for j = 0, 31 do P2[j] = 2 ^ j end

-- Lookup: the groups created at the last block whose members changed (``fresh``, ``nfresh`` of them)
-- extend by ``pend`` further blocks with the same members: matched blocks, score and each tier's run.
local function extend_groups(fresh, nfresh, pend)
  for f = 1, nfresh do
    local g = fresh[f]
    g.m = g.m + pend
    g.s = g.s + g.bw * pend
    local r, ext = g.r, g.ext
    for e = 1, #ext do local cd = ext[e]; r[cd] = r[cd] + pend end
  end
end

-- ---------------------------------------------------------------- lookup: hybrid models

--[[
A holder with two KV cache groups or more (P gs) is answered as vLLM 0.33's HybridKVCacheCoordinator
.find_longest_cache_hit would hit the chain (docs/lookup-protocol.md, "Hybrid models"): matched is the
hit, in chain blocks, and each group's run is that group's own hit (find_longest_cache_hit_per_group),
both over the blocks the walk found the holder holding (max_cache_hit_length = matched blocks in any
tier). The walk leaves each holder its history as a chain of nodes (node.p the older one), one per
stretch of blocks over which no holder's tiers change (node.i0 its first block, node.l / node.h its
tier codes as bit sets, node.bw its best weight, node.a the first of the nodes before it with the same
tiers); the rule works on the runs of blocks each group holds, never block by block. Positions below:
group blocks 0-based, chain blocks 1-based, lengths in tokens as vLLM counts them.
]]
local RULES = {full_attention = 'full', mla_attention = 'full', sink_full_attention = 'full',
  sliding_window = 'sliding', sliding_window_mla = 'sliding', mamba = 'mamba'}
-- (any other kind: unknown, chunked_local_attention whose chunk size events do not carry, later kinds:
-- the full-attention rule, which never answers more than any manager would)
local FINE_KINDS = {full_attention = true, mla_attention = true, sink_full_attention = true, mamba = true}
-- (the kinds whose managers take hits inside a block: supports_fine_grained_hash_lookup)
local SPECS, nspecs = {}, 0 -- P gs value -> its plan (plan_of), kept between calls

local function gcd(a, b)
  while b > 0 do a, b = b, a % b end
  return a
end

-- The plan of a P gs value (what depends on the groups only, kept between calls): the hash block unit
-- (gcd of the block sizes), the alignment of hits (lcm of the groups' block sizes, or the unit when
-- vLLM's partial_hash_hits_enabled holds: a Mamba group of larger blocks than the unit, every other
-- group able to hit inside a block or of the unit's size), the groups g[1..n], and the spec groups
-- (groups of one kind, window and block size, looked up together as vLLM's SpecGroup) in vLLM's
-- order, full attention first: {rule, size, s = size / unit, need (blocks a window needs), of =
-- indices into g, gs = group ids}; simple: vLLM's one-pass case (two spec groups, full attention first).
local function plan_of(v)
  local p = SPECS[v]
  if p then return p end
  local gs = {}
  for g, kind, window, bmax, bmin in string.gmatch(v, '(%d+),([%w_]+),(%d*),(%d+),(%d+)') do
    local rule, w = RULES[kind] or 'full', tonumber(window)
    if rule == 'sliding' and not (w and w > 0) then rule = 'full' end
    gs[#gs + 1] = {g = tonumber(g), kind = kind, rule = rule, window = w, bmax = tonumber(bmax), bmin = tonumber(bmin)}
  end
  local unit, lcm = 0, 1
  for _, s in ipairs(gs) do unit = gcd(gcd(unit, s.bmax), s.bmin) end
  if unit == 0 then unit = 1 end
  local fine, able = false, true
  for _, s in ipairs(gs) do
    s.size = s.bmax > 0 and s.bmax or unit
    lcm = lcm / gcd(lcm, s.size) * s.size
    if s.rule == 'mamba' and s.size > unit then fine = true end
    if not FINE_KINDS[s.kind] and s.size ~= unit then able = false end
  end
  local sgs, byk, nfull = {}, {}, 0
  for j, s in ipairs(gs) do
    local key = s.kind .. ',' .. (s.rule == 'sliding' and s.window or '') .. ',' .. s.size
    local sg = byk[key]
    if sg then
      sg.of[#sg.of + 1] = j
      sg.gs[#sg.gs + 1] = s.g
    else
      sg = {rule = s.rule, size = s.size, s = s.size / unit, of = {j}, gs = {s.g},
        need = s.rule == 'sliding' and math.ceil((s.window - 1) / s.size) or 1}
      byk[key] = sg
      if s.rule == 'full' then nfull = nfull + 1; table.insert(sgs, nfull, sg) else sgs[#sgs + 1] = sg end
    end
  end
  p = {unit = unit, align = (fine and able) and unit or lcm, g = gs, sgs = sgs, simple = #sgs == 2 and nfull >= 1}
  if nspecs >= 1024 then SPECS, nspecs = {}, 0 end
  SPECS[v] = p
  nspecs = nspecs + 1
  return p
end

-- the groups (set) the tier codes of bit sets l (codes < 32), h (codes >= 32) belong to; gof: code -> group
local function node_groups(l, h, gof, memo)
  local t1 = memo[l]
  if not t1 then t1 = {}; memo[l] = t1 end
  local s = t1[h]
  if s then return s end
  s = {}
  for code, g in pairs(gof) do
    local bits, k = l, code
    if code >= 32 then bits, k = h, code - 32 end
    if floor(bits / P2[k]) % 2 == 1 then s[g] = true end
  end
  t1[h] = s
  return s
end

-- Runs below are flat arrays {a1, b1, a2, b2, ...} of 0-based positions [a, b], highest run first.

-- the common part of two lists of runs
local function intersect(x, y)
  local out, n, i, j = {}, 0, 1, 1
  while i < #x and j < #y do
    local a, b = math.max(x[i], y[j]), math.min(x[i + 1], y[j + 1])
    if a <= b then out[n + 1] = a; out[n + 2] = b; n = n + 2 end
    if x[i] > y[j] then i = i + 2 else j = j + 2 end
  end
  return out
end

-- the group-block runs of a group of s chain blocks per block (its block k ends at chain position (k + 1) s - 1)
local function block_runs(cr, s)
  if s == 1 then return cr end
  local out, n = {}, 0
  for i = 1, #cr, 2 do
    local ka, kb = math.ceil((cr[i] + 1) / s) - 1, floor((cr[i + 1] + 1) / s) - 1
    if ka <= kb then
      if n > 0 and out[n - 1] <= kb + 1 then
        if ka < out[n - 1] then out[n - 1] = ka end
      else
        out[n + 1] = ka; out[n + 2] = kb; n = n + 2
      end
    end
  end
  return out
end

-- the last position in [lo, hi] of runs r, or nil
local function last_held(r, lo, hi)
  for i = 1, #r, 2 do
    if r[i] <= hi then
      local j = math.min(r[i + 1], hi)
      if j >= lo then return j end
      return nil
    end
  end
  return nil
end

-- the hit (tokens) of a spec group (of plan p; its chain runs cr, group-block runs R) no longer than max
-- tokens: its manager's find_longest_cache_hit (FullAttentionManager, SlidingWindowManager,
-- MambaManager) with the plan's alignment; n chain blocks
local function manager_hit(sg, cr, R, max, p, n)
  local size, unit, align = sg.size, p.unit, p.align
  local L = floor(max / size)
  local fine = align < size and size % align == 0
  if sg.rule == 'full' then
    local nf, last = 0, #R
    if last > 0 and R[last - 1] == 0 then nf = math.min(R[last] + 1, L) end
    local hit = nf * size
    if fine then -- phase 2: the hashes inside the next block, last first
      local s = sg.s
      local j = last_held(cr, nf * s, math.min(nf * s + s - 1, floor(max / unit), n) - 1)
      if j then hit = (j + 1) * unit end
    end
    return hit - hit % align
  end
  if sg.rule == 'mamba' and fine then -- the last state at any hash block
    local j = last_held(cr, 0, math.min(floor(max / unit), n) - 1)
    return j and (j + 1) * unit or 0
  end
  -- sliding window (need contiguous blocks ending the hit, fewer from block 0) and Mamba (need 1): the
  -- last run holding a block that ends on the alignment with enough blocks before it
  local q, need = align / size, sg.need
  for i = 1, #R, 2 do
    local a = R[i]
    if a <= L - 1 then
      local t = floor((math.min(R[i + 1], L - 1) + 1) / q) * q - 1 -- the run's last aligned block
      if t >= a and (t - a + 1 >= need or a == 0) then return (t + 1) * size end
    end
  end
  return 0
end

-- the answer of a hybrid holder whose history ends in node g, with plan p (plan_of); false when vLLM
-- would hit nothing
local function hybrid_answer(g, p, gof, memo)
  local spec = p.g
  local ng = #spec
  local cr, open = {}, {} -- per group: chain runs; whether its run is open at the node walked
  for j = 1, ng do cr[j] = {} end
  local segs, ns = {}, 0 -- flat: first block, last block, best weight per node, newest first
  local nd, hi = g, g.m
  while nd.i0 do
    nd = nd.a -- the stretch of nodes of the same tiers, from its first
    local held = node_groups(nd.l, nd.h, gof, memo)
    local a = nd.i0
    for j = 1, ng do
      local r = cr[j]
      if held[spec[j].g] then
        if open[j] then r[#r - 1] = a - 1 else r[#r + 1] = a - 1; r[#r + 1] = hi - 1; open[j] = true end
      else
        open[j] = false
      end
    end
    segs[ns + 1] = a; segs[ns + 2] = hi; segs[ns + 3] = nd.bw; ns = ns + 3
    hi = a - 1
    nd = nd.p
  end
  local sgs = p.sgs
  local scr, sr = {}, {} -- per spec group: chain runs (common to its groups), group-block runs
  for k, sg in ipairs(sgs) do
    local r = cr[sg.of[1]]
    for j = 2, #sg.of do r = intersect(r, cr[sg.of[j]]) end
    scr[k], sr[k] = r, block_runs(r, sg.s)
  end
  local n, unit = g.m, p.unit
  local hit, full_hits = n * unit, {}
  while true do -- HybridKVCacheCoordinator.find_longest_cache_hit's fixed point
    local curr = hit
    for k, sg in ipairs(sgs) do
      if sg.rule == 'full' and full_hits[k] then
        curr = math.min(curr, full_hits[k])
      else
        curr = manager_hit(sg, scr[k], sr[k], curr, p, n)
        if sg.rule == 'full' then full_hits[k] = curr end
      end
    end
    if curr >= hit then break end
    hit = curr
    if p.simple then break end
  end
  local m = hit / unit
  if m < 1 then return false end
  local score = 0
  for j = 1, ns, 3 do
    local b = math.min(segs[j + 1], m)
    if b >= segs[j] then score = score + segs[j + 2] * (b - segs[j] + 1) end
  end
  local runs = {}
  for k, sg in ipairs(sgs) do
    local run = manager_hit(sg, scr[k], sr[k], n * unit, p, n) / unit
    for _, gi in ipairs(sg.gs) do runs[gi] = run end
  end
  return {m = m, s = score, r = g.r, gr = runs}
end

-- hid -> answer (a table, or false: no hit) of the hybrid holders among holders[1 .. nholders], whose
-- walk ended in node G[grp[hid]]; nil when the view has none. tdesc: code -> descriptor of every code met
local function hybrid_matches(P, G, grp, holders, nholders, tdesc)
  if nholders == 0 or rcall('EXISTS', P .. 'gs') == 0 then return nil end
  local specs = hmget(P .. 'gs', holders)
  local gof, memo, done, out = {}, {}, {}, {}
  for code, d in pairs(tdesc) do gof[code] = tonumber(desc_group(d)) end
  for j = 1, nholders do
    local v = specs[j]
    if v then
      local gid = grp[holders[j]]
      local byv = done[gid]
      if not byv then byv = {}; done[gid] = byv end
      local a = byv[v]
      if a == nil then a = hybrid_answer(G[gid], plan_of(v), gof, memo); byv[v] = a end
      out[holders[j]] = a
    end
  end
  return out
end

-- kvbus_lookup's head and hids (see there) of the answers: holders[1 .. nholders] (walk ended in node
-- G[grp[hid]]) with the hybrid ones' answers hy (hybrid_matches) in place of theirs; a trailing part
-- of head when any answer is hybrid: per group, in the same order, k, then k pairs (KV group, run)
local function answer_parts(G, grp, holders, nholders, hy)
  local answers, members_of = {}, {}
  for j = 1, nholders do
    local hid = holders[j]
    local a
    if hy and hy[hid] ~= nil then a = hy[hid] else a = G[grp[hid]] end
    if a then
      local l = members_of[a]
      if not l then l = {}; members_of[a] = l; answers[#answers + 1] = a end
      l[#l + 1] = hid
    end
  end
  local head, blobs, hybrid = {}, {}, false
  for _, g in ipairs(answers) do
    local hids = members_of[g]
    head[#head + 1] = g.m
    head[#head + 1] = floor(g.s * 1000000 + 0.5)
    local at = #head + 1
    head[at] = 0
    local k = 0
    for code, run in pairs(g.r) do head[#head + 1] = code; head[#head + 1] = run; k = k + 1 end
    head[at] = k
    local parts = {}
    for j = 1, #hids, 1000 do
      local n = math.min(j + 999, #hids) - j + 1
      parts[#parts + 1] = struct.pack('>' .. string.rep('I4', n), unpack(hids, j, j + n - 1))
    end
    blobs[#blobs + 1] = table.concat(parts)
    if g.gr then hybrid = true end
  end
  if hybrid then
    for _, g in ipairs(answers) do
      local at = #head + 1
      head[at] = 0
      local k = 0
      for gi, run in pairs(g.gr or {}) do head[#head + 1] = gi; head[#head + 1] = run; k = k + 1 end
      head[at] = k
    end
  end
  return head, blobs
end

local function lookup(keys, args)
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
  local chain = args[2]
  local weights = {}
  for name, w in string.gmatch(args[3], '([^,=]+)=([^,]+)') do weights[name] = tonumber(w) end
  local cand, model, pw, names = nil, nil, nil, {}
  local k = 4
  while k <= #args do -- candidates, and options: a NUL, the option's name, then its value as the next argument
    local a = args[k]
    if byte(a, 1) == 0 then
      if a == '\0model' then
        model = args[k + 1]
        if not model or model == '' then return redis.error_reply('kvbus: lookup option model needs a model name') end
      elseif a == '\0predicted' then
        pw = tonumber(args[k + 1] or '')
        if not pw or pw ~= pw or pw < 0 or pw == math.huge then
          return redis.error_reply('kvbus: lookup option predicted needs a weight (a number >= 0)')
        end
      else
        return redis.error_reply('kvbus: unknown lookup option ' .. sub(a, 2))
      end
      k = k + 2
    else
      names[#names + 1] = a
      k = k + 1
    end
  end
  if #names > 0 then
    cand = {}
    local rest = {}
    for j, hid in ipairs(hmget(c.P .. 'hid', names)) do
      if hid then cand[tonumber(hid)] = true else rest[#rest + 1] = names[j] end
    end
    if #rest > 0 then
      for _, rh in ipairs(hmget(c.P .. 'rh', rest)) do
        if rh then for x in string.gmatch(rh, '%d+') do cand[tonumber(x)] = true end end
      end
    end
  end
  if model then -- only the holders whose latest applied event named this model (unknown models never match)
    local of = model_holders(c, model)
    if cand then
      for hid in pairs(cand) do if not of[hid] then cand[hid] = nil end end
    else
      cand = of
    end
  end
  local tw, tdesc = {}, {}
  local function weight(code)
    local d = redis.call('HGET', c.P .. 'tname', code) or '||0'
    local medium, own = string.match(d, '^([^|]*)|([^|]*)|')
    local w = (own ~= '' and weights[own]) or weights[medium] or weights['*'] or 1
    tw[code] = w
    tdesc[code] = d
    return w
  end
  local BP, WP, bm, bS = c.BP, c.WP, c.m, c.S
  local bm2 = bm * 2
  local KQ = c.KQ
  -- Holders are tracked in groups with identical history (same tiers at every block so far), so
  -- the work per block is per group, plus per member only at blocks whose members change.
  -- Member strings are canonical (sorted), so "same members as the previous block" is one string
  -- compare (Lua strings are interned: a pointer compare).
  -- group: {m = matched, s = score, r = {code -> run}, bw = best weight at its last block, ext = codes extended}
  local G = {[0] = {m = 0, s = 0, r = {}}}
  local ngroups = 0
  local grp = {}             -- hid -> group id
  local holders, nholders = {}, 0 -- the holders given a group at block 1 (ascending): all that can be in the answer
  local cs = {}              -- tier codes of one holder at a slow block
  local fresh, nfresh = {}, 0 -- groups created at the last slow block (they extend on identical blocks)
  local prev = nil
  local pend = 0
  for i = 1, #chain / 8 do
    local o = 8 * i
    local b5, b6, b7, b8 = byte(chain, o - 3, o)
    local x = ((b5 * 256 + b6) * 256 + b7) * 256 + b8
    local bk = x % bm
    if bk < bS then bk = x % bm2 end
    local key
    if bk < 1000 then
      key = BP .. bk
    else
      local lo = bk % 1000
      local q = (bk - lo) / 1000
      local kq = KQ[q]
      if not kq then kq = BP .. q; KQ[q] = kq end
      key = kq .. D3[lo]
    end
    local v = rcall('HGET', key, sub(chain, o - 7, o))
    if not v then break end
    if v == '' then v = rcall('GET', WP .. sub(chain, o - 7, o)) end
    if v == prev then
      pend = pend + 1 -- same members as the previous block: same holders extend the same tiers
    else
      if pend > 0 then
        extend_groups(fresh, nfresh, pend)
        pend = 0
      end
      -- Walk the members (3 bytes each, ascending: a holder's members are contiguous) holder by
      -- holder, straight from the string (no table of members); a sentinel member of another
      -- holder closes the last one.
      local nv = #v
      local vs = v .. ((byte(v, nv - 2) == 255 and byte(v, nv - 1) == 255 and byte(v, nv) >= 192)
        and '\0\0\0' or '\255\255\255')
      local made = {} -- old group id -> l -> h -> new group id
      local nassigned = 0
      fresh, nfresh = {}, 0
      local cur, l, h, nc = -1, 0, 0, 0 -- current holder, its tier codes as bit sets (< 32, >= 32), count
      for p = 1, nv + 1, 3 do
        local b1, b2, b3 = byte(vs, p, p + 2)
        local code = b3 % K
        local hid = (b1 * 256 + b2) * 4 + (b3 - code) / K
        if hid ~= cur then
          if nc > 0 then -- holder cur, tier codes cs[1 .. nc]
            local og
            if i == 1 then
              if not cand or cand[cur] then og = 0; nholders = nholders + 1; holders[nholders] = cur end
            else
              og = grp[cur]
              if og and G[og].m ~= i - 1 then og = nil end
            end
            if og then
              local t1 = made[og]
              if not t1 then t1 = {}; made[og] = t1 end
              local t2 = t1[l]
              if not t2 then t2 = {}; t1[l] = t2 end
              local ng = t2[h]
              if not ng then
                local old = G[og]
                local r, ext, bw, ne = {}, {}, nil, 0
                for cd, run in pairs(old.r) do r[cd] = run end
                for y = 1, nc do
                  local cd = cs[y]
                  local w = tw[cd] or weight(cd)
                  if not bw or w > bw then bw = w end
                  if (r[cd] or 0) == i - 1 then r[cd] = i; ne = ne + 1; ext[ne] = cd end
                end
                local g = {m = i, s = old.s + bw, r = r, ext = ext, bw = bw, p = old, i0 = i, l = l, h = h, a = false}
                g.a = (old.l == l and old.h == h) and old.a or g -- the first node of these tiers
                ngroups = ngroups + 1
                ng = ngroups
                G[ng] = g
                t2[h] = ng
                nfresh = nfresh + 1
                fresh[nfresh] = g
              end
              grp[cur] = ng -- safe now: each holder appears once per block
              nassigned = nassigned + 1
            end
          end
          cur, l, h, nc = hid, 0, 0, 0
        end
        if code < 32 then l = l + P2[code] else h = h + P2[code - 32] end
        nc = nc + 1
        cs[nc] = code
      end
      if nassigned == 0 then break end
      prev = v
    end
  end
  if pend > 0 then extend_groups(fresh, nfresh, pend) end
  local hy = hybrid_matches(c.P, G, grp, holders, nholders, tdesc)
  if pw then
    hy, nholders = predicted_matches(c, chain, pw, model, cand, G, grp, holders, nholders, hy,
      function(cd) return tw[cd] or weight(cd) end, tdesc)
  end
  local head, blobs = answer_parts(G, grp, holders, nholders, hy)
  local descs = {}
  for code, d in pairs(tdesc) do descs[#descs + 1] = code; descs[#descs + 1] = d end
  -- Pay for this call's garbage now, a little each call: left to itself, Lua 5.1 lets the heap
  -- double and then collects over a few consecutive calls, which made ~1 lookup in 6 slower by
  -- 0.1-0.5 ms (docs/sinks-layout.md, "Where the time goes").
  collectgarbage('step', 4)
  return {head, blobs, descs}
end

local function expire_holder(c, hid, now)
  local h = holder_load(c, hid)
  clear_all(c, h)
  groups_clear(h)
  set_model(c, h, nil) -- P mh lists live holders only; the holder's next event names its model again
  holder_save(h)
  pred_drop(c, hid)
  redis.call('ZREM', c.P .. 'seen', hid)
  local name = redis.call('HGET', c.P .. 'hname', hid)
  if name then redis.call('ZADD', c.P .. 'stale', now, name) end
  return name
end

--[[
kvbus_expire: expire holders last seen at or before a cutoff (no events or heartbeat since).
ARGV[1] prefix, ARGV[2] cutoff (epoch s), ARGV[3] now (epoch s), ARGV[4] max holders to expire.
Drops all their entries and their model, removes them from P seen, adds them to P stale (score = now);
their applied positions are kept (a redelivered old event stays a duplicate).
Returns the names expired.
]]
local function expire(keys, args)
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
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
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
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
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
  local name = args[2] .. '#' .. args[3]
  local hid = holder_id(c, args[2], name, true)
  redis.call('ZADD', c.P .. 'seen', 'GT', args[4], hid)
  redis.call('ZREM', c.P .. 'stale', name)
  return hid
end

--[[
kvbus_dump (read-only): one holder's whole state, read atomically (view snapshots, sinks/snapshot.py).
ARGV[1] prefix, ARGV[2] hid. Returns {state, seen, tiers}: state = the flat HGETALL of P H:<hid>
(p:<topic>, f, t:<code> fields, binary as documented above, m: the model and g:<group> fields as text),
seen = its P seen score or false, tiers = per tier held {code, descriptor, rc flag, raws held (8 bytes
each, concatenated), flat HGETALL of its extra reference counts}.
]]
local function dump(keys, args)
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
  local hid = tonumber(args[2])
  local h = holder_load(c, hid)
  local tiers = {}
  for code, t in pairs(h.tiers) do
    local live = {}
    for b = 0, t.m + t.S - 1 do
      local s = rcall('GET', index_key(t, b))
      if s then
        for _, raw in ipairs(index_live(s)) do live[#live + 1] = raw end
      end
    end
    tiers[#tiers + 1] = {code, rcall('HGET', c.P .. 'tname', code) or '', rcall('HGET', c.P .. 'trc', code) or '0',
      table.concat(live), rcall('HGETALL', t.rkey)}
  end
  return {rcall('HGETALL', h.key), rcall('ZSCORE', c.P .. 'seen', hid), tiers}
end

--[[
kvbus_restore: write one holder's state from a snapshot into a view being rebuilt (sinks/rebuild.py).
ARGV[1] prefix, ARGV[2] replica, ARGV[3] dp_rank, ARGV[4] seen (epoch s, "" for none), ARGV[5] reset
floor epoch ("" for none), ARGV[6] nP, then nP quadruples (topic, epoch, seq, index): applied
positions; then nD, then nD quintuples (tier descriptor, rc "1"/"0", origin topic, raws held (8 bytes
each), raws once more per extra reference count); optionally then the holder's model ("" = unknown;
without it the model is left as it is), and after it optionally nG, then nG pairs (group, its spec
"<kind>,<window>,<bmax>,<bmin>": see "KV cache groups of a holder"). A large holder may come in several
calls (its tiers' raws split between them, positions, model and groups repeated): each call adds.
Returns entries added.
]]
local function restore(keys, args)
  rcall, byte, sub, floor = redis.call, string.byte, string.sub, math.floor
  local c = ctx_load(args[1], keys)
  local nP = tonumber(args[6]) or -1
  local at = 7 + 4 * nP
  local nD = tonumber(args[at]) or -1
  local base = at + 5 * nD
  local model = args[base + 1] -- nil: not given
  local ag = base + 2 -- nG, the optional groups' count (after the model)
  local nG = 0
  if #args >= ag then nG = tonumber(args[ag]) or -1 end
  if nP < 0 or nD < 0 or nG < 0 or (#args ~= base and #args ~= base + 1 and #args ~= ag + 2 * nG) then
    return redis.error_reply('kvbus: malformed arguments')
  end
  for j = 1, nG do
    if not string.match(args[ag + 2 * j - 1], '^%d+$') or not string.match(args[ag + 2 * j], GROUP_SPEC) then
      return redis.error_reply('kvbus: malformed group spec')
    end
  end
  for j = 0, nD - 1 do
    local k = at + 1 + 5 * j
    if #args[k + 3] % 8 ~= 0 or #args[k + 4] % 8 ~= 0 then return redis.error_reply('kvbus: raws are not 8 bytes each') end
    if not tier_code(c, args[k], args[k + 1], true) then return redis.error_reply('kvbus: tier table full') end
  end
  local name = args[2] .. '#' .. args[3]
  local hid = holder_id(c, args[2], name, true)
  if not hid then return redis.error_reply('kvbus: holder table full') end
  local h = holder_load(c, hid)
  local before = c.entries
  for j = 0, nD - 1 do
    local k = at + 1 + 5 * j
    store(c, h, args[k + 2], args[k], args[k + 1], args[k + 3], 1, #args[k + 3] / 8)
    store(c, h, args[k + 2], args[k], args[k + 1], args[k + 4], 1, #args[k + 4] / 8)
  end
  for j = 0, nP - 1 do
    local k = 7 + 4 * j
    h.pos[args[k]] = {tonumber(args[k + 1]), tonumber(args[k + 2]), tonumber(args[k + 3])}
    h.ptouched[args[k]] = true
  end
  if args[5] ~= '' and tonumber(args[5]) > h.floor then h.floor = tonumber(args[5]); h.dirty['f'] = true end
  if model then set_model(c, h, model) end
  for j = 1, nG do group_set(h, args[ag + 2 * j - 1], args[ag + 2 * j]) end
  for _, t in pairs(h.tiers) do index_flush(t) end
  holder_save(h)
  if args[4] ~= '' then rcall('ZADD', c.P .. 'seen', 'GT', args[4], hid) end
  ctx_save(c)
  return c.entries - before
end

-- kvbus_version (read-only): the library version, to detect a stale or missing library.
local function version(keys, args) return VERSION end

redis.register_function('kvbus_apply', apply)
redis.register_function('kvbus_expire', expire)
redis.register_function('kvbus_drop', drop)
redis.register_function('kvbus_heartbeat', heartbeat)
redis.register_function{function_name = 'kvbus_lookup', callback = lookup, flags = {'no-writes'}}
redis.register_function('kvbus_restore', restore)
redis.register_function('kvbus_predict', predict)
redis.register_function{function_name = 'kvbus_dump', callback = dump, flags = {'no-writes'}}
redis.register_function{function_name = 'kvbus_version', callback = version, flags = {'no-writes'}}
