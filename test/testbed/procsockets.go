package testbed

import (
	"bufio"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"
)

// ProcessSockets returns the inodes of the sockets among process pid's open
// descriptors, and how many descriptors it has open.
func ProcessSockets(pid int) (inodes map[string]bool, fds int, err error) {
	dir := fmt.Sprintf("/proc/%d/fd", pid)
	entries, err := os.ReadDir(dir)
	if err != nil {
		return nil, 0, err
	}
	inodes = make(map[string]bool)
	for _, e := range entries {
		link, err := os.Readlink(dir + "/" + e.Name())
		if err != nil {
			continue // closed since, such as the directory's own descriptor when pid is this process
		}
		if ino, ok := strings.CutPrefix(link, "socket:["); ok {
			inodes[strings.TrimSuffix(ino, "]")] = true
		}
	}
	return inodes, len(entries), nil
}

// CloseWaitSockets lists process pid's TCP sockets in CLOSE_WAIT (a peer's FIN
// that no close has answered; state 08 in the tcp and tcp6 tables of the
// process's network namespace), as "local remote" address pairs in the
// kernel's hex.
func CloseWaitSockets(pid int) ([]string, error) {
	ours, _, err := ProcessSockets(pid)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, table := range []string{"tcp", "tcp6"} {
		f, err := os.Open(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(f)
		sc.Scan() // header
		for sc.Scan() {
			// sl local rem st tx:rx tr:when retrnsmt uid timeout inode ...
			fields := strings.Fields(sc.Text())
			if len(fields) >= 10 && fields[3] == "08" && ours[fields[9]] {
				out = append(out, fields[1]+" "+fields[2])
			}
		}
		err = sc.Err()
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("read /proc/%d/net/%s: %w", pid, table, err)
		}
	}
	return out, nil
}

// AwaitNoCloseWait waits up to within for process pid to hold no socket in
// CLOSE_WAIT, and returns those it still holds then. A socket can be there a
// moment without leaking (a peer's FIN just in, its close on the way); one still
// there at the end was never closed.
func AwaitNoCloseWait(pid int, within time.Duration) ([]string, error) {
	deadline := time.Now().Add(within)
	for {
		cw, err := CloseWaitSockets(pid)
		if err != nil || len(cw) == 0 || time.Now().After(deadline) {
			return cw, err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// SocketKinds names each of process pid's sockets by the table of its
// network namespace that lists it (tcp, udp6, unix, netlink...), as
// "table inode" strings, for a test's message; a unix socket with a name is
// "unix NAME" (abstract names begin with '@'). A socket no table lists is
// "other inode".
func SocketKinds(pid int) ([]string, error) {
	ours, _, err := ProcessSockets(pid)
	if err != nil {
		return nil, err
	}
	// The column of the inode in each table.
	column := map[string]int{"tcp": 9, "tcp6": 9, "udp": 9, "udp6": 9, "raw": 9, "raw6": 9, "unix": 6, "netlink": 9, "packet": 8}
	found := map[string]string{}
	for table, col := range column {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/net/%s", pid, table))
		if err != nil {
			continue // a table this kernel lacks
		}
		for line := range strings.Lines(string(data)) {
			fields := strings.Fields(line)
			if len(fields) > col && ours[fields[col]] {
				found[fields[col]] = table
				if table == "unix" && len(fields) > 7 {
					found[fields[col]] = "unix " + fields[7]
				}
			}
		}
	}
	var out []string
	for ino := range ours {
		kind, ok := found[ino]
		switch {
		case !ok:
			out = append(out, "other "+ino)
		case strings.HasPrefix(kind, "unix "):
			out = append(out, kind)
		default:
			out = append(out, kind+" "+ino)
		}
	}
	slices.Sort(out)
	return out, nil
}
