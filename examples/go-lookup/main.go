// Command kvbus-lookup-go asks the kvbus residency view which replicas hold the longest prefix of a
// chain of block hashes, the way a Go router does, through the Go package kvbuslookup
// (clients/go/kvbuslookup), and prints the same JSON as `kvbus lookup --json`.
//
//	go run . -addr 127.0.0.1:6379 -hashes 1403909460543360175,1643945449041937783
//	go run . -cluster 127.0.0.1:7000,127.0.0.1:7001 -tokens 1,2,...,32 -algo sha256
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/redis/go-redis/v9"

	"kvbus.example/kvbuslookup"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:6379", "Redis (single node)")
	cluster := flag.String("cluster", "", "Redis Cluster seed nodes h:p,h:p: read the sharded view")
	prefix := flag.String("prefix", kvbuslookup.DefaultPrefix, "key prefix of the view")
	hashes := flag.String("hashes", "", "block hashes, block 0 first: decimal uint64, negative int64 or 0x-hex")
	tokens := flag.String("tokens", "", "prompt token ids, hashed as vLLM does")
	blockSize := flag.Int("block-size", 16, "tokens per block with -tokens")
	algo := flag.String("algo", kvbuslookup.SHA256, "vLLM --prefix-caching-hash-algo with -tokens: "+
		"sha256 | sha256_cbor | xxhash | xxhash_cbor")
	seed := flag.String("hash-seed", "", "the engines' PYTHONHASHSEED (default: $PYTHONHASHSEED, else vLLM's default)")
	replicas := flag.String("replicas", "", "only these candidates: replica or <replica>#<dp>, comma-separated")
	options := map[string]*string{} // a flag for every lookup option (kvbuslookup.LookupOptions)
	for _, o := range kvbuslookup.LookupOptions {
		options[o.Name] = flag.String(o.Name, "", o.Usage)
	}
	weights := flag.String("weights", "", "tier weights NAME=W over kvbus lookup's defaults")
	user := flag.String("user", "", "Redis ACL user (a read-only one is enough: docs/lookup-protocol.md)")
	password := flag.String("password", os.Getenv("REDIS_PASSWORD"), "its password (default $REDIS_PASSWORD)")
	flag.Parse()

	var chain []uint64
	var err error
	if *tokens != "" {
		var s *string // the engines' PYTHONHASHSEED: the flag if given (even empty), else ours, else unset
		flag.Visit(func(f *flag.Flag) {
			if f.Name == "hash-seed" {
				s = seed
			}
		})
		if env, ok := os.LookupEnv("PYTHONHASHSEED"); ok && s == nil {
			s = &env
		}
		var toks []uint64
		if toks, err = kvbuslookup.ParseTokens(*tokens); err == nil {
			chain, err = kvbuslookup.ChainFromTokens(toks, *blockSize, *algo, s)
		}
	} else {
		chain, err = kvbuslookup.ParseHashes(*hashes)
	}
	if err != nil {
		fail(err)
	}
	w, err := kvbuslookup.ParseWeights(*weights)
	if err != nil {
		fail(err)
	}
	q := kvbuslookup.Query{Weights: w, Options: map[string]string{}, TieBreak: kvbuslookup.ByName}
	for name, v := range options {
		q.Options[name] = *v
	}
	for _, c := range strings.Split(*replicas, ",") {
		if c = strings.TrimSpace(c); c != "" {
			q.Candidates = append(q.Candidates, c)
		}
	}

	var rdb redis.UniversalClient
	if *cluster != "" {
		rdb = redis.NewClusterClient(&redis.ClusterOptions{Addrs: strings.Split(*cluster, ","),
			Username: *user, Password: *password})
	} else {
		rdb = redis.NewClient(&redis.Options{Addr: *addr, Username: *user, Password: *password})
	}
	defer rdb.Close()
	ctx := context.Background()
	view := kvbuslookup.New(rdb, kvbuslookup.Options{Prefix: *prefix})
	answer, err := view.Lookup(ctx, chain, q)
	if err != nil {
		fail(err)
	}
	if st, err := view.Status(ctx); err != nil {
		fail(err)
	} else if !st.Ready() {
		fmt.Fprintf(os.Stderr, "kvbus-lookup-go: warning: the view is %s: the answer may miss blocks\n", st.State)
	}
	fmt.Println(kvbuslookup.JSON(answer))
}

func fail(err error) {
	fmt.Fprintf(os.Stderr, "kvbus-lookup-go: %v\n", err)
	os.Exit(2)
}
