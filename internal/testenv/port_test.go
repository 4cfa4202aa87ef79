package testenv

import (
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestFreePortIsOutsideTheEphemeralRange: the ports FreePort gives are
// never ones the kernel hands to outgoing connections (the CI failure this
// prevents: a cluster node's port, let go after the check, became the local
// end of another test's connection), never the same twice, and each binds.
func TestFreePortIsOutsideTheEphemeralRange(t *testing.T) {
	eLo, eHi := 32768, 60999
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		var a, z int
		_, err := fmt.Sscan(string(b), &a, &z)
		require.NoError(t, err)
		eLo, eHi = a, z
	}
	seen := map[int]bool{}
	for range 50 {
		p, err := FreePort()
		require.NoError(t, err)
		require.False(t, p >= eLo && p <= eHi, "port %d is in the ephemeral range %d-%d", p, eLo, eHi)
		require.GreaterOrEqual(t, p, 10000)
		require.False(t, seen[p], "port %d given twice", p)
		seen[p] = true
	}
}

// TestFreePortSkipsAPortAnotherProcessHolds: of ten ports, nine locked by
// another holder (an open file description of its own stands in for the
// other test binary: flock conflicts between the two as between
// processes), the one left is given, and then none.
func TestFreePortSkipsAPortAnotherProcessHolds(t *testing.T) {
	dir := filepath.Join(os.TempDir(), "epitaph-test-ports")
	require.NoError(t, os.MkdirAll(dir, 0o777))
	// ten ports just above the privileged ones, where no other test looks
	var lo, hi, left int
	for {
		lo = 2000 + rand.IntN(7000)
		hi, left = lo+9, lo+rand.IntN(10)
		if l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(left))); err == nil {
			require.NoError(t, l.Close())
			break
		}
	}
	for p := lo; p <= hi; p++ {
		if p == left {
			continue
		}
		f, err := os.OpenFile(filepath.Join(dir, strconv.Itoa(p)), os.O_CREATE|os.O_RDONLY, 0o666)
		require.NoError(t, err)
		t.Cleanup(func() { _ = f.Close() })
		require.NoError(t, syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB))
	}
	got, err := freePort(lo, hi)
	require.NoError(t, err)
	require.Equal(t, left, got)
	_, err = freePort(lo, hi)
	require.ErrorContains(t, err, fmt.Sprintf("no free port in %d-%d", lo, hi))
}

func TestEphemeralComplement(t *testing.T) {
	for _, c := range []struct{ eLo, eHi, lo, hi int }{
		{32768, 60999, 10000, 32767}, // Linux default: below is larger
		{15000, 65000, 10000, 14999},
		{10000, 50000, 50001, 65535}, // only above
		{10500, 65535, 10000, 65535}, // too few either side
		{1024, 65535, 10000, 65535},
	} {
		lo, hi := ephemeralComplement(c.eLo, c.eHi)
		require.Equal(t, [2]int{c.lo, c.hi}, [2]int{lo, hi}, "ephemeral %d-%d", c.eLo, c.eHi)
	}
}
