package kvbuslookup

import (
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
)

// Match is one holder's answer to a lookup.
type Match struct {
	// Name is the holder's display name: Replica when the replica has one holder of rank 0, else
	// "<replica>#<dp_rank>" (the keys of kvbus lookup --json).
	Name string
	// Replica is the engine replica id: what a router routes to.
	Replica string
	// DPRank is the data-parallel rank of the engine within the replica.
	DPRank int
	// Matched is the number of leading blocks of the chain the holder holds, in any tier (at least 1);
	// for a hybrid-model holder (Groups), the blocks vLLM's hybrid coordinator would hit (at least 1).
	Matched int
	// Score is the sum over the matched blocks of the best weight among the tiers holding each block.
	Score float64
	// ScoreMicro is Score in millionths, as the view answers it (exact; compare these).
	ScoreMicro int64
	// Tiers maps each tier label (GPU, CPU, CPU@kvcr, GPU/g1) to the leading blocks held in that tier.
	Tiers map[string]int
	// Groups maps each KV cache group of a hybrid-model holder (its events named two groups or more)
	// to that group's own hit in blocks of the chain; nil for any other holder.
	Groups map[int]int
}

// Holder is the holder's full name "<replica>#<dp_rank>" (what Query.Candidates accepts too).
func (m Match) Holder() string { return fmt.Sprintf("%s#%d", m.Replica, m.DPRank) }

// tied tells whether two answers are equal for ranking: same score and same matched.
func tied(a, b Match) bool { return a.ScoreMicro == b.ScoreMicro && a.Matched == b.Matched }

// TieBreak orders one run of tied holders (given by display name ascending) and returns it. Answers
// are ranked by score descending, then matched descending; holders equal on both are tied, and a
// tie-break orders them without moving any past a holder with another score or matched.
type TieBreak interface {
	Order(tied []Match) []Match
}

type byName struct{}

func (byName) Order(t []Match) []Match { return t }

// ByName orders tied holders by display name ascending: the order of kvbus lookup --json. It is
// reproducible, and sends every tied prompt to the same replica first.
var ByName TieBreak = byName{}

type shuffle struct {
	mu  sync.Mutex
	rng *rand.Rand
}

func (s *shuffle) Order(t []Match) []Match {
	out := append([]Match(nil), t...)
	s.mu.Lock()
	s.rng.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	s.mu.Unlock()
	return out
}

// Shuffle orders tied holders randomly from a generator seeded with seed: the same seed gives the
// same sequence of orders. Safe for concurrent use.
func Shuffle(seed uint64) TieBreak {
	return &shuffle{rng: rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))}
}

// RandomShuffle orders tied holders randomly, seeded from the OS: a Client's default.
func RandomShuffle() TieBreak { return Shuffle(rand.Uint64()) }

type byLoad struct {
	load func(Match) float64
	then TieBreak
}

func (b byLoad) Order(t []Match) []Match {
	out := b.then.Order(t)
	loads := make(map[string]float64, len(out))
	for _, m := range out {
		loads[m.Name] = b.load(m)
	}
	sort.SliceStable(out, func(i, j int) bool { return loads[out[i].Name] < loads[out[j].Name] })
	return out
}

// ByLoad orders tied holders least loaded first: load returns a holder's load (its queue length,
// its requests in flight: less is better) and is called once per tied holder; holders of equal
// load are ordered by then (nil: RandomShuffle()).
func ByLoad(load func(Match) float64, then TieBreak) TieBreak {
	if then == nil {
		then = RandomShuffle()
	}
	return byLoad{load, then}
}

// Rank sorts ms best first (score descending, matched descending, display name ascending) and
// orders each run of tied holders with tb (nil: ByName). It sorts ms in place and returns it.
func Rank(ms []Match, tb TieBreak) []Match {
	sort.Slice(ms, func(a, b int) bool {
		if ms[a].ScoreMicro != ms[b].ScoreMicro {
			return ms[a].ScoreMicro > ms[b].ScoreMicro
		}
		if ms[a].Matched != ms[b].Matched {
			return ms[a].Matched > ms[b].Matched
		}
		return ms[a].Name < ms[b].Name
	})
	if tb == nil || tb == ByName {
		return ms
	}
	for i := 0; i < len(ms); {
		j := i + 1
		for j < len(ms) && tied(ms[i], ms[j]) {
			j++
		}
		if j-i > 1 {
			copy(ms[i:j], tb.Order(append([]Match(nil), ms[i:j]...)))
		}
		i = j
	}
	return ms
}
