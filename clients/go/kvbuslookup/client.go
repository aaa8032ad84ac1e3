package kvbuslookup

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Options configure a Client; the zero value is the defaults.
type Options struct {
	// Prefix is the view's key prefix (default DefaultPrefix).
	Prefix string
	// NamesTTL is how long the cache of holder names is trusted (default 10 s); it is also read
	// again when a reply names a holder it does not know.
	NamesTTL time.Duration
	// TieBreak orders tied holders unless a Query says otherwise (default RandomShuffle()).
	TieBreak TieBreak
	// Shards is the sharded view's shard count when the view does not record its own (default 16).
	Shards int
	// RetryFor is how long a shard's call refused during a slot migration or failover (TRYAGAIN,
	// MOVED, ASK, CLUSTERDOWN, a lost connection) is retried (default 30 s). A shard is never skipped.
	RetryFor time.Duration
}

// Query is what a lookup asks besides the chain.
type Query struct {
	// Weights are tier weights laid over DefaultWeights (nil: the defaults).
	Weights []Weight
	// Candidates restricts the answer to these holders ("<replica>#<dp_rank>") or replicas (all
	// their ranks). nil: every holder; empty but not nil: none.
	Candidates []string
	// Model restricts the answer to the holders of this model: the replicas whose bridges name it
	// with --model (the engines' served model name), never those of another model or of an unknown
	// one. "": every holder, whatever its model.
	Model string
	// Options are lookup options by name (LookupOptions), each sent unless "": Options["model"] is
	// Model (set either; both set must agree).
	Options map[string]string
	// TieBreak orders tied holders for this lookup (nil: the Client's).
	TieBreak TieBreak
}

// optionArgs are the query's lookup options as kvbus_lookup's arguments, in LookupOptions' order.
func (q Query) optionArgs() ([]interface{}, error) {
	values := make(map[string]string, len(q.Options)+1)
	for k, v := range q.Options {
		values[k] = v
	}
	if q.Model != "" {
		if v := values["model"]; v != "" && v != q.Model {
			return nil, fmt.Errorf("kvbus: Query.Model %q and Options[\"model\"] %q differ", q.Model, v)
		}
		values["model"] = q.Model
	}
	var args []interface{}
	for _, o := range LookupOptions {
		if v := values[o.Name]; v != "" {
			args = append(args, "\x00"+o.Name, v)
		}
		delete(values, o.Name)
	}
	for k := range values {
		return nil, fmt.Errorf("kvbus: unknown lookup option %q (the options are LookupOptions)", k)
	}
	return args, nil
}

// Status says whether a view's answers can be trusted.
type Status struct {
	// State is "ready" (complete as of its Kafka offsets), "rebuilding" (a sink is rebuilding a lost
	// view: answers may miss blocks) or "missing" (no view).
	State string
	// Fields is what P status records: since (epoch s), during a rebuild phase and snapshot.
	Fields map[string]string
}

// Ready tells whether answers are complete.
func (s Status) Ready() bool { return s.State == "ready" }

type holder struct {
	replica string
	dp      int
}

// Client reads the residency view through a go-redis client. Safe for concurrent use.
type Client struct {
	rdb     redis.UniversalClient
	cluster bool
	opt     Options

	mu      sync.Mutex
	views   []string           // the view, or each shard's prefix
	names   []map[int64]holder // per view: hid -> holder
	ranks   map[string]int     // replica -> holders over all views
	namesAt time.Time
}

// New returns a Client of the view read through rdb: a *redis.ClusterClient reads the sharded view
// on a Redis Cluster (one call per shard), any other client a single-node view.
func New(rdb redis.UniversalClient, opt Options) *Client {
	if opt.Prefix == "" {
		opt.Prefix = DefaultPrefix
	}
	if opt.NamesTTL == 0 {
		opt.NamesTTL = 10 * time.Second
	}
	if opt.TieBreak == nil {
		opt.TieBreak = RandomShuffle()
	}
	if opt.Shards <= 0 {
		opt.Shards = 16
	}
	if opt.RetryFor == 0 {
		opt.RetryFor = 30 * time.Second
	}
	_, cluster := rdb.(*redis.ClusterClient)
	return &Client{rdb: rdb, cluster: cluster, opt: opt}
}

// Cluster tells whether the Client reads the sharded view of a Redis Cluster.
func (c *Client) Cluster() bool { return c.cluster }

// viewPrefixes is the view's prefix, or on a cluster each shard's (P{s0}:meta shards of them).
func (c *Client) viewPrefixes(ctx context.Context) ([]string, error) {
	if !c.cluster {
		return []string{c.opt.Prefix}, nil
	}
	n, err := c.rdb.HGet(ctx, shardPrefix(c.opt.Prefix, 0)+"meta", "shards").Int()
	if errors.Is(err, redis.Nil) {
		n = c.opt.Shards
	} else if err != nil {
		return nil, fmt.Errorf("HGET %s{s0}:meta shards: %w", c.opt.Prefix, err)
	}
	out := make([]string, n)
	for i := range out {
		out[i] = shardPrefix(c.opt.Prefix, i)
	}
	return out, nil
}

// refresh reads every view's holder table and layout.
func (c *Client) refresh(ctx context.Context, views []string) error {
	cmds := make([]*redis.MapStringStringCmd, len(views))
	layouts := make([]*redis.StringCmd, len(views))
	_, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, v := range views {
			cmds[i] = p.HGetAll(ctx, v+"hname")
			layouts[i] = p.HGet(ctx, v+"meta", "layout")
		}
		return nil
	})
	if err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	names := make([]map[int64]holder, len(views))
	ranks := map[string]int{}
	for i, v := range views {
		if layout, err := layouts[i].Result(); err == nil && layout != Layout {
			return fmt.Errorf("%w: the view under %q has layout %s; this client speaks %s", ErrLayoutMismatch, v,
				layout, Layout)
		}
		table, err := cmds[i].Result()
		if err != nil {
			return err
		}
		names[i] = map[int64]holder{}
		for hid, name := range table {
			if hid == "" { // the padding field that keeps the hash a real hash table
				continue
			}
			id, err := strconv.ParseInt(hid, 10, 64)
			replica, dp, err2 := splitHolder(name)
			if err != nil || err2 != nil {
				return fmt.Errorf("bad holder %q -> %q in %shname", hid, name, v)
			}
			names[i][id] = holder{replica, dp}
			ranks[replica]++
		}
	}
	c.views, c.names, c.ranks, c.namesAt = views, names, ranks, time.Now()
	return nil
}

// Lookup answers which holders hold the longest prefix of chain (the prompt's block hashes, block 0
// first: ChainFromTokens, ParseHashes), best first: score descending, matched descending, then the
// tie-break. Errors: ErrFunctionsMissing, ErrLayoutMismatch (wrapped), go-redis's.
func (c *Client) Lookup(ctx context.Context, chain []uint64, q Query) ([]Match, error) {
	if len(chain) == 0 || (q.Candidates != nil && len(q.Candidates) == 0) {
		return nil, nil
	}
	arg := chainBytes(chain)
	spec := WeightSpec(q.Weights)
	opts, err := q.optionArgs()
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.names == nil || time.Since(c.namesAt) > c.opt.NamesTTL {
		views, err := c.viewPrefixes(ctx)
		if err == nil {
			err = c.refresh(ctx, views)
		}
		if err != nil {
			return nil, err
		}
	}
	replies, err := c.call(ctx, arg, spec, opts, q.Candidates)
	if err != nil {
		return nil, err
	}
	out, err := c.resolve(replies)
	if errors.Is(err, errUnknownHolder) { // a holder created since the names were read: read them again
		if err = c.refresh(ctx, c.views); err == nil {
			out, err = c.resolve(replies)
		}
	}
	if err != nil {
		return nil, err
	}
	tb := q.TieBreak
	if tb == nil {
		tb = c.opt.TieBreak
	}
	return Rank(out, tb), nil
}

var errUnknownHolder = errors.New("kvbus: a reply names a holder id the view's holder table does not list")

func (c *Client) resolve(replies [][]group) ([]Match, error) {
	var out []Match
	for i, groups := range replies {
		for _, g := range groups {
			for _, hid := range g.hids {
				h, ok := c.names[i][hid]
				if !ok {
					return nil, fmt.Errorf("%w: %d in %shname", errUnknownHolder, hid, c.views[i])
				}
				tiers := make(map[string]int, len(g.tiers))
				for k, v := range g.tiers {
					tiers[k] = v
				}
				var groups map[int]int
				if g.groups != nil {
					groups = make(map[int]int, len(g.groups))
					for k, v := range g.groups {
						groups[k] = v
					}
				}
				out = append(out, Match{Name: DisplayName(h.replica, h.dp, c.ranks[h.replica]), Replica: h.replica,
					DPRank: h.dp, Matched: g.matched, Score: float64(g.score) / scoreScale, ScoreMicro: g.score,
					Tiers: tiers, Groups: groups})
			}
		}
	}
	return out, nil
}

// call sends kvbus_lookup to every view: one call on a single node, one per shard pipelined on a
// cluster (go-redis sends each node's calls together), retrying refused shards.
func (c *Client) call(ctx context.Context, chain []byte, spec string, opts []interface{}, cands []string) ([][]group, error) {
	args := func(prefix string) []interface{} {
		a := append([]interface{}{prefix, chain, spec}, opts...)
		for _, s := range cands {
			a = append(a, s)
		}
		return a
	}
	out := make([][]group, len(c.views))
	if !c.cluster {
		v, err := c.rdb.FCallRO(ctx, LookupFunction, nil, args(c.views[0])...).Result()
		if err != nil {
			return nil, c.callErr(c.views[0], err)
		}
		g, err := parseReply(v)
		out[0] = g
		return out, err
	}
	pending := make([]int, len(c.views))
	for i := range pending {
		pending[i] = i
	}
	deadline := time.Now().Add(c.opt.RetryFor)
	delay := 5 * time.Millisecond
	for len(pending) > 0 {
		cmds := make([]*redis.Cmd, len(pending))
		_, _ = c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
			for k, i := range pending {
				v := c.views[i]
				cmds[k] = p.FCallRO(ctx, LookupFunction, []string{v + "meta", v + "guard"}, args(v)...)
			}
			return nil
		})
		var retry []int
		var last error
		for k, i := range pending {
			v, err := cmds[k].Result()
			if err != nil {
				if retryable(err) {
					retry, last = append(retry, i), err
					continue
				}
				return nil, c.callErr(c.views[i], err)
			}
			if out[i], err = parseReply(v); err != nil {
				return nil, err
			}
		}
		if len(retry) > 0 && time.Now().After(deadline) {
			return nil, c.callErr(c.views[retry[0]], last)
		}
		if len(retry) > 0 {
			select { // backoff while the slot moves or a replica is promoted
			case <-ctx.Done():
				return nil, ctx.Err()
			case <-time.After(delay):
			}
			delay = min(delay*2, 100*time.Millisecond)
		}
		pending = retry
	}
	return out, nil
}

func (c *Client) callErr(prefix string, err error) error {
	if isMissing(err) {
		return fmt.Errorf("%w (%v)", ErrFunctionsMissing, err)
	}
	return fmt.Errorf("FCALL_RO %s on %q: %w", LookupFunction, prefix, err)
}

// retryable tells whether a shard's call was refused for a reason that passes: a slot migration
// (TRYAGAIN, ASK, MOVED), a failover (CLUSTERDOWN, a lost connection).
func retryable(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) || errors.Is(err, net.ErrClosed) {
		return true
	}
	msg := err.Error()
	for _, p := range []string{"TRYAGAIN", "ASK ", "MOVED ", "CLUSTERDOWN", "LOADING", "EOF"} {
		if strings.HasPrefix(msg, p) || strings.HasSuffix(msg, p) {
			return true
		}
	}
	return false
}

// Status reads whether the view's answers can be trusted: rebuilding if any view (shard) says so,
// else the first state recorded, else ready if a view exists, else missing.
func (c *Client) Status(ctx context.Context) (Status, error) {
	views, err := c.viewPrefixes(ctx)
	if err != nil {
		return Status{}, err
	}
	sts := make([]*redis.MapStringStringCmd, len(views))
	exists := make([]*redis.IntCmd, len(views))
	if _, err := c.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, v := range views {
			sts[i] = p.HGetAll(ctx, v+"status")
			exists[i] = p.Exists(ctx, v+"meta")
		}
		return nil
	}); err != nil {
		return Status{}, err
	}
	var first *Status
	found := false
	for i := range views {
		st := sts[i].Val()
		if st["state"] == "rebuilding" {
			return Status{"rebuilding", st}, nil
		}
		if first == nil && st["state"] != "" {
			first = &Status{st["state"], st}
		}
		found = found || exists[i].Val() > 0
	}
	switch {
	case first != nil:
		return *first, nil
	case found:
		return Status{"ready", map[string]string{}}, nil
	}
	return Status{"missing", map[string]string{}}, nil
}
