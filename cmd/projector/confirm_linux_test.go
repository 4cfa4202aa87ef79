package main

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// openPTY opens a pseudo-terminal: the master (what a person types into)
// and the slave (the program's stdin).
func openPTY(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR, 0)
	if err != nil {
		t.Skipf("no pseudo-terminals here: %v", err)
	}
	t.Cleanup(func() { m.Close() })
	require.NoError(t, unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0))
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	require.NoError(t, err)
	s, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	require.NoError(t, err)
	t.Cleanup(func() { s.Close() })
	return m, s
}

// On a terminal, a destructive command goes ahead only when the operator
// types the name asked for; off a terminal it refuses (the caller offers
// --yes).
func TestConfirmation(t *testing.T) {
	t.Parallel()
	master, slave := openPTY(t)
	var prompt bytes.Buffer
	env := &Env{Stdin: slave, Stderr: &prompt}

	_, err := master.WriteString("archive_v3\n")
	require.NoError(t, err)
	require.NoError(t, confirm(env, "drop schema archive_v3?", "archive_v3"))
	require.Contains(t, prompt.String(), `type "archive_v3" to confirm`)

	_, err = master.WriteString("yes\n")
	require.NoError(t, err)
	err = confirm(env, "drop schema archive_v3?", "archive_v3")
	require.ErrorContains(t, err, "not confirmed: nothing changed")

	// /dev/null is a character device but not a terminal.
	devNull, err := os.Open(os.DevNull)
	require.NoError(t, err)
	defer devNull.Close()
	err = confirm(&Env{Stdin: devNull, Stderr: &prompt}, "drop?", "x")
	require.ErrorContains(t, err, "pass --yes")
	err = confirm(&Env{Stdin: strings.NewReader("x\n"), Stderr: &prompt}, "drop?", "x")
	require.ErrorContains(t, err, "pass --yes")
}
