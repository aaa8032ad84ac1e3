package kvbuslookup

import (
	"context"
	"fmt"
	"hash/crc32"
	"strconv"
	"strings"
	"time"
)

// PredictFunction is the Redis function a router calls (FCALL: it writes) to record a prompt's blocks as
// predicted on the holder it chose (docs/lookup-protocol.md, "Predicted entries").
const PredictFunction = "kvbus_predict"

// DefaultPredictTTL is how long a prediction counts unless Prediction.TTL says otherwise: long enough for
// the engine's BlockStored to reach the view, short enough that one that never comes true soon stops
// attracting requests.
const DefaultPredictTTL = 5 * time.Second

// MaxPredictTTL is the longest TTL kvbus_predict takes.
const MaxPredictTTL = 10 * time.Minute

// Prediction is what Predict records besides the holder and the chain.
type Prediction struct {
	// TTL is how long the prediction counts (0: DefaultPredictTTL; at most MaxPredictTTL, in ms). A block
	// predicted again keeps the later expiry.
	TTL time.Duration
	// Model is the model the request is for: lookups naming a model count only predictions made naming it
	// ("": only lookups naming no model count them). A holder's predictions are for one model: predicting
	// for another drops its earlier ones.
	Model string
}

// PredictHolder is the holder a prediction names: "<replica>#<dp_rank>" (split at the last '#' followed
// by a decimal rank), or a replica name alone for its dp rank 0 (what Match.Name is for a replica with
// one holder).
func PredictHolder(name string) (string, int) {
	if at := strings.LastIndexByte(name, '#'); at >= 0 && at+1 < len(name) {
		digits := name[at+1:]
		if strings.Trim(digits, "0123456789") == "" {
			if dp, err := strconv.Atoi(digits); err == nil {
				return name[:at], dp
			}
		}
	}
	return name, 0
}

// HolderShard is the shard of a holder in the sharded view: the CRC-32 (IEEE, as Python's zlib.crc32) of
// "<replica>#<dp_rank>" mod shards.
func HolderShard(replica string, dpRank, shards int) int {
	return int(crc32.ChecksumIEEE([]byte(fmt.Sprintf("%s#%d", replica, dpRank))) % uint32(shards))
}

// predictArgs are kvbus_predict's arguments after the keys: P, the replica, the dp rank, the TTL in ms, the
// chain, the model ("" for none).
func predictArgs(prefix, replica string, dpRank int, chain []byte, p Prediction) ([]interface{}, error) {
	ttl := p.TTL
	if ttl == 0 {
		ttl = DefaultPredictTTL
	}
	if ttl < 0 || ttl > MaxPredictTTL {
		return nil, fmt.Errorf("kvbus: a prediction's TTL is more than 0 and at most %v, not %v", MaxPredictTTL, ttl)
	}
	ms := max(int64(1), (ttl + time.Millisecond/2).Milliseconds())
	return []interface{}{prefix, replica, strconv.Itoa(dpRank), strconv.FormatInt(ms, 10), chain, p.Model}, nil
}

// chainBytes is a chain as kvbus_lookup and kvbus_predict take it: 8 bytes big-endian per hash.
func chainBytes(chain []uint64) []byte {
	out := make([]byte, 0, 8*len(chain))
	for _, h := range chain {
		out = append(out, byte(h>>56), byte(h>>48), byte(h>>40), byte(h>>32), byte(h>>24), byte(h>>16), byte(h>>8), byte(h))
	}
	return out
}

// Predict records the chain's blocks as predicted on holder, the holder a router just sent the prompt to
// ("<replica>#<dp_rank>", or a replica name for its rank 0), for p.TTL: until the engine's BlockStored
// reaches the view, lookups with Query.Options["predicted"] = "<weight>" count them, so that a burst of
// requests sharing a new prefix follows the first one instead of scattering. The engine's BlockStored
// of a block confirms it (the real entry counts from then on); a BlockRemoved of it, an
// AllBlocksCleared or Reset of the holder, or its expiry drops predictions made before them.
//
// A write (FCALL kvbus_predict, on the primary; on a Redis Cluster the holder's shard's master, retried
// through slot migrations for Options.RetryFor). Returns the number of blocks recorded: 0 for an empty
// chain, or when the view does not know the holder yet (no event or heartbeat from its bridge).
func (c *Client) Predict(ctx context.Context, holder string, chain []uint64, p Prediction) (int, error) {
	replica, dp := PredictHolder(holder)
	if _, err := predictArgs("", replica, dp, nil, p); err != nil || len(chain) == 0 {
		return 0, err
	}
	views, err := c.viewPrefixes(ctx)
	if err != nil {
		return 0, err
	}
	v, keys := views[0], []string(nil)
	if c.cluster {
		v = views[HolderShard(replica, dp, len(views))]
		keys = []string{v + "meta", v + "guard"}
	}
	args, _ := predictArgs(v, replica, dp, chainBytes(chain), p)
	deadline := time.Now().Add(c.opt.RetryFor)
	delay := 5 * time.Millisecond
	for {
		n, err := c.rdb.FCall(ctx, PredictFunction, keys, args...).Int()
		if err == nil {
			return n, nil
		}
		if !c.cluster || !retryable(err) || time.Now().After(deadline) {
			if isMissing(err) {
				return 0, fmt.Errorf("%w (%v)", ErrFunctionsMissing, err)
			}
			return 0, fmt.Errorf("FCALL %s on %q: %w", PredictFunction, v, err)
		}
		select { // backoff while the slot moves or a replica is promoted
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(delay):
		}
		delay = min(delay*2, 100*time.Millisecond)
	}
}
