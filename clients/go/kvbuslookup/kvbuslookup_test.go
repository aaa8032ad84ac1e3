package kvbuslookup

import (
	"reflect"
	"strings"
	"testing"
	"time"
)

func m(name string, micro int64, matched int) Match {
	return Match{Name: name, Replica: name, ScoreMicro: micro, Score: float64(micro) / 1e6, Matched: matched,
		Tiers: map[string]int{"GPU": matched}}
}

func names(ms []Match) []string {
	out := make([]string, len(ms))
	for i, x := range ms {
		out[i] = x.Name
	}
	return out
}

func sample() []Match {
	return []Match{m("d", 2e6, 2), m("a", 2e6, 2), m("z", 3e6, 3), m("b", 2e6, 3), m("c", 2e6, 2), m("e", 1e6, 1)}
}

func TestRankByNameIsKvbusLookupsOrder(t *testing.T) {
	got := names(Rank(sample(), ByName))
	if want := []string{"z", "b", "a", "c", "d", "e"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("Rank(ByName) = %v, want %v", got, want)
	}
	if got2 := names(Rank(sample(), nil)); !reflect.DeepEqual(got2, got) {
		t.Fatalf("Rank(nil) = %v, want ByName's %v", got2, got)
	}
}

func TestShuffleMovesTiedHoldersOnlyAndRepeatsWithItsSeed(t *testing.T) {
	a, b := Shuffle(7), Shuffle(7)
	seen := map[string]bool{}
	for i := 0; i < 50; i++ {
		x, y := names(Rank(sample(), a)), names(Rank(sample(), b))
		if !reflect.DeepEqual(x, y) {
			t.Fatalf("two Shuffle(7) gave %v and %v", x, y)
		}
		if x[0] != "z" || x[1] != "b" || x[5] != "e" {
			t.Fatalf("a holder moved past another score or matched: %v", x)
		}
		seen[x[2]] = true
	}
	if len(seen) != 3 {
		t.Fatalf("the three tied holders should each come first sometimes in 50 draws, saw %v", seen)
	}
}

func TestByLoadPutsTheLeastLoadedFirstAndShufflesEqualLoads(t *testing.T) {
	load := map[string]float64{"a": 3, "c": 1, "d": 1}
	calls := map[string]int{}
	firsts := map[string]bool{}
	for seed := uint64(0); seed < 40; seed++ {
		got := names(Rank(sample(), ByLoad(func(x Match) float64 { calls[x.Name]++; return load[x.Name] }, Shuffle(seed))))
		if got[0] != "z" || got[1] != "b" || got[4] != "a" || got[5] != "e" {
			t.Fatalf("ByLoad order %v", got)
		}
		firsts[got[2]] = true
	}
	if !firsts["c"] || !firsts["d"] {
		t.Fatalf("equal loads c and d should each come first for some seed: %v", firsts)
	}
	if calls["z"] != 0 || calls["b"] != 0 || calls["e"] != 0 {
		t.Fatalf("the load callback was asked about holders that are not tied: %v", calls)
	}
}

// The reply of the protocol document's example (docs/lookup-protocol.md, "Reply").
func TestParseReplyOfTheDocumentsExample(t *testing.T) {
	reply := []interface{}{
		[]interface{}{int64(4), int64(4000000), int64(2), int64(1), int64(2), int64(0), int64(4),
			int64(1), int64(1000000), int64(1), int64(0), int64(1),
			int64(3), int64(2400000), int64(1), int64(2), int64(3)},
		[]interface{}{"\x00\x00\x00\x00", "\x00\x00\x00\x01", "\x00\x00\x00\x02"},
		[]interface{}{int64(1), "CPU||0", int64(2), "CPU|kvcr|0", int64(0), "GPU||0"},
	}
	got, err := parseReply(reply)
	if err != nil {
		t.Fatal(err)
	}
	want := []group{
		{4, 4000000, map[string]int{"CPU": 2, "GPU": 4}, []int64{0}, nil},
		{1, 1000000, map[string]int{"GPU": 1}, []int64{1}, nil},
		{3, 2400000, map[string]int{"CPU@kvcr": 3}, []int64{2}, nil},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseReply = %+v, want %+v", got, want)
	}
	malformed := []interface{}{[]interface{}{"x"}, []interface{}{"\x00\x00\x00\x00"}, []interface{}{}}
	if _, err := parseReply(malformed); err == nil {
		t.Fatal("a malformed head is accepted")
	}
}

// The hybrid example of the protocol document ("Hybrid models"): the head's trailing part gives each
// group's KV cache group runs; a reply part after descs is ignored.
func TestParseReplyOfTheHybridExample(t *testing.T) {
	reply := []interface{}{
		[]interface{}{int64(5), int64(5000000), int64(1), int64(0), int64(6),
			int64(2), int64(2000000), int64(1), int64(0), int64(2),
			int64(2), int64(1), int64(5), int64(0), int64(6), int64(0)},
		[]interface{}{"\x00\x00\x00\x00", "\x00\x00\x00\x01"},
		[]interface{}{int64(1), "GPU||1", int64(0), "GPU||0"},
		[]interface{}{"a later part"},
	}
	got, err := parseReply(reply)
	if err != nil {
		t.Fatal(err)
	}
	want := []group{
		{5, 5000000, map[string]int{"GPU": 6}, []int64{0}, map[int]int{0: 6, 1: 5}},
		{2, 2000000, map[string]int{"GPU": 2}, []int64{1}, nil},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseReply = %+v, want %+v", got, want)
	}
	reply[0] = append(reply[0].([]interface{})[:15:15], int64(3)) // the second group's count names 3 pairs
	if _, err := parseReply(reply); err == nil {
		t.Fatal("a truncated trailing part is accepted")
	}
}

func TestWeightSpecLaysOverridesOverTheDefaults(t *testing.T) {
	const defaults = "CPU_PINNED=0.8,STORAGE=0.5,DISK=0.5,FS=0.5,OBJ=0.5,EXTERNAL=0.4,*=0.5"
	if got := WeightSpec(nil); got != "GPU=1.0,CPU=0.8,"+defaults {
		t.Fatalf("default spec %q", got)
	}
	w, err := ParseWeights(" cpu=0.25, kvcr=2 ,GPU=3")
	if err != nil {
		t.Fatal(err)
	}
	if got := WeightSpec(w); got != "GPU=3.0,CPU=0.25,"+defaults+",kvcr=2.0" {
		t.Fatalf("spec %q", got)
	}
	for _, bad := range []string{"GPU", "GPU=lots", "=3"} {
		if _, err := ParseWeights(bad); err == nil {
			t.Fatalf("ParseWeights(%q) accepted", bad)
		}
	}
}

func TestJSONIsPythonsJsonDumps(t *testing.T) {
	x := Match{Name: "pod#x", Replica: "pod#x", Matched: 3, ScoreMicro: 2400000,
		Tiers: map[string]int{"GPU": 3, "CPU@kvcr": 1}}
	y := Match{Name: "é\"\n", Replica: "é\"\n", DPRank: 0, Matched: 1, ScoreMicro: 1, Tiers: map[string]int{}}
	h := Match{Name: "h", Replica: "h", Matched: 5, ScoreMicro: 5000000, Tiers: map[string]int{"GPU": 6},
		Groups: map[int]int{10: 5, 0: 6, 2: 5}}
	got := JSON([]Match{x, y, h})
	want := `{"pod#x": {"matched": 3, "tiers": {"CPU@kvcr": 1, "GPU": 3}, "score": 2.4, "replica": "pod#x", ` +
		`"dp_rank": 0}, ` +
		`"\u00e9\"\n": {"matched": 1, "tiers": {}, "score": 1e-06, "replica": "\u00e9\"\n", "dp_rank": 0}, ` +
		`"h": {"matched": 5, "tiers": {"GPU": 6}, "score": 5.0, "replica": "h", "dp_rank": 0, ` +
		`"groups": {"0": 6, "2": 5, "10": 5}}}`
	if got != want {
		t.Fatalf("JSON =\n%s\nwant\n%s", got, want)
	}
	for f, s := range map[float64]string{4: "4.0", 0.0001: "0.0001", 1e16: "1e+16", 123456.789: "123456.789"} {
		if pyFloat(f) != s {
			t.Fatalf("pyFloat(%v) = %s, want %s", f, pyFloat(f), s)
		}
	}
}

func TestChainFromTokensRefusesWhatVLLMCannotMatch(t *testing.T) {
	if _, err := ChainFromTokens([]uint64{1, 2}, 1, XXHash, nil); err == nil || !strings.Contains(err.Error(), "random") {
		t.Fatalf("xxhash without a seed: %v", err)
	}
	if _, err := ChainFromTokens([]uint64{1}, 1, "md5", nil); err == nil {
		t.Fatal("an unknown algorithm is accepted")
	}
	if c, err := ChainFromTokens([]uint64{1, 2, 3}, 2, SHA256, nil); err != nil || len(c) != 1 {
		t.Fatalf("a trailing partial block has no hash: %v %v", c, err)
	}
}

func TestPickleIntsAsCPythonWritesThem(t *testing.T) {
	// pickle.dumps(n, protocol=5)[2+9:-1] for each n (the opcode and its argument)
	for n, want := range map[uint64]string{
		5: "4b05", 300: "4d2c01", 70000: "4a70110100", 1 << 31: "8a050000008000", 1<<40 + 1: "8a06010000000001",
	} {
		got := pickleInt(nil, n)
		if h := strings.ToLower(hexs(got)); h != want {
			t.Fatalf("pickleInt(%d) = %s, want %s", n, h, want)
		}
	}
}

func hexs(b []byte) string {
	const d = "0123456789abcdef"
	out := make([]byte, 0, 2*len(b))
	for _, x := range b {
		out = append(out, d[x>>4], d[x&15])
	}
	return string(out)
}

// A query's lookup options: in LookupOptions' order, Model as Options["model"], unknown names refused.
func TestQueryOptionArgs(t *testing.T) {
	for _, c := range []struct {
		q    Query
		want []interface{}
		err  string
	}{
		{Query{}, nil, ""},
		{Query{Model: "qwen"}, []interface{}{ModelOption, "qwen"}, ""},
		{Query{Options: map[string]string{"model": "qwen"}}, []interface{}{ModelOption, "qwen"}, ""},
		{Query{Model: "qwen", Options: map[string]string{"model": "qwen"}}, []interface{}{ModelOption, "qwen"}, ""},
		{Query{Options: map[string]string{"model": ""}}, nil, ""},
		{Query{Model: "qwen", Options: map[string]string{"model": "llama"}}, nil, "differ"},
		{Query{Options: map[string]string{"tenant": "x"}}, nil, `unknown lookup option "tenant"`},
		{Query{Options: map[string]string{"predicted": "0.5"}}, []interface{}{PredictedOption, "0.5"}, ""},
		{Query{Model: "qwen", Options: map[string]string{"predicted": "0"}},
			[]interface{}{ModelOption, "qwen", PredictedOption, "0"}, ""},
		{Query{Options: map[string]string{"predicted": "1", "model": "qwen"}},
			[]interface{}{ModelOption, "qwen", PredictedOption, "1"}, ""},
	} {
		got, err := c.q.optionArgs()
		if c.err != "" {
			if err == nil || !strings.Contains(err.Error(), c.err) {
				t.Fatalf("%+v: error %v, want one saying %q", c.q, err, c.err)
			}
			continue
		}
		if err != nil || !reflect.DeepEqual(got, c.want) {
			t.Fatalf("%+v: %v, %v; want %v", c.q, got, err, c.want)
		}
	}
}

// The routers' load as Python's kvbus.schemas.lookup.parse_load sums it: live leases only, below zero is 0.
func TestParseLoad(t *testing.T) {
	now := int64(1000000)
	raw := map[string]string{"r1": "1000001", "r1\x00a#0": "2", "r1\x00a#0\x00t": "300",
		"r2": "999999", "r2\x00a#0": "5", "r2\x00a#0\x00t": "9",
		"r3": "1000005", "r3\x00b": "-1", "r3\x00b\x00t": "0"}
	got, err := parseLoad(raw, now)
	if err != nil || !reflect.DeepEqual(got, map[string]Load{"a#0": {2, 300}}) {
		t.Fatalf("parseLoad = %v, %v", got, err)
	}
	if err := checkLoadName("x\x00y", "router"); err == nil {
		t.Fatal("a name with NUL is refused")
	}
}

// A prediction's holder, shard and arguments: what Python's kvbus.schemas.lookup computes.
func TestPredictHolderShardAndArgs(t *testing.T) {
	for name, want := range map[string]struct {
		replica string
		dp      int
	}{"b#1": {"b", 1}, "b": {"b", 0}, "pod#x": {"pod#x", 0}, "pod#x#2": {"pod#x", 2}, "r#": {"r#", 0}} {
		if r, dp := PredictHolder(name); r != want.replica || dp != want.dp {
			t.Fatalf("PredictHolder(%q) = %q, %d; want %q, %d", name, r, dp, want.replica, want.dp)
		}
	}
	// zlib.crc32(b"b#0") = 744653201, b"b#1" = 1533391111, b"pod#x#0" = 2483101090
	for _, c := range []struct {
		replica  string
		dp, want int
	}{{"b", 0, 744653201 % 16}, {"b", 1, 1533391111 % 16}, {"pod#x", 0, 2483101090 % 16}} {
		if got := HolderShard(c.replica, c.dp, 16); got != c.want {
			t.Fatalf("HolderShard(%q, %d, 16) = %d, want %d", c.replica, c.dp, got, c.want)
		}
	}
	chain := chainBytes([]uint64{1, 0x0102030405060708})
	if string(chain) != "\x00\x00\x00\x00\x00\x00\x00\x01\x01\x02\x03\x04\x05\x06\x07\x08" {
		t.Fatalf("chainBytes: %q", chain)
	}
	args, err := predictArgs("kvbus:", "b", 1, chain, Prediction{})
	want := []interface{}{"kvbus:", "b", "1", "5000", chain, ""}
	if err != nil || !reflect.DeepEqual(args, want) {
		t.Fatalf("predictArgs default: %v, %v; want %v", args, err, want)
	}
	args, err = predictArgs("kvbus:", "b", 0, chain, Prediction{TTL: 250 * time.Microsecond, Model: "qwen"})
	if err != nil || args[3] != "1" || args[5] != "qwen" {
		t.Fatalf("predictArgs: a TTL under 1 ms is 1 ms, the model is sent: %v, %v", args, err)
	}
	for _, ttl := range []time.Duration{-time.Second, MaxPredictTTL + time.Millisecond} {
		if _, err := predictArgs("kvbus:", "b", 0, chain, Prediction{TTL: ttl}); err == nil {
			t.Fatalf("predictArgs refuses TTL %v", ttl)
		}
	}
}
