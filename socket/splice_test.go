package socket

import (
	"crypto/sha256"
	"runtime"
	"testing"
)

// A bulk transfer on an open connection needs a pipe to splice through. When
// none can be made (the process is out of descriptors) the connection is not at
// fault: its direction copies through the loop's buffer instead, and every byte
// arrives, both ways.
func TestTCPProxyCopiesWithoutPipes(t *testing.T) {
	const size = 4 << 20 // many times the loop's buffer: bulk either way
	backend := startTCPServer(t, "127.0.0.2", echo)
	rec := &recorder{}
	p := &TCPProxy{Service: "ns/svc:tcp", Picker: newCyclePicker(backend.addr), Observer: rec}
	client := dialProxy(t, startTCPProxy(t, p))
	// Both connections are open before descriptors run out; small reads take
	// no pipe.
	if got, err := roundTrip(client, []byte("warm")); err != nil || string(got) != "warm" {
		t.Fatalf("round trip before descriptors run out: got %q, %v", got, err)
	}
	// Pooled pipes from earlier tests would hide the shortage: two collections
	// empty the pool, and their cleanups close the pipes before fill is done.
	runtime.GC()
	runtime.GC()
	st := starveDescriptors(t)
	st.fill()

	up := payload(3, size)
	got, err := exchangeAll(client, up)
	st.restore()
	if err != nil {
		t.Fatalf("echo without pipes: %v", err)
	}
	if len(got) != size || sha256.Sum256(got) != sha256.Sum256(up) {
		t.Fatalf("echo without pipes: got %d bytes (sha256 %x), want %d bytes (sha256 %x)", len(got), sha256.Sum256(got), size, sha256.Sum256(up))
	}
	client.Close()
	c := rec.awaitClosed(t, 1)[0]
	if c.Err != nil || c.BytesIn != size+4 || c.BytesOut != size+4 {
		t.Errorf("record: got in %d, out %d, err %v; want %d both ways and no error", c.BytesIn, c.BytesOut, c.Err, size+4)
	}
}
