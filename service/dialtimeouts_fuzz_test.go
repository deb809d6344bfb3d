package service

import (
	"strings"
	"testing"
)

// FuzzParseDialTimeouts checks --dial-timeouts parsing on arbitrary text: it never
// panics, what it accepts is a list of 1 to MaxDialAttempts positive durations, and
// printing that list and parsing it again gives the same list.
func FuzzParseDialTimeouts(f *testing.F) {
	for _, s := range []string{
		"250ms,500ms,1s,2s", "1s", " 1s , 2s ", "", ",", "1s,,2s", "0s", "-1s", "1h1m1s1ms1us1ns",
		"9223372036854775807ns", "9223372036854775808ns", "1e3s", "1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s,1s",
		"1.5s", "+1s", "1", "ms", "\x00",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		got, err := ParseDialTimeouts(s)
		if err != nil {
			if got != nil {
				t.Errorf("ParseDialTimeouts(%q): got %v with error %v, want nil", s, got, err)
			}
			if !strings.HasPrefix(err.Error(), "dial timeouts") {
				t.Errorf("ParseDialTimeouts(%q): got error %q, want it to name the dial timeouts", s, err)
			}
			return
		}
		if len(got) < 1 || len(got) > MaxDialAttempts {
			t.Fatalf("ParseDialTimeouts(%q): got %d entries, want 1-%d", s, len(got), MaxDialAttempts)
		}
		parts := make([]string, len(got))
		for i, d := range got {
			if d <= 0 {
				t.Errorf("ParseDialTimeouts(%q): entry %d is %v, want positive", s, i+1, d)
			}
			parts[i] = d.String()
		}
		again, err := ParseDialTimeouts(strings.Join(parts, ","))
		if err != nil {
			t.Fatalf("ParseDialTimeouts(%q) printed as %q: got error %v, want it to parse", s, strings.Join(parts, ","), err)
		}
		if len(again) != len(got) {
			t.Fatalf("round trip of %q: got %v, want %v", s, again, got)
		}
		for i := range got {
			if again[i] != got[i] {
				t.Errorf("round trip of %q: entry %d got %v, want %v", s, i+1, again[i], got[i])
			}
		}
	})
}
