package ab

import (
	"errors"
	"net"
	"sync"
	"time"
)

// Echo is the server side of an exchange: it writes back every byte it reads,
// on every connection, until the client closes. `uproxy echo` runs one, so the
// backend pods of an A/B comparison can run the same binary.
type Echo struct {
	// Delay, if positive, is waited before writing back each read: a slower
	// backend on purpose, to check that a comparison sees a known difference.
	Delay time.Duration

	mu sync.Mutex
	// conns holds the open connections; Serve closes them when it returns.
	conns map[net.Conn]struct{}
	wg    sync.WaitGroup
}

// Serve accepts connections on ln until ln is closed, then closes the open
// connections, waits for their goroutines and returns nil (or the Accept
// error that ended it, if not a closed listener).
func (e *Echo) Serve(ln net.Listener) error {
	defer e.closeAll()
	for {
		c, err := ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return nil
		}
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return err
		}
		e.mu.Lock()
		if e.conns == nil {
			e.conns = map[net.Conn]struct{}{}
		}
		e.conns[c] = struct{}{}
		e.mu.Unlock()
		e.wg.Add(1)
		go e.echoConn(c)
	}
}

func (e *Echo) echoConn(c net.Conn) {
	defer e.wg.Done()
	defer func() {
		e.mu.Lock()
		delete(e.conns, c)
		e.mu.Unlock()
		c.Close()
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if e.Delay > 0 {
				time.Sleep(e.Delay)
			}
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (e *Echo) closeAll() {
	e.mu.Lock()
	for c := range e.conns {
		c.Close()
	}
	e.mu.Unlock()
	e.wg.Wait()
}
