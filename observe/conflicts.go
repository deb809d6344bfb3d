package observe

import (
	"errors"
	"sync"

	"github.com/uproxy/uproxy/service"
)

// ConflictState is the /debug/services view of a Service port left out because
// another Service port already serves one of its addresses.
type ConflictState struct {
	// Address is what both claim, as 10.96.0.10:80/TCP or nodePort 30080/TCP.
	Address string `json:"address"`
	// IP is the virtual IP ("" for a NodePort, which every node address has);
	// Port is the Service's port, or the NodePort.
	IP       string `json:"ip,omitempty"`
	Port     int    `json:"port"`
	Protocol string `json:"protocol"`
	NodePort bool   `json:"nodePort,omitempty"`
	// ServedBy keeps the address; LeftOut is not served at all (ns/name:port).
	ServedBy string `json:"servedBy"`
	LeftOut  string `json:"leftOut"`
}

// Conflicts keeps the conflicts of the newest Snapshot a source produced, for
// /debug/services and the uproxy_service_port_conflicts gauge. They are the
// source's facts, so they are recorded when a Snapshot is queued, whatever the
// mode makes of it.
type Conflicts struct {
	mu   sync.Mutex
	list []ConflictState // replaced, never modified
}

// Update records the conflicts of s.
func (c *Conflicts) Update(s *service.Snapshot) {
	list := make([]ConflictState, len(s.Conflicts))
	for i, sc := range s.Conflicts {
		list[i] = ConflictState{
			Address:  sc.Claim.String(),
			Port:     sc.Claim.Port,
			Protocol: string(sc.Claim.Protocol),
			NodePort: sc.Claim.NodePort(),
			ServedBy: sc.ServedBy.String(),
			LeftOut:  sc.LeftOut.String(),
		}
		if !sc.Claim.NodePort() {
			list[i].IP = sc.Claim.Addr.String()
		}
	}
	ServicePortConflicts.Set(float64(len(list)))
	c.mu.Lock()
	c.list = list
	c.mu.Unlock()
}

// List returns the conflicts last recorded (never nil); the caller must not
// modify it.
func (c *Conflicts) List() []ConflictState {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.list == nil {
		return []ConflictState{}
	}
	return c.list
}

// Unserved keeps the Service ports of the newest Snapshot a source produced that
// the mode cannot serve (service.UnservedError), for /debug/services, which
// lists them among the Service ports with NotServed saying why. Like conflicts,
// they are the source's facts, recorded when a Snapshot is queued.
type Unserved struct {
	mu   sync.Mutex
	list []ServiceState // replaced, never modified
}

// Update records the unserved Service ports of s.
func (u *Unserved) Update(s *service.Snapshot) {
	var list []ServiceState
	for _, err := range s.Errors {
		var ue *service.UnservedError
		if !errors.As(err, &ue) {
			continue
		}
		st := PortState(ue.Port, "")
		st.NotServed = ue.Reason
		list = append(list, st)
	}
	u.mu.Lock()
	u.list = list
	u.mu.Unlock()
}

// List returns the unserved Service ports last recorded; the caller must not
// modify it.
func (u *Unserved) List() []ServiceState {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.list
}

// maxProblemsListed bounds the problems /debug/services lists; the count is
// whole.
const maxProblemsListed = 100

// Problems keeps what the newest Snapshot a source produced found wrong with
// its objects (a manifest's problems, an API object that does not validate;
// each names its object and field), for /debug/services, uproxy explain and
// the uproxy_source_problems gauge. An object with a problem is left out, or
// kept at its last good version: the log says so once, when it appears, and
// these say so for as long as it lasts. Unserved Service ports are not
// among them: /debug/services lists them with the Service ports.
type Problems struct {
	mu    sync.Mutex
	list  []string // replaced, never modified
	count int
}

// Update records the problems of s.
func (p *Problems) Update(s *service.Snapshot) {
	var list []string
	count := 0
	for _, err := range s.Errors {
		if _, ok := errors.AsType[*service.UnservedError](err); ok {
			continue
		}
		count++
		if len(list) < maxProblemsListed {
			list = append(list, err.Error())
		}
	}
	SourceProblems.Set(float64(count))
	p.mu.Lock()
	p.list, p.count = list, count
	p.mu.Unlock()
}

// List returns the first problems last recorded (never nil) and how many
// there are; the caller must not modify the list.
func (p *Problems) List() ([]string, int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.list == nil {
		return []string{}, p.count
	}
	return p.list, p.count
}
