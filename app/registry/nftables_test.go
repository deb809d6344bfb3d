package registry

import (
	"errors"
	"testing"

	"github.com/uproxy/uproxy/test/testbed/logs"
)

// A localhost NodePort the relay cannot serve is logged when the problem
// appears or changes, not at every sync, and once when it is gone.
func TestRelayProblemsLoggedWhenTheyChange(t *testing.T) {
	log := logs.Capture(t)
	m := &nftablesWithRelay{}
	held := errors.New("127.0.0.1:10256/TCP of default/np:a: bind: address already in use")
	m.logRelay(held)
	m.logRelay(held)
	logs.Check(t, "the same problem twice", log.Since(), [][]string{
		{"E", `"Localhost NodePorts: some are not served; retried at every sync, logged again when it changes"`, "10256"},
	})
	other := errors.New("127.0.0.1:10249/TCP of default/np:b: bind: address already in use")
	m.logRelay(other)
	logs.Check(t, "another problem", log.Since(), [][]string{{"E", "10249"}})
	m.logRelay(nil)
	m.logRelay(nil)
	logs.Check(t, "gone", log.Since(), [][]string{{"I", `"Localhost NodePorts: every one served again"`, "10249"}})
}
