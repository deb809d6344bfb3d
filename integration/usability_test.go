package integration

import (
	"regexp"
	"testing"

	"github.com/uproxy/uproxy/testbed"
)

// TestServingLogsTheAddressAsked: the log names the HTTP addresses as their
// flags give them. Go listens on 0.0.0.0 with a socket of both families, whose
// own address reads [::]; the log said that for a 0.0.0.0 flag.
func TestServingLogsTheAddressAsked(t *testing.T) {
	tp := testbed.New(t)
	px := runUproxy(t, tp, webService(t, tp), launch{want: 1, defaultAddrs: true, flags: []string{"--rules", "none"}})
	log := px.logText()
	for _, want := range []string{`"Serving" address="0.0.0.0:10256"`, `"Serving" address="127.0.0.1:10249"`} {
		if !regexp.MustCompile(regexp.QuoteMeta(want)).MatchString(log) {
			t.Errorf("log lacks %s:\n%s", want, tail(log, 20))
		}
	}
}
