package kvbuslookup

import (
	"fmt"
	"sort"
	"strconv"
	"strings"
	"unicode/utf16"
)

// JSON writes ms exactly as kvbus lookup --json prints its answer: one object, holders in the
// order given, each {"matched", "tiers" (sorted by label), "score", "replica", "dp_rank"}, then for a
// hybrid-model holder "groups" (group index as a string -> run, ascending), with Python's
// json.dumps conventions (", " and ": " separators, ASCII-only strings, floats as Python's repr).
func JSON(ms []Match) string {
	var b strings.Builder
	b.WriteString("{")
	for i, m := range ms {
		if i > 0 {
			b.WriteString(", ")
		}
		labels := make([]string, 0, len(m.Tiers))
		for l := range m.Tiers {
			labels = append(labels, l)
		}
		sort.Strings(labels)
		fmt.Fprintf(&b, "%s: {\"matched\": %d, \"tiers\": {", pyString(m.Name), m.Matched)
		for j, l := range labels {
			if j > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "%s: %d", pyString(l), m.Tiers[l])
		}
		fmt.Fprintf(&b, "}, \"score\": %s, \"replica\": %s, \"dp_rank\": %d",
			pyFloat(float64(m.ScoreMicro)/scoreScale), pyString(m.Replica), m.DPRank)
		if len(m.Groups) > 0 {
			gs := make([]int, 0, len(m.Groups))
			for g := range m.Groups {
				gs = append(gs, g)
			}
			sort.Ints(gs)
			b.WriteString(", \"groups\": {")
			for j, g := range gs {
				if j > 0 {
					b.WriteString(", ")
				}
				fmt.Fprintf(&b, "\"%d\": %d", g, m.Groups[g])
			}
			b.WriteString("}")
		}
		b.WriteString("}")
	}
	b.WriteString("}")
	return b.String()
}

// pyString is Python's json.dumps of a string (ensure_ascii).
func pyString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\r':
			b.WriteString(`\r`)
		case '\t':
			b.WriteString(`\t`)
		case '\b':
			b.WriteString(`\b`)
		case '\f':
			b.WriteString(`\f`)
		default:
			if r >= 0x20 && r < 0x7f {
				b.WriteRune(r)
			} else if r > 0xffff {
				r1, r2 := utf16.EncodeRune(r)
				fmt.Fprintf(&b, `\u%04x\u%04x`, r1, r2)
			} else {
				fmt.Fprintf(&b, `\u%04x`, r)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}

// pyFloat is Python's repr of a float: the shortest digits, fixed notation for exponents -4..15
// (with ".0" when integral), else d.ddde[+-]XX.
func pyFloat(f float64) string {
	e := strconv.FormatFloat(f, 'e', -1, 64) // d.ddde±XX
	mant, expS, _ := strings.Cut(e, "e")
	exp, _ := strconv.Atoi(expS)
	if exp < -4 || exp >= 16 {
		sign := "+"
		if exp < 0 {
			sign, exp = "-", -exp
		}
		return fmt.Sprintf("%se%s%02d", mant, sign, exp)
	}
	s := strconv.FormatFloat(f, 'f', -1, 64)
	if !strings.ContainsAny(s, ".") {
		s += ".0"
	}
	return s
}
