package explain

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"strings"

	"github.com/uproxy/uproxy/observe"
)

// proxyAPI reads the running proxy's metrics address: /proxyMode,
// /debug/services and /debug/events.
type proxyAPI struct {
	base   string
	client *http.Client
}

func (a *proxyAPI) get(path string) ([]byte, error) {
	resp, err := a.client.Get(a.base + path)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("GET %s: %s: %s", path, resp.Status, bytes.TrimSpace(b))
	}
	return b, nil
}

func (a *proxyAPI) mode() (string, error) {
	b, err := a.get("/proxyMode")
	return strings.TrimSpace(string(b)), err
}

// services returns the state of every Service port, with the next choice for
// client when it is valid, and the address conflicts between Service ports.
func (a *proxyAPI) services(client netip.Addr) ([]observe.ServiceState, []observe.ConflictState, error) {
	path := "/debug/services"
	if client.IsValid() {
		path += "?client=" + url.QueryEscape(client.String())
	}
	b, err := a.get(path)
	if err != nil {
		return nil, nil, fmt.Errorf("%w (is uproxy running with --debug-handlers?)", err)
	}
	var body struct {
		Services  []observe.ServiceState
		Conflicts []observe.ConflictState
	}
	if err := json.Unmarshal(b, &body); err != nil {
		return nil, nil, fmt.Errorf("GET %s: %w", path, err)
	}
	return body.Services, body.Conflicts, nil
}

// failures returns up to n recent events of service that are not plain
// successes: retried and failed connections, ejections and re-admissions.
func (a *proxyAPI) failures(service string, n int) ([]observe.Event, error) {
	path := "/debug/events?limit=1000&service=" + url.QueryEscape(service)
	b, err := a.get(path)
	if err != nil {
		return nil, err
	}
	var body struct{ Events []observe.Event }
	if err := json.Unmarshal(b, &body); err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	var out []observe.Event
	for _, ev := range body.Events {
		if len(out) == n {
			break
		}
		if ev.Kind != observe.KindConnection || ev.Outcome != observe.OutcomeSuccess {
			out = append(out, ev)
		}
	}
	return out, nil
}
