// Command kvbus-lookup-go asks the kvbus residency view which replicas hold the longest prefix of a
// chain of block hashes, the way a Go router would: one FCALL_RO kvbus_lookup (one per shard on a
// Redis Cluster), holder ids resolved through P hname, and prints the same JSON as
// `kvbus lookup --json`. The protocol it follows: docs/lookup-protocol.md.
//
//	go run . -addr 127.0.0.1:6379 -hashes 1403909460543360175,1643945449041937783
//	go run . -cluster 127.0.0.1:7000,127.0.0.1:7001 -tokens 1,2,...,32 -algo sha256_cbor
package main

import (
	"context"
	"crypto/sha256"
	"errors"
	"flag"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"

	"github.com/redis/go-redis/v9"
	"github.com/zeebo/xxh3"
)

// Protocol is the view layout (P meta field "layout") this client speaks.
const Protocol = "3"

// defaultWeights are kvbus lookup's default tier weights (sinks/tiers.py DEFAULT_WEIGHTS), in order.
var defaultWeights = [][2]string{
	{"GPU", "1.0"}, {"CPU", "0.8"}, {"CPU_PINNED", "0.8"}, {"STORAGE", "0.5"}, {"DISK", "0.5"},
	{"FS", "0.5"}, {"OBJ", "0.5"}, {"EXTERNAL", "0.4"}, {"*", "0.5"},
}

// view is one single-node view: a prefix, and the keys its calls declare (none on a single node).
type view struct {
	prefix string
	keys   []string
}

// match is one holder's answer (the value of `kvbus lookup --json`).
type match struct {
	name, replica string
	dp, matched   int
	score         int64 // micro-units, as in the reply
	tiers         map[string]int
}

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "Redis (single node)")
	cluster := flag.String("cluster", "", "Redis Cluster seed nodes h:p,h:p: read the sharded view")
	prefix := flag.String("prefix", "kvbus:", "key prefix of the view")
	hashes := flag.String("hashes", "", "block hashes, block 0 first: decimal uint64, negative int64 or 0x-hex")
	tokens := flag.String("tokens", "", "prompt token ids, hashed as vLLM does (-algo sha256_cbor or xxhash_cbor)")
	blockSize := flag.Int("block-size", 16, "tokens per block with -tokens")
	algo := flag.String("algo", "sha256_cbor", "vLLM --prefix-caching-hash-algo with -tokens: sha256_cbor | xxhash_cbor")
	seed := flag.String("hash-seed", "", "the engines' PYTHONHASHSEED (default: $PYTHONHASHSEED, else vLLM's default)")
	replicas := flag.String("replicas", "", "only these candidates: replica or <replica>#<dp>, comma-separated")
	weights := flag.String("weights", "", "tier weights NAME=W over kvbus lookup's defaults")
	user := flag.String("user", "", "Redis ACL user (a read-only one is enough: docs/lookup-protocol.md)")
	password := flag.String("password", os.Getenv("REDIS_PASSWORD"), "its password (default $REDIS_PASSWORD)")
	flag.Parse()

	var chain []byte
	var err error
	if *tokens != "" {
		s, set := *seed, *seed != ""
		if !set {
			s, set = os.LookupEnv("PYTHONHASHSEED")
		}
		chain, err = chainFromTokens(*tokens, *blockSize, *algo, s, set)
	} else {
		chain, err = parseHashes(*hashes)
	}
	if err != nil {
		fail(err)
	}
	ctx := context.Background()
	var rdb redis.UniversalClient
	views := []view{{prefix: *prefix}}
	if *cluster != "" {
		rdb = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(*cluster, ","),
			Username: *user, Password: *password})
		views, err = shards(ctx, rdb, *prefix)
		if err != nil {
			fail(err)
		}
	} else {
		rdb = redis.NewClient(&redis.Options{Addr: *addr, Username: *user, Password: *password})
	}
	defer rdb.Close()
	answer, err := lookup(ctx, rdb, views, chain, weightSpec(*weights), candidates(*replicas), false)
	if err != nil {
		fail(err)
	}
	if state, err := status(ctx, rdb, views); err != nil {
		fail(err)
	} else if state != "ready" {
		fmt.Fprintf(os.Stderr, "kvbus-lookup-go: warning: the view is %s: the answer may miss blocks\n", state)
	}
	fmt.Println(toJSON(answer))
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "kvbus-lookup-go: %v\n", err)
	os.Exit(2)
}

// shards finds the sharded view's shard count (P{s0}:meta shards) and returns one view per shard.
func shards(ctx context.Context, rdb redis.UniversalClient, prefix string) ([]view, error) {
	n, err := rdb.HGet(ctx, prefix+"{s0}:meta", "shards").Int()
	if err != nil {
		return nil, fmt.Errorf("no sharded view under %q (HGET %s{s0}:meta shards: %v)", prefix, prefix, err)
	}
	out := make([]view, n)
	for i := range out {
		p := fmt.Sprintf("%s{s%d}:", prefix, i)
		out[i] = view{prefix: p, keys: []string{p + "meta", p + "guard"}}
	}
	return out, nil
}

// lookup calls kvbus_lookup on every view (shard), checks each one's layout, and resolves holder
// ids to display names over all of them.
func lookup(ctx context.Context, rdb redis.UniversalClient, views []view, chain []byte, spec string,
	cands []string, retried bool) ([]match, error) {
	if len(chain) == 0 {
		return nil, nil
	}
	type holder struct {
		replica string
		dp      int
	}
	perView := make([]map[int64]holder, len(views))
	ranks := map[string]int{}
	var out []match
	for i, v := range views {
		if layout, err := rdb.HGet(ctx, v.prefix+"meta", "layout").Result(); err == nil && layout != Protocol {
			return nil, fmt.Errorf("the view under %q has layout %s; this client speaks %s", v.prefix, layout, Protocol)
		}
		names, err := rdb.HGetAll(ctx, v.prefix+"hname").Result()
		if err != nil {
			return nil, err
		}
		perView[i] = map[int64]holder{}
		for hid, name := range names {
			if hid == "" { // the padding field that keeps the hash a real hash table
				continue
			}
			at := strings.LastIndexByte(name, '#')
			id, err1 := strconv.ParseInt(hid, 10, 64)
			dp, err2 := strconv.Atoi(name[at+1:])
			if at < 0 || err1 != nil || err2 != nil {
				return nil, fmt.Errorf("bad holder %q -> %q in %shname", hid, name, v.prefix)
			}
			perView[i][id] = holder{name[:at], dp}
			ranks[name[:at]]++
		}
	}
	for i, v := range views {
		args := append([]interface{}{v.prefix, chain, spec}, toArgs(cands)...)
		reply, err := rdb.FCallRO(ctx, "kvbus_lookup", v.keys, args...).Slice()
		if err != nil {
			return nil, fmt.Errorf("FCALL_RO kvbus_lookup on %q: %w", v.prefix, err)
		}
		ms, err := parseReply(reply)
		if err != nil {
			return nil, err
		}
		for _, m := range ms {
			for _, hid := range m.hids {
				h, ok := perView[i][hid]
				if !ok && !retried { // a holder created since hname was read: again (hids are never reused)
					return lookup(ctx, rdb, views, chain, spec, cands, true)
				} else if !ok {
					return nil, fmt.Errorf("holder id %d of %q is not in %shname", hid, v.prefix, v.prefix)
				}
				name := h.replica
				if ranks[h.replica] > 1 || h.dp != 0 {
					name = fmt.Sprintf("%s#%d", h.replica, h.dp)
				}
				out = append(out, match{name, h.replica, h.dp, m.matched, m.score, m.tiers})
			}
		}
	}
	sort.Slice(out, func(a, b int) bool { // best first: score, then matched, then name
		if out[a].score != out[b].score {
			return out[a].score > out[b].score
		}
		if out[a].matched != out[b].matched {
			return out[a].matched > out[b].matched
		}
		return out[a].name < out[b].name
	})
	return out, nil
}

type group struct {
	matched int
	score   int64
	tiers   map[string]int
	hids    []int64
}

// parseReply decodes {head, hids, descs} (docs/lookup-protocol.md, "Reply").
func parseReply(reply []interface{}) ([]group, error) {
	if len(reply) != 3 {
		return nil, errors.New("kvbus_lookup reply is not {head, hids, descs}")
	}
	head, _ := reply[0].([]interface{})
	blobs, _ := reply[1].([]interface{})
	descs, _ := reply[2].([]interface{})
	labels := map[int64]string{}
	for j := 0; j+1 < len(descs); j += 2 {
		labels[descs[j].(int64)] = label(descs[j+1].(string))
	}
	var out []group
	k := 0
	for _, b := range blobs {
		blob := b.(string)
		g := group{matched: int(head[k].(int64)), score: head[k+1].(int64), tiers: map[string]int{}}
		n := int(head[k+2].(int64))
		for j := 0; j < n; j++ {
			g.tiers[labels[head[k+3+2*j].(int64)]] = int(head[k+4+2*j].(int64))
		}
		k += 3 + 2*n
		for j := 0; j+4 <= len(blob); j += 4 {
			g.hids = append(g.hids, int64(blob[j])<<24|int64(blob[j+1])<<16|int64(blob[j+2])<<8|int64(blob[j+3]))
		}
		out = append(out, g)
	}
	return out, nil
}

// label is a tier descriptor's display label: MEDIUM[@ownership][/g<group>].
func label(desc string) string {
	p := strings.SplitN(desc, "|", 3)
	if len(p) != 3 {
		return desc
	}
	out := p[0]
	if p[1] != "" {
		out += "@" + p[1]
	}
	if p[2] != "" && p[2] != "0" {
		out += "/g" + p[2]
	}
	return out
}

// status is the view's state for routers: P status state; without one, ready if a view exists.
func status(ctx context.Context, rdb redis.UniversalClient, views []view) (string, error) {
	state, exists := "", false
	for _, v := range views {
		st, err := rdb.HGet(ctx, v.prefix+"status", "state").Result()
		if err != nil && err != redis.Nil {
			return "", err
		}
		if st == "rebuilding" {
			return st, nil
		}
		if state == "" {
			state = st
		}
		n, err := rdb.Exists(ctx, v.prefix+"meta").Result()
		if err != nil {
			return "", err
		}
		exists = exists || n > 0
	}
	if state != "" {
		return state, nil
	}
	if exists {
		return "ready", nil
	}
	return "missing", nil
}

// weightSpec is ARGV[3]: kvbus lookup's defaults with the -weights overrides (known names upper-cased).
func weightSpec(over string) string {
	spec := append([][2]string{}, defaultWeights...)
	for _, part := range strings.Split(over, ",") {
		part = strings.TrimSpace(part)
		name, value, ok := strings.Cut(part, "=")
		if !ok {
			continue
		}
		name = strings.TrimSpace(name)
		f, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			fail(fmt.Errorf("weight %q is not NAME=VALUE", part))
		}
		for _, kv := range defaultWeights { // kvbus lookup upper-cases the names it knows
			if kv[0] == strings.ToUpper(name) {
				name = kv[0]
			}
		}
		set := false
		for i := range spec {
			if spec[i][0] == name {
				spec[i][1], set = pyFloat(f), true
			}
		}
		if !set {
			spec = append(spec, [2]string{name, pyFloat(f)})
		}
	}
	parts := make([]string, len(spec))
	for i, kv := range spec {
		parts[i] = kv[0] + "=" + kv[1]
	}
	return strings.Join(parts, ",")
}

func candidates(s string) []string {
	var out []string
	for _, c := range strings.Split(s, ",") {
		if c = strings.TrimSpace(c); c != "" {
			out = append(out, c)
		}
	}
	return out
}

func toArgs(ss []string) []interface{} {
	out := make([]interface{}, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// parseHashes turns "h1,h2,..." (decimal uint64, negative int64 or 0x-hex) into the chain argument:
// 8 bytes big-endian per block.
func parseHashes(s string) ([]byte, error) {
	var chain []byte
	for _, p := range strings.Split(s, ",") {
		p = strings.TrimSpace(p)
		if p == "" {
			continue
		}
		var v uint64
		var err error
		switch {
		case strings.HasPrefix(strings.ToLower(p), "0x"):
			v, err = strconv.ParseUint(p[2:], 16, 64)
		case strings.HasPrefix(p, "-"):
			var i int64
			i, err = strconv.ParseInt(p, 10, 64)
			v = uint64(i) // SGLang's signed hashes: their two's-complement bits
		default:
			v, err = strconv.ParseUint(p, 10, 64)
		}
		if err != nil {
			return nil, fmt.Errorf("not a 64-bit block hash: %q", p)
		}
		chain = append(chain, byte(v>>56), byte(v>>48), byte(v>>40), byte(v>>32), byte(v>>24), byte(v>>16), byte(v>>8), byte(v))
	}
	return chain, nil
}

// chainFromTokens hashes a prompt's full blocks as vLLM does with a CBOR algorithm
// (docs/lookup-protocol.md, "Block hashes"): H(cbor([parent, [tokens...], null])), chained from
// NONE_HASH = H(cbor(seed)); the published hash is the digest's last 8 bytes.
func chainFromTokens(s string, blockSize int, algo, seed string, seedSet bool) ([]byte, error) {
	var h func([]byte) []byte
	switch algo {
	case "sha256_cbor":
		h = func(b []byte) []byte { d := sha256.Sum256(b); return d[:] }
		if !seedSet {
			seed = "vllm-none-hash"
		}
	case "xxhash_cbor":
		h = func(b []byte) []byte { d := xxh3.Hash128(b).Bytes(); return d[:] }
		if !seedSet {
			return nil, errors.New("-algo xxhash_cbor needs the engines' PYTHONHASHSEED (-hash-seed): without it " +
				"vLLM seeds each engine process's hashes with random bytes no router can know")
		}
	default:
		return nil, fmt.Errorf("-tokens supports sha256_cbor and xxhash_cbor here (sha256 and xxhash hash a "+
			"Python pickle; use `kvbus lookup`), not %q", algo)
	}
	if blockSize <= 0 {
		return nil, errors.New("-block-size must be positive")
	}
	var toks []uint64
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		t, err := strconv.ParseUint(p, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("token ids must be non-negative integers: %q", p)
		}
		toks = append(toks, t)
	}
	parent := h(cborText(seed))
	var chain []byte
	for i := 0; (i+1)*blockSize <= len(toks); i++ {
		in := []byte{0x83} // array(3): parent digest, token ids, extra keys (null)
		in = append(in, cborHead(2, uint64(len(parent)))...)
		in = append(in, parent...)
		in = append(in, cborHead(4, uint64(blockSize))...)
		for _, t := range toks[i*blockSize : (i+1)*blockSize] {
			in = append(in, cborHead(0, t)...)
		}
		in = append(in, 0xf6)
		parent = h(in)
		chain = append(chain, parent[len(parent)-8:]...)
	}
	return chain, nil
}

// cborHead is a canonical CBOR head: major type and argument in the shortest form.
func cborHead(major byte, n uint64) []byte {
	m := major << 5
	switch {
	case n < 24:
		return []byte{m | byte(n)}
	case n <= 0xff:
		return []byte{m | 24, byte(n)}
	case n <= 0xffff:
		return []byte{m | 25, byte(n >> 8), byte(n)}
	case n <= 0xffffffff:
		return []byte{m | 26, byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
	}
	return []byte{m | 27, byte(n >> 56), byte(n >> 48), byte(n >> 40), byte(n >> 32), byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)}
}

func cborText(s string) []byte { return append(cborHead(3, uint64(len(s))), s...) }

// toJSON writes the answer exactly as `kvbus lookup --json` does (Python's json.dumps: ", " and
// ": " separators, ASCII-only strings, floats as Python's repr).
func toJSON(ms []match) string {
	var b strings.Builder
	b.WriteString("{")
	for i, m := range ms {
		if i > 0 {
			b.WriteString(", ")
		}
		labels := make([]string, 0, len(m.tiers))
		for l := range m.tiers {
			labels = append(labels, l)
		}
		sort.Strings(labels)
		fmt.Fprintf(&b, "%s: {\"matched\": %d, \"tiers\": {", pyString(m.name), m.matched)
		for j, l := range labels {
			if j > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "%s: %d", pyString(l), m.tiers[l])
		}
		fmt.Fprintf(&b, "}, \"score\": %s, \"replica\": %s, \"dp_rank\": %d}",
			pyFloat(float64(m.score)/1e6), pyString(m.replica), m.dp)
	}
	b.WriteString("}")
	return b.String()
}

// pyString is Python's json.dumps of a string (ensure_ascii).
func pyString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			if r >= 0x20 && r < 0x7f {
				b.WriteRune(r)
			} else if r > 0xffff {
				r1, r2 := utf16.EncodeRune(r)
				fmt.Fprintf(&b, `\u%04x\u%04x`, r1, r2)
			} else {
				fmt.Fprintf(&b, `\u%04x`, r)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}

// pyFloat is Python's repr of a float: the shortest digits, fixed notation for exponents -4..15
// (with ".0" when integral), else d.ddde[+-]XX.
func pyFloat(f float64) string {
	e := strconv.FormatFloat(f, 'e', -1, 64) // d.ddde±XX
	mant, expS, _ := strings.Cut(e, "e")
	exp, _ := strconv.Atoi(expS)
	if exp < -4 || exp >= 16 {
		sign := "+"
		if exp < 0 {
			sign, exp = "-", -exp
		}
		return fmt.Sprintf("%se%s%02d", mant, sign, exp)
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".") {
		s += ".0"
	}
	return s
}
