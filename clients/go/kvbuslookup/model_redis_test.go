package kvbuslookup

import (
	"context"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// The view these tests read is written by kvbus's own sink store on a real Redis (single node:
// KVBUS_TEST_REDIS_ADDR, a Redis Cluster: KVBUS_TEST_CLUSTER_ADDRS, comma-separated) under the key
// prefix KVBUS_TEST_PREFIX: tests/test_lookup_protocol.py writes it and runs them. Every holder
// holds the same chain (hashes 1, 2, 3), as two models that share a tokenizer and a hash seed publish
// for the same prompt: l0 (3 blocks) and l1 (2) of model "llama", q0 (3) of model "qwen", u0 (3)
// of an unknown model (its bridge named none). Without the variables the tests are skipped.
var modelChain = []uint64{1, 2, 3}

func modelViews(t *testing.T) map[string]redis.UniversalClient {
	prefix := os.Getenv("KVBUS_TEST_PREFIX")
	out := map[string]redis.UniversalClient{}
	if addr := os.Getenv("KVBUS_TEST_REDIS_ADDR"); addr != "" && prefix != "" {
		out["single node"] = redis.NewClient(&redis.Options{Addr: addr})
	}
	if addrs := os.Getenv("KVBUS_TEST_CLUSTER_ADDRS"); addrs != "" && prefix != "" {
		out["cluster"] = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(addrs, ",")})
	}
	if len(out) == 0 {
		t.Skip("no view to read: KVBUS_TEST_PREFIX with KVBUS_TEST_REDIS_ADDR or KVBUS_TEST_CLUSTER_ADDRS " +
			"(tests/test_lookup_protocol.py sets them)")
	}
	return out
}

func matched(ms []Match) map[string]int {
	out := map[string]int{}
	for _, m := range ms {
		out[m.Name] = m.Matched
	}
	return out
}

func TestLookupNamingAModelAnswersOnlyItsHolders(t *testing.T) {
	ctx := context.Background()
	for where, rdb := range modelViews(t) {
		defer rdb.Close()
		view := New(rdb, Options{Prefix: os.Getenv("KVBUS_TEST_PREFIX")})
		for _, c := range []struct {
			q    Query
			want map[string]int
		}{
			{Query{}, map[string]int{"l0": 3, "l1": 2, "q0": 3, "u0": 3}},
			{Query{Model: "llama"}, map[string]int{"l0": 3, "l1": 2}},
			{Query{Model: "qwen"}, map[string]int{"q0": 3}},
			{Query{Model: "mistral"}, map[string]int{}},
			{Query{Model: "Llama"}, map[string]int{}},
			{Query{Model: "llama", Candidates: []string{"l1", "q0", "u0"}}, map[string]int{"l1": 2}},
			{Query{Model: "qwen", Candidates: []string{"l0", "u0"}}, map[string]int{}},
		} {
			got, err := view.Lookup(ctx, modelChain, c.q)
			if err != nil {
				t.Fatalf("%s: Lookup(%+v): %v", where, c.q, err)
			}
			if !reflect.DeepEqual(matched(got), c.want) {
				t.Fatalf("%s: Lookup(model %q, candidates %v) = %v, want %v", where, c.q.Model, c.q.Candidates,
					matched(got), c.want)
			}
		}
		best, err := view.Lookup(ctx, modelChain, Query{Model: "llama"})
		if err != nil || best[0].Name != "l0" {
			t.Fatalf("%s: the longest prefix of model llama is l0's: %v %v", where, best, err)
		}
	}
}

// A Go router's report, read back by Go, and left for tests/test_lookup_protocol.py to read with Python's
// ViewClient.load: router "go-router" has 2 requests (64 prompt tokens) in flight on l0, leased 10 min.
func TestSharedLoadReportedByAGoRouter(t *testing.T) {
	ctx := context.Background()
	for where, rdb := range modelViews(t) {
		view := New(rdb, Options{Prefix: os.Getenv("KVBUS_TEST_PREFIX")})
		if err := view.Report(ctx, "go-router", map[string]Load{"l0": {2, 64}}, 10*time.Minute); err != nil {
			t.Fatalf("%s: Report: %v", where, err)
		}
		got, err := view.Load(ctx)
		if err != nil || !reflect.DeepEqual(got, map[string]Load{"l0": {2, 64}}) {
			t.Fatalf("%s: Load = %v, %v", where, got, err)
		}
		if err := view.Report(ctx, "gone", map[string]Load{"q0": {1, 1}}, -time.Second); err != nil {
			t.Fatalf("%s: Report: %v", where, err)
		}
		if got, _ := view.Load(ctx); got["q0"] != (Load{}) {
			t.Fatalf("%s: a router whose lease ran out still counts: %v", where, got)
		}
	}
}

// Predict on the same view (single node and cluster): l1 (llama, 2 blocks held) gets the chain's four
// blocks predicted; only lookups with the predicted option count them, and only for its model.
func TestPredictThenLookupWithThePredictedOption(t *testing.T) {
	ctx := context.Background()
	chain := append(append([]uint64{}, modelChain...), 4)
	for where, rdb := range modelViews(t) {
		defer rdb.Close()
		view := New(rdb, Options{Prefix: os.Getenv("KVBUS_TEST_PREFIX")})
		if n, err := view.Predict(ctx, "nobody#0", chain, Prediction{}); n != 0 || err != nil {
			t.Fatalf("%s: a holder the view does not know gets no prediction: %d, %v", where, n, err)
		}
		if n, err := view.Predict(ctx, "l1", chain, Prediction{TTL: time.Minute, Model: "llama"}); n != 4 || err != nil {
			t.Fatalf("%s: Predict(l1) = %d, %v; want 4 blocks", where, n, err)
		}
		for _, c := range []struct {
			q    Query
			want map[string]int
		}{
			{Query{Model: "llama"}, map[string]int{"l0": 3, "l1": 2}},
			{Query{Model: "llama", Options: map[string]string{"predicted": "0.5"}}, map[string]int{"l0": 3, "l1": 4}},
			{Query{Options: map[string]string{"predicted": "0.5"}}, map[string]int{"l0": 3, "l1": 4, "q0": 3, "u0": 3}},
			{Query{Model: "qwen", Options: map[string]string{"predicted": "0.5"}}, map[string]int{"q0": 3}},
		} {
			got, err := view.Lookup(ctx, chain, c.q)
			if err != nil {
				t.Fatalf("%s: Lookup(%+v): %v", where, c.q, err)
			}
			if !reflect.DeepEqual(matched(got), c.want) {
				t.Fatalf("%s: Lookup(%+v) = %v, want %v", where, c.q, matched(got), c.want)
			}
			for _, m := range got {
				if m.Name == "l1" && c.q.Options != nil && (m.Tiers[PredictedLabel] != 4 || m.Score != 3.0) {
					t.Fatalf("%s: l1's answer: %+v (GPU 2 at 1.0, 2 predicted at 0.5)", where, m)
				}
			}
		}
		if _, err := view.Lookup(ctx, chain, Query{Options: map[string]string{"predicted": "-1"}}); err == nil ||
			!strings.Contains(err.Error(), "predicted needs a weight") {
			t.Fatalf("%s: a negative weight is refused by the library: %v", where, err)
		}
	}
}
