package cli

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"regexp"
	"sort"
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
// flag parses (the scalar's text as written, so a password such as 0123 is
// not read as a number and printed again as 83; a list joined with commas,
// null empty). Errors never quote the file's content (it may be a secret
// file named by mistake).
func configValues(path string) (map[string]string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(raw))
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		// A syntax error (decoding into a node has no type errors, whose
		// messages quote values): its line and what is wrong, no content.
		return nil, fmt.Errorf("not YAML of key: value lines: %s", strings.TrimPrefix(err.Error(), "yaml: "))
	}
	// One document: settings after a second one (---) would be dropped.
	var next yaml.Node
	switch err := dec.Decode(&next); {
	case errors.Is(err, io.EOF):
	case err != nil:
		return nil, fmt.Errorf("not YAML of key: value lines: %s", strings.TrimPrefix(err.Error(), "yaml: "))
	default:
		return nil, fmt.Errorf("line %d: a second document: want one document of key: value lines", next.Line)
	}
	out := map[string]string{}
	if doc.Kind == 0 || (doc.Kind == yaml.DocumentNode && len(doc.Content) == 0) {
		return out, nil // empty
	}
	if doc.Kind != yaml.DocumentNode || len(doc.Content) != 1 || doc.Content[0].Kind != yaml.MappingNode {
		return nil, fmt.Errorf("line %d: not YAML of key: value lines", doc.Line)
	}
	m := doc.Content[0]
	for i := 0; i+1 < len(m.Content); i += 2 {
		k, v := m.Content[i], m.Content[i+1]
		if k.Kind != yaml.ScalarNode {
			return nil, fmt.Errorf("line %d: a key is a flag's name", k.Line)
		}
		if _, twice := out[k.Value]; twice {
			return nil, fmt.Errorf("line %d: %s: given twice", k.Line, k.Value)
		}
		s, err := configText(v)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", k.Value, err)
		}
		out[k.Value] = s
	}
	if err := checkSecretsPrivate(path, out); err != nil {
		return nil, err
	}
	return out, nil
}

// checkSecretsPrivate refuses a file everyone may read (mode o+r) that
// holds a password: a URL's (postgres://user:password@…) or a libpq
// keyword's (password=…). Group read is allowed (root:epitaph 0640, as a
// service's configuration is often kept); a file without a password may
// be read by anyone.
func checkSecretsPrivate(path string, values map[string]string) error {
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	if fi.Mode().Perm()&0o004 == 0 {
		return nil
	}
	var keys []string
	for k, v := range values {
		if holdsPassword(v) {
			keys = append(keys, k)
		}
	}
	if len(keys) == 0 {
		return nil
	}
	sort.Strings(keys)
	return fmt.Errorf("holds a password (%s) and everyone may read it (mode %#o): chmod o-r it, or keep the password out of it (PGPASSFILE, --nats-password-file)",
		strings.Join(keys, ", "), fi.Mode().Perm())
}

// holdsPassword says whether v is a URL with a password (in its user
// information or its password parameter; each of a comma-separated list,
// one without a scheme as nats.go takes it) or a libpq keyword/value
// string with a password (spaces around the = allowed, as libpq and pgx
// do).
func holdsPassword(v string) bool {
	if keywordPassword.MatchString(v) {
		return true
	}
	for _, p := range strings.Split(v, ",") {
		if p = strings.TrimSpace(p); !strings.Contains(p, "://") {
			p = "nats://" + p
		}
		if u, err := url.Parse(p); err == nil {
			if _, ok := u.User.Password(); ok || u.Query().Has("password") { // nil User: none
				return true
			}
		}
	}
	return false
}

// keywordPassword finds libpq's password keyword in a keyword/value string.
var keywordPassword = regexp.MustCompile(`(^|\s)password\s*=`)

func configText(n *yaml.Node) (string, error) {
	if n.Kind == yaml.AliasNode && n.Alias != nil {
		n = n.Alias
	}
	switch n.Kind {
	case yaml.ScalarNode:
		if n.ShortTag() == "!!null" {
			return "", nil
		}
		return n.Value, nil
	case yaml.SequenceNode:
		parts := make([]string, len(n.Content))
		for i, e := range n.Content {
			if e.Kind != yaml.ScalarNode {
				return "", errors.New("want a list of plain values")
			}
			s, err := configText(e)
			if err != nil || strings.Contains(s, ",") {
				return "", errors.New("want a list of plain values")
			}
			parts[i] = s
		}
		return strings.Join(parts, ","), nil
	}
	return "", errors.New("want a value or a list, not a mapping")
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
// the default); a flag of another command of it is left for that command,
// and so is a flag without a variable (an argument, not a setting).
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
		// A flag without a variable is an argument of its command, not a
		// setting: the same name may be another command's setting
		// (handlers add --batch-size beside run's EPITAPH_BATCH_SIZE).
		f := cmd.Flags().Lookup(k)
		if f == nil || f.Changed || skip[k] || EnvOf(f) == "" {
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

// ConfigValue is key's value in the file --config names, if the file sets
// it (a setting another flag defaults to, such as the projector's
// --target-url to source-url, whichever command reads the file).
func ConfigValue(cmd *cobra.Command, key string) (string, bool) {
	fl := cmd.Flags().Lookup(configFlag)
	if fl == nil || fl.Value.String() == "" {
		return "", false
	}
	values, err := configValues(fl.Value.String())
	if err != nil {
		return "", false // reported by ApplyEnv
	}
	v, ok := values[key]
	return v, ok && v != ""
}
