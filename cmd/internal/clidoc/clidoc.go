// Package clidoc renders the CLI reference (docs/cli) from the command
// trees with cobra/doc; only tests import it, so the binaries do not carry
// the Markdown generator.
package clidoc

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

// Reference renders the Markdown CLI reference of root, one file per
// command (cobra/doc), keyed by file name. It is deterministic: no dates,
// no values from the environment or the machine.
func Reference(root *cobra.Command) (map[string][]byte, error) {
	root.DisableAutoGenTag = true
	root.InitDefaultCompletionCmd()
	out := map[string][]byte{}
	var walk func(c *cobra.Command) error
	walk = func(c *cobra.Command) error {
		if !c.IsAvailableCommand() && c != root || c.IsAdditionalHelpTopicCommand() {
			return nil
		}
		c.DisableAutoGenTag = true
		var b bytes.Buffer
		if err := doc.GenMarkdownCustom(c, &b, func(s string) string { return s }); err != nil {
			return fmt.Errorf("generate the reference of %s: %w", c.CommandPath(), err)
		}
		out[strings.ReplaceAll(c.CommandPath(), " ", "_")+".md"] = b.Bytes()
		for _, sub := range c.Commands() {
			if err := walk(sub); err != nil {
				return err
			}
		}
		return nil
	}
	return out, walk(root)
}

// CheckReference compares the reference of root with the files of dir
// that belong to it (named <root>.md and <root>_*.md) and returns what is
// stale, missing or left over; with update it rewrites dir instead.
func CheckReference(root *cobra.Command, dir string, update bool) ([]string, error) {
	want, err := Reference(root)
	if err != nil {
		return nil, err
	}
	have, err := filepath.Glob(filepath.Join(dir, root.Name()+"*.md"))
	if err != nil {
		return nil, err
	}
	var stale []string
	for _, p := range have {
		name := filepath.Base(p)
		if name != root.Name()+".md" && !strings.HasPrefix(name, root.Name()+"_") {
			continue
		}
		if _, ok := want[name]; !ok {
			if update {
				if err := os.Remove(p); err != nil {
					return nil, err
				}
				continue
			}
			stale = append(stale, name+" (no such command any more)")
		}
	}
	for name, body := range want {
		p := filepath.Join(dir, name)
		cur, err := os.ReadFile(p)
		if err == nil && bytes.Equal(cur, body) {
			continue
		}
		if update {
			if err := os.MkdirAll(dir, 0o755); err != nil {
				return nil, err
			}
			if err := os.WriteFile(p, body, 0o644); err != nil {
				return nil, err
			}
			continue
		}
		stale = append(stale, name)
	}
	sort.Strings(stale)
	return stale, nil
}
