package kvbuslookup

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"math/big"
	"strconv"
	"strings"

	"github.com/zeebo/xxh3"
)

// Hash algorithms: vLLM's --prefix-caching-hash-algo values.
const (
	SHA256     = "sha256"      // SHA-256 of pickle protocol 5 (vLLM's default)
	SHA256CBOR = "sha256_cbor" // SHA-256 of canonical CBOR
	XXHash     = "xxhash"      // XXH3-128 of pickle protocol 5
	XXHashCBOR = "xxhash_cbor" // XXH3-128 of canonical CBOR
)

// noneHashSeed is vLLM's NONE_HASH seed for the sha256 family when PYTHONHASHSEED is not set.
const noneHashSeed = "vllm-none-hash"

// maxFrame: the pickle encoder writes one frame; pickle starts a new one past 64 KiB.
const maxFrame = 64 * 1024

// ErrUnmatchableSeed: an xxhash chain was asked for without the engines' PYTHONHASHSEED; without
// one vLLM seeds each engine process's hashes with random bytes no router can know.
var ErrUnmatchableSeed = errors.New("the xxhash algorithms need the engines' PYTHONHASHSEED: without it " +
	"vLLM seeds each engine process's hashes with random bytes no router can know")

// ParseHashes reads block hashes "h1,h2,..." (decimal uint64, negative int64 as SGLang publishes,
// or 0x-hex), block 0 first.
func ParseHashes(s string) ([]uint64, error) {
	var out []uint64
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
			return nil, fmt.Errorf("not a 64-bit block hash: %q (decimal uint64, negative int64 or 0x-hex)", p)
		}
		out = append(out, v)
	}
	return out, nil
}

// ParseTokens reads token ids "1,2,3".
func ParseTokens(s string) ([]uint64, error) {
	var out []uint64
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		t, err := strconv.ParseUint(p, 10, 64)
		if err != nil {
			return nil, fmt.Errorf("token ids must be non-negative integers: %q", p)
		}
		out = append(out, t)
	}
	return out, nil
}

// ChainFromTokens computes the block hashes a vLLM engine publishes for a prompt
// (docs/lookup-protocol.md, "Block hashes"): blockSize tokens per full block (a trailing partial
// block has none), algo the engine's --prefix-caching-hash-algo, seed its PYTHONHASHSEED (nil: not
// set; then the sha256 family uses vLLM's default seed and the xxhash family fails with
// ErrUnmatchableSeed). Plain prompts only: no LoRA, cache salt or multimodal extra keys.
func ChainFromTokens(tokens []uint64, blockSize int, algo string, seed *string) ([]uint64, error) {
	var h func([]byte) []byte
	var enc func(parent []byte, toks []uint64) ([]byte, error)
	var encSeed func(string) []byte
	switch algo {
	case SHA256, SHA256CBOR:
		h = func(b []byte) []byte { d := sha256.Sum256(b); return d[:] }
	case XXHash, XXHashCBOR:
		h = func(b []byte) []byte { d := xxh3.Hash128(b).Bytes(); return d[:] }
		if seed == nil {
			return nil, fmt.Errorf("%s: %w", algo, ErrUnmatchableSeed)
		}
	default:
		return nil, fmt.Errorf("unknown hash algorithm %q; one of sha256, sha256_cbor, xxhash, xxhash_cbor", algo)
	}
	if strings.HasSuffix(algo, "_cbor") {
		enc, encSeed = cborBlock, cborText
	} else {
		enc, encSeed = pickleBlock, pickleText
	}
	if blockSize <= 0 {
		return nil, errors.New("block size must be positive")
	}
	s := noneHashSeed
	if seed != nil {
		s = *seed
	}
	parent := h(encSeed(s))
	var chain []uint64
	for i := 0; (i+1)*blockSize <= len(tokens); i++ {
		in, err := enc(parent, tokens[i*blockSize:(i+1)*blockSize])
		if err != nil {
			return nil, err
		}
		parent = h(in)
		chain = append(chain, binary.BigEndian.Uint64(parent[len(parent)-8:]))
	}
	return chain, nil
}

// --- canonical CBOR (RFC 8949 core deterministic encoding: shortest heads)

// cborBlock is CBOR of [parent digest, [tokens...], null].
func cborBlock(parent []byte, toks []uint64) ([]byte, error) {
	in := []byte{0x83}
	in = append(in, cborHead(2, uint64(len(parent)))...)
	in = append(in, parent...)
	in = append(in, cborHead(4, uint64(len(toks)))...)
	for _, t := range toks {
		in = append(in, cborHead(0, t)...)
	}
	return append(in, 0xf6), nil
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
	return []byte{m | 27, byte(n >> 56), byte(n >> 48), byte(n >> 40), byte(n >> 32), byte(n >> 24), byte(n >> 16),
		byte(n >> 8), byte(n)}
}

func cborText(s string) []byte { return append(cborHead(3, uint64(len(s))), s...) }

// --- pickle protocol 5, as CPython's pickle.dumps(x, protocol=5) writes the values vLLM hashes

const (
	pProto          = 0x80
	pFrame          = 0x95
	pShortBinBytes  = 'C'
	pBinBytes       = 'B'
	pShortBinUnicod = 0x8c
	pBinUnicode     = 'X'
	pMemoize        = 0x94
	pMark           = '('
	pTuple          = 't'
	pEmptyTuple     = ')'
	pBinInt1        = 'K'
	pBinInt2        = 'M'
	pBinInt         = 'J'
	pLong1          = 0x8a
	pNone           = 'N'
	pStop           = '.'
)

var pTupleN = [4]byte{pEmptyTuple, 0x85, 0x86, 0x87} // EMPTY_TUPLE, TUPLE1, TUPLE2, TUPLE3

// pickleFramed is PROTO 5, then the body as one frame (FRAME and its 8-byte length, when the body
// has at least 4 bytes, as CPython writes it).
func pickleFramed(body []byte) ([]byte, error) {
	if len(body) > maxFrame {
		return nil, fmt.Errorf("a block of this size pickles to %d bytes, more than one pickle frame (%d)",
			len(body), maxFrame)
	}
	out := []byte{pProto, 5}
	if len(body) >= 4 {
		out = append(out, pFrame)
		out = binary.LittleEndian.AppendUint64(out, uint64(len(body)))
	}
	return append(out, body...), nil
}

// pickleBlock is pickle of (parent digest, tuple(tokens), None).
func pickleBlock(parent []byte, toks []uint64) ([]byte, error) {
	var b []byte
	if len(parent) <= 0xff {
		b = append(b, pShortBinBytes, byte(len(parent)))
	} else {
		b = append(b, pBinBytes)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(parent)))
	}
	b = append(b, parent...)
	b = append(b, pMemoize)
	if len(toks) > 3 {
		b = append(b, pMark)
	}
	for _, t := range toks {
		b = pickleInt(b, t)
	}
	switch {
	case len(toks) > 3:
		b = append(b, pTuple, pMemoize)
	case len(toks) > 0:
		b = append(b, pTupleN[len(toks)], pMemoize)
	default:
		b = append(b, pEmptyTuple) // the empty tuple is a singleton: not memoized
	}
	b = append(b, pNone, pTupleN[3], pMemoize, pStop)
	return pickleFramed(b)
}

// pickleInt appends a non-negative int as BININT1, BININT2, BININT or LONG1.
func pickleInt(b []byte, t uint64) []byte {
	switch {
	case t <= 0xff:
		return append(b, pBinInt1, byte(t))
	case t <= 0xffff:
		return append(b, pBinInt2, byte(t), byte(t>>8))
	case t <= 0x7fffffff:
		return binary.LittleEndian.AppendUint32(append(b, pBinInt), uint32(t))
	}
	// LONG1: little-endian two's complement in bit_length/8 + 1 bytes
	be := new(big.Int).SetUint64(t).Bytes()
	n := len(be)
	if be[0]&0x80 != 0 {
		n++
	}
	b = append(b, pLong1, byte(n))
	for i := len(be) - 1; i >= 0; i-- {
		b = append(b, be[i])
	}
	for i := len(be); i < n; i++ {
		b = append(b, 0)
	}
	return b
}

// pickleText is pickle of a str (the NONE_HASH seed).
func pickleText(s string) []byte {
	var b []byte
	if len(s) <= 0xff {
		b = append(b, pShortBinUnicod, byte(len(s)))
	} else {
		b = append(b, pBinUnicode)
		b = binary.LittleEndian.AppendUint32(b, uint32(len(s)))
	}
	b = append(b, s...)
	b = append(b, pMemoize, pStop)
	out, _ := pickleFramed(b) // a seed longer than a frame is not a PYTHONHASHSEED
	return out
}
