// Command uringexp compares a short-connection TCP relay on io_uring with the
// same relay on epoll, single-threaded, raw system calls, for a 64-byte
// request/response per connection on loopback.
//
//	uringexp backend ADDR            reply once (64 B) per connection, then close
//	uringexp relay-epoll LISTEN TO   epoll relay
//	uringexp relay-uring LISTEN TO   io_uring relay
//	uringexp load ADDR N C           N connections from C clients
package main

import (
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

func main() {
	switch os.Args[1] {
	case "backend":
		backend(os.Args[2])
	case "relay-epoll":
		runtime.LockOSThread()
		relayEpoll(listen(os.Args[2]), netip.MustParseAddrPort(os.Args[3]))
	case "relay-uring":
		runtime.LockOSThread()
		relayUring(listen(os.Args[2]), netip.MustParseAddrPort(os.Args[3]))
	case "load":
		n, _ := strconv.Atoi(os.Args[3])
		c, _ := strconv.Atoi(os.Args[4])
		load(os.Args[2], n, c)
	}
}

func backend(addr string) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		panic(err)
	}
	fmt.Println(ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			panic(err)
		}
		go func() {
			buf := make([]byte, 64)
			if _, err := io.ReadFull(c, buf); err == nil {
				c.Write(buf)
			}
			c.Close()
		}()
	}
}

func load(addr string, n, clients int) {
	var wg sync.WaitGroup
	per := n / clients
	start := time.Now()
	for range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req := make([]byte, 64)
			resp := make([]byte, 65)
			for range per {
				c, err := net.Dial("tcp", addr)
				if err != nil {
					panic(err)
				}
				c.Write(req)
				if n, err := io.ReadFull(c, resp); err != io.ErrUnexpectedEOF || n != 64 {
					panic(fmt.Sprintf("reply %d %v", n, err))
				}
				c.Close()
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	fmt.Printf("%d conns in %v: %.0f conn/s\n", per*clients, el, float64(per*clients)/el.Seconds())
}

func listen(addr string) int {
	ap := netip.MustParseAddrPort(addr)
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		panic(err)
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
	if err := unix.Bind(fd, &unix.SockaddrInet4{Addr: ap.Addr().As4(), Port: int(ap.Port())}); err != nil {
		panic(err)
	}
	if err := unix.Listen(fd, 4096); err != nil {
		panic(err)
	}
	sa, _ := unix.Getsockname(fd)
	fmt.Println(netip.AddrPortFrom(ap.Addr(), uint16(sa.(*unix.SockaddrInet4).Port)))
	return fd
}
