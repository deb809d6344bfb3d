package main

import (
	"context"
	"strings"
	"testing"
)

// The bench's flags are checked before it builds anything, and each refusal
// names the flag and the value.
func TestBenchCommandRejectsBadFlags(t *testing.T) {
	cases := []struct {
		args []string
		want string
	}{
		{[]string{"bench", "-o", "yaml"}, `-o "yaml": want table or json`},
		{[]string{"bench", "--udp-clients", "-1"}, "--udp-clients -1: want a positive number of clients"},
		{[]string{"bench", "--connection-clients", "-3"}, "--connection-clients -3: want a positive number of clients"},
		{[]string{"bench", "--connection-clients", "65"}, "--connection-clients 65: at most 64"},
		{[]string{"bench", "--proxy-cpus", "x"}, `--proxy-cpus: CPU list "x"`},
	}
	for _, tc := range cases {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, _, err := runCommand(context.Background(), tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("got error %v, want one containing %q", err, tc.want)
			}
		})
	}
}
