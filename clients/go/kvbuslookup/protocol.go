package kvbuslookup

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Layout is the view's key layout version this package speaks (the field "layout" of P meta): the
// lookup protocol's version. A view of another layout is refused with ErrLayoutMismatch.
const Layout = "3"

// DefaultPrefix is the view's key prefix P unless the sinks run with --prefix.
const DefaultPrefix = "kvbus:"

// LookupFunction is the read-only Redis function a lookup calls.
const LookupFunction = "kvbus_lookup"

// LookupOption is one option of kvbus_lookup: the argument "\x00"+Name, then its value, after the
// weights and before the candidates (an argument that starts with NUL names an option; holder names
// never contain NUL). kvbus.schemas.lookup.LOOKUP_OPTIONS declares them; tests/test_lookup_protocol.py
// holds LookupOptions to it.
type LookupOption struct {
	// Name is the wire argument after NUL, the key in Query.Options and the example's flag.
	Name string
	// Usage says what it does.
	Usage string
}

// LookupOptions are the options a lookup can send, in the order it sends them.
var LookupOptions = []LookupOption{
	{"model", "only replicas serving this model (their bridges' --model); default: every replica, whatever its model"},
	{"predicted", "count predicted entries (routers' predictions not yet confirmed by the engine) as held, each block with this weight; default: only what the engines reported"},
}

// ModelOption is the lookup option naming a model: only holders whose latest event named it answer.
const ModelOption = "\x00model"

// PredictedOption is the lookup option counting predicted entries (Client.Predict) as held, its value the
// weight of each predicted block (a number >= 0, as text: Query.Options["predicted"] = "0.5").
const PredictedOption = "\x00predicted"

// PredictedLabel is the tier label of the run of blocks held or predicted, in the answers of a lookup with
// PredictedOption whose answer a prediction lengthened.
const PredictedLabel = "predicted"

// scoreScale: the reply carries score * scoreScale, rounded to an integer.
const scoreScale = 1e6

// ErrLayoutMismatch: the view was written with another key layout than Layout.
var ErrLayoutMismatch = errors.New("kvbus: the view has another key layout")

// ErrFunctionsMissing: the server does not have the kvbus function library (a Redis restarted
// without persistence, FUNCTION FLUSH, a replica before its first sync). A sink loads it when it
// starts and when it finds it missing; a router only reads.
var ErrFunctionsMissing = errors.New("kvbus: the kvbus functions are not loaded on this server; " +
	"a sink loads them when it starts: start one against the primary")

// Weight is one tier weight: a medium (GPU, CPU, ...) or an ownership (kvcr, ...), or "*" for any
// other tier.
type Weight struct {
	Name  string
	Value float64
}

// DefaultWeights are kvbus lookup's default tier weights, in the order it sends them.
var DefaultWeights = []Weight{
	{"GPU", 1.0}, {"CPU", 0.8}, {"CPU_PINNED", 0.8}, {"STORAGE", 0.5}, {"DISK", 0.5},
	{"FS", 0.5}, {"OBJ", 0.5}, {"EXTERNAL", 0.4}, {"*", 0.5},
}

// ParseWeights reads "NAME=W,NAME=W" (spaces around parts allowed), the form of kvbus lookup --weights.
func ParseWeights(s string) ([]Weight, error) {
	var out []Weight
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, value, ok := strings.Cut(part, "=")
		if !ok {
			return nil, fmt.Errorf("weight %q is not NAME=VALUE", part)
		}
		f, err := strconv.ParseFloat(strings.TrimSpace(value), 64)
		if err != nil {
			return nil, fmt.Errorf("weight %q: %q is not a number", part, strings.TrimSpace(value))
		}
		if name = strings.TrimSpace(name); name == "" {
			return nil, fmt.Errorf("weight %q has no name", part)
		}
		out = append(out, Weight{name, f})
	}
	return out, nil
}

// WeightSpec is kvbus_lookup's weights argument: DefaultWeights with overrides laid over them, a
// name DefaultWeights knows in any case upper-cased (cpu = CPU), other names kept as given.
func WeightSpec(overrides []Weight) string {
	spec := append([]Weight{}, DefaultWeights...)
	for _, o := range overrides {
		name := o.Name
		for _, d := range DefaultWeights {
			if d.Name == strings.ToUpper(name) {
				name = d.Name
			}
		}
		set := false
		for i := range spec {
			if spec[i].Name == name {
				spec[i].Value, set = o.Value, true
			}
		}
		if !set {
			spec = append(spec, Weight{name, o.Value})
		}
	}
	parts := make([]string, len(spec))
	for i, w := range spec {
		parts[i] = w.Name + "=" + pyFloat(w.Value)
	}
	return strings.Join(parts, ",")
}

// group is one group of kvbus_lookup's reply: holders with identical answers.
type group struct {
	matched int
	score   int64 // micro-units
	tiers   map[string]int
	hids    []int64
	groups  map[int]int // KV cache group -> run, for hybrid-model holders (the head's trailing part)
}

// parseReply decodes {head, hids, descs} (docs/lookup-protocol.md, "Reply"), with the KV cache
// groups' runs of the head's trailing part when there is one; parts after descs are ignored.
func parseReply(v interface{}) ([]group, error) {
	reply, ok := v.([]interface{})
	if !ok || len(reply) < 3 {
		return nil, errors.New("kvbus_lookup reply is not {head, hids, descs}")
	}
	head, ok1 := reply[0].([]interface{})
	blobs, ok2 := reply[1].([]interface{})
	descs, ok3 := reply[2].([]interface{})
	if !ok1 || !ok2 || !ok3 {
		return nil, errors.New("kvbus_lookup reply is not three arrays")
	}
	bad := func(what string) error { return fmt.Errorf("kvbus_lookup reply: malformed %s", what) }
	num := func(i int) (int64, bool) {
		if i >= len(head) {
			return 0, false
		}
		n, ok := head[i].(int64)
		return n, ok
	}
	labels := map[int64]string{}
	for j := 0; j+1 < len(descs); j += 2 {
		code, ok1 := descs[j].(int64)
		desc, ok2 := descs[j+1].(string)
		if !ok1 || !ok2 {
			return nil, bad("descs")
		}
		labels[code] = Label(desc)
	}
	var out []group
	k := 0
	for _, b := range blobs {
		blob, ok := b.(string)
		matched, ok1 := num(k)
		score, ok2 := num(k + 1)
		n, ok3 := num(k + 2)
		if !ok || !ok1 || !ok2 || !ok3 {
			return nil, bad("head")
		}
		g := group{matched: int(matched), score: score, tiers: map[string]int{}}
		for j := 0; j < int(n); j++ {
			code, ok1 := num(k + 3 + 2*j)
			run, ok2 := num(k + 4 + 2*j)
			if !ok1 || !ok2 {
				return nil, bad("head")
			}
			g.tiers[labels[code]] = int(run)
		}
		k += 3 + 2*int(n)
		for j := 0; j+4 <= len(blob); j += 4 {
			g.hids = append(g.hids, int64(blob[j])<<24|int64(blob[j+1])<<16|int64(blob[j+2])<<8|int64(blob[j+3]))
		}
		out = append(out, g)
	}
	if k < len(head) { // the trailing part: per group, n pairs (KV cache group, run)
		for i := range out {
			n, ok := num(k)
			if !ok {
				return nil, bad("head")
			}
			out[i].groups = map[int]int{}
			for j := 0; j < int(n); j++ {
				gi, ok1 := num(k + 1 + 2*j)
				run, ok2 := num(k + 2 + 2*j)
				if !ok1 || !ok2 {
					return nil, bad("head")
				}
				out[i].groups[int(gi)] = int(run)
			}
			if n == 0 {
				out[i].groups = nil
			}
			k += 1 + 2*int(n)
		}
	}
	return out, nil
}

// Label is a tier descriptor's display label: MEDIUM[@ownership][/g<group>].
func Label(desc string) string {
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

// DisplayName is a holder's name in answers: the replica when it has one holder (ranks: the holders
// the views list for it) of rank 0, else "<replica>#<dp_rank>".
func DisplayName(replica string, dpRank, ranks int) string {
	if ranks <= 1 && dpRank == 0 {
		return replica
	}
	return fmt.Sprintf("%s#%d", replica, dpRank)
}

// splitHolder splits "<replica>#<dp_rank>" at its last '#'.
func splitHolder(name string) (string, int, error) {
	at := strings.LastIndexByte(name, '#')
	if at < 0 {
		return "", 0, fmt.Errorf("holder name %q has no #<dp_rank>", name)
	}
	dp, err := strconv.Atoi(name[at+1:])
	if err != nil {
		return "", 0, fmt.Errorf("holder name %q: bad dp rank", name)
	}
	return name[:at], dp, nil
}

// shardPrefix is the key prefix of shard i of a sharded view: P{s<i>}:.
func shardPrefix(prefix string, i int) string { return fmt.Sprintf("%s{s%d}:", prefix, i) }

// isMissing tells whether err says the function library is not loaded.
func isMissing(err error) bool {
	return err != nil && strings.Contains(strings.ToLower(err.Error()), "function not found")
}
