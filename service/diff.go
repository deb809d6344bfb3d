package service

import "reflect"

// PortChange is one Service port that differs between two Snapshots: Old is nil
// for a port added, New is nil for a port removed.
type PortChange struct {
	Old, New *Port
}

// Name is the name of the Service port that changed.
func (c PortChange) Name() PortName {
	if c.New != nil {
		return c.New.Name
	}
	return c.Old.Name
}

// Diff returns the Service ports that differ from a to b, in name order: added,
// removed, or changed in any field, endpoints included. a may be nil (every port
// of b is added). Both Snapshots' ports are in name order, as Build makes them,
// so one walk over both finds every change; an unchanged Port that a Builder
// reused is recognised by its pointer.
func Diff(a, b *Snapshot) []PortChange {
	var old []*Port
	if a != nil {
		old = a.Ports
	}
	var changes []PortChange
	i, j := 0, 0
	for i < len(old) || j < len(b.Ports) {
		switch {
		case j == len(b.Ports) || i < len(old) && old[i].Name.Less(b.Ports[j].Name):
			changes = append(changes, PortChange{Old: old[i]})
			i++
		case i == len(old) || b.Ports[j].Name.Less(old[i].Name):
			changes = append(changes, PortChange{New: b.Ports[j]})
			j++
		default:
			if o, n := old[i], b.Ports[j]; o != n && !reflect.DeepEqual(o, n) {
				changes = append(changes, PortChange{Old: o, New: n})
			}
			i++
			j++
		}
	}
	return changes
}
