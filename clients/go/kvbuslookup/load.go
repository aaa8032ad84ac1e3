package kvbuslookup

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"
)

// Load is one replica's load, summed over every router whose lease has not run out.
type Load struct {
	Requests int64 // requests routed to it and not completed
	Tokens   int64 // their prompt tokens
}

// loadSeparator is between a router's name, a replica's name and "t" in the fields of P load.
const loadSeparator = "\x00"

// loadKey is P load; on a Redis Cluster shard 0's, one slot every router writes and reads.
func (c *Client) loadKey() string {
	if c.cluster {
		return shardPrefix(c.opt.Prefix, 0) + "load"
	}
	return c.opt.Prefix + "load"
}

func checkLoadName(name, what string) error {
	if name == "" || strings.Contains(name, loadSeparator) {
		return fmt.Errorf("kvbus: a %s name must be non-empty and without NUL, got %q", what, name)
	}
	return nil
}

// Report writes router's load on each replica of loads (its requests in flight there and their prompt
// tokens, as absolute values: each router owns its fields) and renews its lease for lease; loads may be
// empty (a renewal). A router that stops reporting counts for nobody once its lease runs out. Routers'
// clocks are assumed in sync to well within a lease.
func (c *Client) Report(ctx context.Context, router string, loads map[string]Load, lease time.Duration) error {
	if err := checkLoadName(router, "router"); err != nil {
		return err
	}
	fields := []interface{}{router, time.Now().Add(lease).UnixMilli()}
	for replica, l := range loads {
		if err := checkLoadName(replica, "replica"); err != nil {
			return err
		}
		f := router + loadSeparator + replica
		fields = append(fields, f, l.Requests, f+loadSeparator+"t", l.Tokens)
	}
	return c.rdb.HSet(ctx, c.loadKey(), fields...).Err()
}

// Load is the routers' shared load: replica -> its requests in flight and their prompt tokens, summed
// over every router whose lease has not run out (a sum below zero is 0; replicas with none left out).
func (c *Client) Load(ctx context.Context) (map[string]Load, error) {
	raw, err := c.rdb.HGetAll(ctx, c.loadKey()).Result()
	if err != nil {
		return nil, err
	}
	return parseLoad(raw, time.Now().UnixMilli())
}

func parseLoad(raw map[string]string, nowMs int64) (map[string]Load, error) {
	leases := map[string]int64{}
	for f, v := range raw {
		if !strings.Contains(f, loadSeparator) {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				return nil, fmt.Errorf("kvbus: lease of router %q: %w", f, err)
			}
			leases[f] = n
		}
	}
	sums := map[string]Load{}
	keys := make([]string, 0, len(raw))
	for f := range raw {
		keys = append(keys, f)
	}
	sort.Strings(keys)
	for _, f := range keys {
		parts := strings.Split(f, loadSeparator)
		if len(parts) < 2 || leases[parts[0]] <= nowMs {
			continue
		}
		n, err := strconv.ParseInt(raw[f], 10, 64)
		if err != nil {
			return nil, fmt.Errorf("kvbus: load field %q: %w", f, err)
		}
		l := sums[parts[1]]
		if len(parts) > 2 {
			l.Tokens += n
		} else {
			l.Requests += n
		}
		sums[parts[1]] = l
	}
	out := map[string]Load{}
	for r, l := range sums {
		l.Requests, l.Tokens = max(0, l.Requests), max(0, l.Tokens)
		if l.Requests != 0 || l.Tokens != 0 {
			out[r] = l
		}
	}
	return out, nil
}
