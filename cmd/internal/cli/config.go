package cli

import (
	"errors"
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.yaml.in/yaml/v3"

	"github.com/epitaph-dev/epitaph/internal/redact"
)

// configFlag is the flag (and configEnv its variable) naming the
// configuration file.
const (
	configFlag = "config"
	configEnv  = "EPITAPH_CONFIG"
)

// ConfigFlag registers --config (EPITAPH_CONFIG) on root and every
// subcommand: a YAML file whose keys are the flags' names. ApplyEnv reads
// it; a flag on the command line, then its EPITAPH_* variable, override it.
func ConfigFlag(root *cobra.Command) {
	var path string
	Persistent(root).String(&path, configFlag, configEnv, "",
		"YAML file of settings, keys the flags' names (source-url: postgres://…); flags and EPITAPH_* variables override it")
}

// configValues reads the file at path: one value per key, as the text a
// flag parses (a list joined with commas, null empty).
func configValues(path string) (map[string]string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc map[string]any
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		return nil, fmt.Errorf("not YAML of key: value lines: %s", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	out := make(map[string]string, len(doc))
	for k, v := range doc {
		s, err := configText(v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", k, err)
		}
		out[k] = s
	}
	return out, nil
}

func configText(v any) (string, error) {
	switch v := v.(type) {
	case nil:
		return "", nil
	case string:
		return v, nil
	case bool:
		return strconv.FormatBool(v), nil
	case int:
		return strconv.Itoa(v), nil
	case float64:
		return strconv.FormatFloat(v, 'g', -1, 64), nil
	case []any:
		parts := make([]string, len(v))
		for i, e := range v {
			s, err := configText(e)
			if err != nil || strings.Contains(s, ",") {
				return "", errors.New("want a list of plain values")
			}
			parts[i] = s
		}
		return strings.Join(parts, ","), nil
	}
	return "", fmt.Errorf("want a value or a list, not %T", v)
}

// flagNames are the names of every flag of the command tree of cmd.
func flagNames(cmd *cobra.Command) map[string]bool {
	names := map[string]bool{}
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		add := func(fl *pflag.Flag) { names[fl.Name] = true }
		c.Flags().VisitAll(add)
		c.PersistentFlags().VisitAll(add)
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(cmd.Root())
	return names
}

// applyConfig sets the flags of cmd that neither the command line nor the
// environment set (skip) from the file --config names, if any. A key that
// is no flag of the binary is refused (a typo would otherwise be silently
// the default); a flag of another command of it is left for that command.
func applyConfig(cmd *cobra.Command, skip map[string]bool) error {
	fl := cmd.Flags().Lookup(configFlag)
	if fl == nil || fl.Value.String() == "" {
		return nil
	}
	path := fl.Value.String()
	values, err := configValues(path)
	if err != nil {
		return Usage("--config %s: %v", path, err)
	}
	known := flagNames(cmd)
	var bad []string
	keys := make([]string, 0, len(values))
	for k := range values {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		if !known[k] || k == configFlag {
			bad = append(bad, fmt.Sprintf("%s: not a flag of %s", k, cmd.Root().Name()))
			continue
		}
		f := cmd.Flags().Lookup(k)
		if f == nil || f.Changed || skip[k] {
			continue
		}
		if err := f.Value.Set(values[k]); err != nil {
			bad = append(bad, fmt.Sprintf("%s=%q: %v", k, redact.URL(values[k]), err))
		}
	}
	if len(bad) > 0 {
		return Usage("--config %s: %s", path, strings.Join(bad, "; "))
	}
	return nil
}
