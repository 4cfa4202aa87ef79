package cli

import (
	"encoding/json"
	"fmt"
	"io"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
)

// Set by the Makefile (and the Dockerfile) with
// -ldflags "-X github.com/epitaph-dev/epitaph/cmd/internal/cli.version=..."
// (and .commit, .buildTime); otherwise taken from the binary's build info.
var (
	version   string
	commit    string
	buildTime string
)

// Build says which build a binary is.
type Build struct {
	// Version is the module version (a tag, a pseudo-version, or "(devel)"
	// for an untagged build from a work tree).
	Version string `json:"version"`
	// Commit is the VCS revision ("unknown" when not recorded).
	Commit string `json:"commit"`
	// Modified reports a build from a work tree with uncommitted changes.
	Modified bool `json:"modified"`
	// BuildTime is when the binary was built (RFC 3339), or the commit's
	// time when only that is known; "unknown" otherwise.
	BuildTime string `json:"build_time"`
	GoVersion string `json:"go_version"`
}

// BuildInfo is this binary's build: the -ldflags values first, then
// debug.ReadBuildInfo (module version, vcs.revision, vcs.time).
func BuildInfo() Build {
	b := Build{Version: version, Commit: commit, BuildTime: buildTime, GoVersion: runtime.Version()}
	if info, ok := debug.ReadBuildInfo(); ok {
		if b.Version == "" {
			b.Version = info.Main.Version
		}
		for _, s := range info.Settings {
			switch s.Key {
			case "vcs.revision":
				if b.Commit == "" {
					b.Commit = s.Value
				}
			case "vcs.time":
				if b.BuildTime == "" {
					b.BuildTime = s.Value
				}
			case "vcs.modified":
				b.Modified = b.Modified || s.Value == "true"
			}
		}
	}
	for _, p := range []*string{&b.Version, &b.Commit, &b.BuildTime} {
		if *p == "" {
			*p = "unknown"
		}
	}
	return b
}

func (b Build) String() string {
	dirty := ""
	if b.Modified {
		dirty = ", modified"
	}
	return fmt.Sprintf("%s (commit %s%s, built %s, %s)", b.Version, b.Commit, dirty, b.BuildTime, b.GoVersion)
}

// RegisterBuildInfo adds the gauge epitaph_build_info{version,commit,go_version} 1.
func RegisterBuildInfo(reg prometheus.Registerer, b Build) error {
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "epitaph_build_info",
		Help: "Always 1; the labels say which build this process runs.",
	}, []string{"version", "commit", "go_version"})
	g.WithLabelValues(b.Version, b.Commit, b.GoVersion).Set(1)
	if err := reg.Register(g); err != nil {
		return fmt.Errorf("register epitaph_build_info: %w", err)
	}
	return nil
}

// SetVersion gives root --version (one line) and a `version [--json]`
// subcommand.
func SetVersion(root *cobra.Command) {
	b := BuildInfo()
	root.Version = b.String()
	root.SetVersionTemplate(root.Name() + " {{.Version}}\n")
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "version",
		Short: "print the version, commit, build time and Go version",
		Args:  NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return printVersion(cmd.OutOrStdout(), root.Name(), b, asJSON)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the build as a JSON object")
	root.AddCommand(cmd)
}

func printVersion(w io.Writer, name string, b Build, asJSON bool) error {
	if asJSON {
		return WriteJSON(w, b)
	}
	_, err := fmt.Fprintf(w, "%s %s\n", name, b)
	return err
}

// WriteJSON prints v as indented JSON: the one --json format of both
// binaries (snake_case field names).
func WriteJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
