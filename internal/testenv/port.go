package testenv

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
)

// FreePort returns a TCP port on 127.0.0.1 that is free now and stays this
// process's to use: a server the test starts later (a nats-server node, a
// PostgreSQL server, a capture's metrics endpoint) binds it, often after a
// while, and a cluster node binds it again on every restart.
//
// A port the kernel hands out for ":0" is in its ephemeral range, the range
// every outgoing connection takes its local port from: once let go, it can
// become the local end of any connection on the machine (a test's pgx pool,
// another test binary's NATS client) and the server that was meant to bind
// it fails with "address already in use". FreePort therefore picks a random
// port below (or above) that range, which the kernel never gives to a
// connection, checks that it binds, and takes a lock on a file named after
// it (flock, held until this process exits) so that no other test binary
// running beside this one is given it too.
func FreePort() (int, error) {
	lo, hi := portRange()
	return freePort(lo, hi)
}

// freePort is FreePort from the ports lo-hi.
func freePort(lo, hi int) (int, error) {
	portsMu.Lock()
	defer portsMu.Unlock()
	dir := filepath.Join(os.TempDir(), "epitaph-test-ports")
	if err := os.MkdirAll(dir, 0o777); err != nil {
		return 0, fmt.Errorf("free port: %w", err)
	}
	// Shared like /tmp: another user's test run may create its own lock
	// files here (it fails only where its owner made it otherwise).
	_ = os.Chmod(dir, 0o777|os.ModeSticky)
	var lastErr error
	for range 20 * (hi - lo + 1) {
		p := lo + rand.IntN(hi-lo+1)
		ok, err := lockPort(dir, p)
		if err != nil {
			return 0, fmt.Errorf("free port: %w", err)
		}
		if !ok {
			continue // another test binary has it, or this one gave it already
		}
		if err := bindAll([]string{net.JoinHostPort("127.0.0.1", strconv.Itoa(p))}); err != nil {
			lastErr = err // something else listens there; keep the lock so no one tries it again
			continue
		}
		return p, nil
	}
	return 0, fmt.Errorf("free port: no free port in %d-%d (last: %v)", lo, hi, lastErr)
}

var (
	portsMu sync.Mutex
	// portLocks keeps the lock files open (and so locked) for the life of
	// the process; the kernel lets the locks go when it exits, however. A
	// lock is also what keeps this process from giving a port twice: flock
	// conflicts between two opens of one file in one process too.
	portLocks []*os.File
)

// lockPort takes an exclusive, non-blocking flock on dir/<port>: false if
// another process holds it.
func lockPort(dir string, port int) (bool, error) {
	// Read-only is enough for flock, and opens another user's lock file.
	f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(port)), os.O_CREATE|os.O_RDONLY, 0o666)
	if errors.Is(err, fs.ErrPermission) {
		return false, nil // another user's, unreadable: leave the port to them
	}
	if err != nil {
		return false, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		_ = f.Close()
		if err == syscall.EWOULDBLOCK {
			return false, nil
		}
		return false, fmt.Errorf("lock %s: %w", f.Name(), err)
	}
	portLocks = append(portLocks, f)
	return true, nil
}

// portRange is the ports FreePort picks from: the larger of the two spans
// outside the kernel's ephemeral range (net.ipv4.ip_local_port_range),
// above the privileged ports and the usual service ports below 10000.
func portRange() (lo, hi int) {
	eLo, eHi := 32768, 60999 // Linux's default
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			a, errA := strconv.Atoi(f[0])
			z, errZ := strconv.Atoi(f[1])
			if errA == nil && errZ == nil && a <= z {
				eLo, eHi = a, z
			}
		}
	}
	return ephemeralComplement(eLo, eHi)
}

// ephemeralComplement is the larger span of ports in 10000-65535 outside
// eLo-eHi; if the ephemeral range leaves fewer than 1000 of them, 10000-65535
// itself (and a collision stays possible, as with ":0").
func ephemeralComplement(eLo, eHi int) (lo, hi int) {
	const floor, ceil = 10000, 65535
	belowLo, belowHi := floor, min(eLo-1, ceil)
	aboveLo, aboveHi := max(eHi+1, floor), ceil
	below, above := belowHi-belowLo+1, aboveHi-aboveLo+1
	switch {
	case below >= above && below >= 1000:
		return belowLo, belowHi
	case above >= 1000:
		return aboveLo, aboveHi
	default:
		return floor, ceil
	}
}
