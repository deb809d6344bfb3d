package registry

import (
	"context"

	"k8s.io/klog/v2"

	"github.com/uproxy/uproxy/kernelmodes/nftables"
	"github.com/uproxy/uproxy/localnodeports"
	"github.com/uproxy/uproxy/proxymode"
	"github.com/uproxy/uproxy/service"
)

// newNFTables builds the nftables mode and, where its section says so, the
// relay that serves its NodePorts on the loopback addresses.
func newNFTables(c proxymode.Common, s *Specific) (proxymode.Mode, error) {
	cfg := s.NFTables.Config
	cfg.Common = c
	m, err := nftables.New(cfg)
	if err != nil {
		return nil, err
	}
	lo := s.NFTables.LoopbackNodePorts
	if !lo[0] && !lo[1] {
		return m, nil
	}
	relay, err := localnodeports.New(localnodeports.Config{IPv4: lo[0], IPv6: lo[1]})
	if err != nil {
		return nil, err
	}
	klog.InfoS("NodePorts answer on loopback through a relay to the ClusterIP", "mode", proxymode.NFTables, "ipv4", lo[0], "ipv6", lo[1])
	return &nftablesWithRelay{Proxier: m, relay: relay}, nil
}

// nftablesWithRelay is the nftables mode with its loopback NodePorts served
// from user space: every method is the mode's but Sync, which brings the
// relay along, and Shutdown, which closes it.
type nftablesWithRelay struct {
	*nftables.Proxier
	relay *localnodeports.Relay
	// relayErr is what the relay's last sync failed of, "" when nothing:
	// a problem is logged when it changes, not at every sync.
	relayErr string
}

// Sync syncs the mode, then the relay: before the sync is reported done, so
// a client that waits for that finds the loopback NodePorts listening too. A
// relay's problem is logged when it appears or changes, and once when it is
// gone; it is not the sync's failure. Syncs are serial.
func (m *nftablesWithRelay) Sync(s *service.Snapshot) error {
	if err := m.Proxier.Sync(s); err != nil {
		return err
	}
	m.logRelay(m.relay.Sync(s))
	return nil
}

// logRelay logs the relay's sync error err when it differs from the last
// one, and once when a sync succeeds after one that failed.
func (m *nftablesWithRelay) logRelay(err error) {
	switch {
	case err != nil && err.Error() != m.relayErr:
		klog.ErrorS(err, "Localhost NodePorts: some are not served; retried at every sync, logged again when it changes")
		m.relayErr = err.Error()
	case err == nil && m.relayErr != "":
		klog.InfoS("Localhost NodePorts: every one served again", "was", m.relayErr)
		m.relayErr = ""
	}
}

// HandOverRelay returns duplicates of the relay's loopback NodePort
// sockets, for a successor (localnodeports.Relay.HandOver).
func (m *nftablesWithRelay) HandOverRelay() ([]localnodeports.HandedSocket, error) {
	return m.relay.HandOver()
}

// AdoptRelay gives the relay a predecessor's loopback NodePort sockets.
func (m *nftablesWithRelay) AdoptRelay(socks []localnodeports.HandedSocket) { m.relay.Adopt(socks) }

// Shutdown closes the relay's sockets, its connections within ctx.
func (m *nftablesWithRelay) Shutdown(ctx context.Context) error {
	return m.relay.Close(ctx)
}
