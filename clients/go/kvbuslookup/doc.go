// Package kvbuslookup asks the kvbus residency view which replicas hold the longest cached prefix of
// a prompt, the way a Go router does: one FCALL_RO kvbus_lookup on a single Redis (one per shard,
// pipelined, on a Redis Cluster), holder ids resolved through a cached copy of the view's holder
// table, answers ranked best first with a tie-break among equal answers.
//
// It implements the lookup protocol of docs/lookup-protocol.md (the view's key layout version
// Layout) and gives the answers of `kvbus lookup --json` and of the Python client kvbus.client:
//
//	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})  // or redis.NewClusterClient
//	view := kvbuslookup.New(rdb, kvbuslookup.Options{})
//	seed := "0" // the engines' PYTHONHASHSEED
//	chain, err := kvbuslookup.ChainFromTokens(promptIDs, 16, kvbuslookup.SHA256, &seed)
//	matches, err := view.Lookup(ctx, chain, kvbuslookup.Query{Model: "meta-llama/Llama-3.1-8B-Instruct"})
//	if len(matches) > 0 {
//		target := matches[0].Replica
//	}
//
// On a Redis Cluster every shard is read from its master (a ClusterClient without ReadOnly): a
// replica knows nothing of a slot migration and could answer from a half-moved shard.
package kvbuslookup
