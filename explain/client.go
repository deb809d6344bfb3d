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

// servicesView is what /debug/services says: the state of every Service
// port, the address conflicts between Service ports, the source's problems
// (the first of Problems, of ProblemCount in all) and the Service ports the
// last sync left out.
type servicesView struct {
	Services     []observe.ServiceState
	Conflicts    []observe.ConflictState
	Problems     []string
	ProblemCount int
	LeftOut      []string
}

// services returns /debug/services, with the next choice of each Service
// port for client when it is valid.
func (a *proxyAPI) services(client netip.Addr) (*servicesView, error) {
	path := "/debug/services"
	if client.IsValid() {
		path += "?client=" + url.QueryEscape(client.String())
	}
	b, err := a.get(path)
	if err != nil {
		return nil, fmt.Errorf("%w (is uproxy running with --debug-handlers?)", err)
	}
	var body servicesView
	if err := json.Unmarshal(b, &body); err != nil {
		return nil, fmt.Errorf("GET %s: %w", path, err)
	}
	return &body, nil
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
