package testenv

import (
	"net"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// TestWaitPortsFreeNamesAHeldPort: a node restarting on a port another
// process holds fails within the wait, naming the port and the bind error,
// instead of waiting for a server that can never become ready.
func TestWaitPortsFreeNamesAHeldPort(t *testing.T) {
	held, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer func() { _ = held.Close() }()
	free, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	freeAddr := free.Addr().String()
	require.NoError(t, free.Close())

	require.NoError(t, waitPortsFree(time.Second, freeAddr))

	start := time.Now()
	err = waitPortsFree(300*time.Millisecond, freeAddr, held.Addr().String())
	require.Error(t, err)
	require.Contains(t, err.Error(), held.Addr().String())
	require.Contains(t, err.Error(), "address already in use")
	require.Less(t, time.Since(start), 10*time.Second)

	// a port let go during the wait is taken
	go func() {
		time.Sleep(200 * time.Millisecond)
		_ = held.Close()
	}()
	require.NoError(t, waitPortsFree(time.Minute, held.Addr().String()))
}
