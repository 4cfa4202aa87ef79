package main

import (
	"flag"
	"testing"

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
