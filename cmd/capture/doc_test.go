package main

import (
	"flag"
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/cmd/internal/clidoc"
)

var updateDocs = flag.Bool("update-docs", false, "rewrite docs/cli from the command tree (make docs)")

// docs/cli is generated from the command tree; it must be current.
func TestCLIReferenceIsCurrent(t *testing.T) {
	stale, err := clidoc.CheckReference(newCommand(nil, nil, nil), "../../docs/cli", *updateDocs)
	require.NoError(t, err)
	require.Empty(t, stale, "docs/cli is stale: run `make docs`")
}

// Every capture command the operator and upgrade guides show exists with
// that shape (flags with their values).
func TestOperatorGuidesShowRealCommands(t *testing.T) {
	n := 0
	for _, guide := range []string{"../../docs/operator.md", "../../docs/upgrade.md"} {
		md, err := os.ReadFile(guide)
		require.NoError(t, err)
		for _, args := range clidoc.Commands(string(md), "capture") {
			n++
			assert.NoError(t, clidoc.CheckCommandLine(newCommand(nil, nil, nil), args), "%s", guide)
		}
	}
	require.GreaterOrEqual(t, n, 3)
	require.Error(t, clidoc.CheckCommandLine(newCommand(nil, nil, nil), []string{"capture", "--partitions", "many"}))
}
