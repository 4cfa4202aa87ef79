// Package cli is the command-line layer both binaries share (cobra): every
// flag with its EPITAPH_* variable through one mechanism and one validation,
// exit codes, the version and the epitaph_build_info gauge, logging flags.
// Only cmd/ imports it: environment and flags are read nowhere else.
package cli

import (
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/epitaph-dev/epitaph/internal/redact"
)

// Flag annotations: the flag's environment variable, and whether an empty
// value of it is meaningful (otherwise an empty variable counts as unset).
const (
	annotationEnv       = "epitaph_env"
	annotationKeepEmpty = "epitaph_env_keep_empty"
)

// Flags registers flags, each with its EPITAPH_* variable, on one of a
// command's flag sets.
type Flags struct {
	cmd *cobra.Command
	fs  *pflag.FlagSet
}

// Local registers flags of cmd alone.
func Local(cmd *cobra.Command) Flags { return Flags{cmd: cmd, fs: cmd.Flags()} }

// Persistent registers flags of cmd and every subcommand.
func Persistent(cmd *cobra.Command) Flags { return Flags{cmd: cmd, fs: cmd.PersistentFlags()} }

// Opt constrains a flag. A constraint is checked when the value is set, so
// the command line and the environment are refused alike, with one message.
type Opt func(*spec)

type spec struct {
	keepEmpty bool
	checks    []func(float64) error
}

// KeepEmpty makes an empty environment value count (it means something,
// such as "embedded broker" or "no metrics server"); by default an empty
// variable is the same as an unset one.
func KeepEmpty() Opt { return func(s *spec) { s.keepEmpty = true } }

// Min refuses a value below n.
func Min(n float64) Opt {
	return func(s *spec) {
		s.checks = append(s.checks, func(v float64) error {
			if v < n {
				return fmt.Errorf("must be at least %s", strconv.FormatFloat(n, 'g', -1, 64))
			}
			return nil
		})
	}
}

// Max refuses a value above n.
func Max(n float64) Opt {
	return func(s *spec) {
		s.checks = append(s.checks, func(v float64) error {
			if v > n {
				return fmt.Errorf("must be at most %s", strconv.FormatFloat(n, 'g', -1, 64))
			}
			return nil
		})
	}
}

// Positive refuses zero and negative values (a zero duration or count that
// would otherwise silently become a default).
func Positive() Opt {
	return func(s *spec) {
		s.checks = append(s.checks, func(v float64) error {
			if v <= 0 {
				return fmt.Errorf("must be positive")
			}
			return nil
		})
	}
}

// NotZero refuses zero (where zero would silently mean a default, and
// negative values mean something of their own).
func NotZero() Opt {
	return func(s *spec) {
		s.checks = append(s.checks, func(v float64) error {
			if v == 0 {
				return fmt.Errorf("must not be zero")
			}
			return nil
		})
	}
}

// NotNegative refuses negative values.
func NotNegative() Opt {
	return func(s *spec) {
		s.checks = append(s.checks, func(v float64) error {
			if v < 0 {
				return fmt.Errorf("must not be negative")
			}
			return nil
		})
	}
}

// checked says what a value that does not parse should have been, and runs
// the constraints after it parsed.
type checked struct {
	pflag.Value
	want   string
	num    func() float64
	checks []func(float64) error
}

func (c *checked) Set(s string) error {
	if err := c.Value.Set(s); err != nil {
		if c.want == "" {
			return err
		}
		return fmt.Errorf("not %s", c.want)
	}
	for _, check := range c.checks {
		if err := check(c.num()); err != nil {
			return err
		}
	}
	return nil
}

// add finishes a flag registered on f.fs: its usage names the variable,
// its annotations carry it, its value is wrapped in its constraints.
func (f Flags) add(name, env, want string, num func() float64, opts []Opt) *pflag.Flag {
	fl := f.fs.Lookup(name)
	var s spec
	for _, o := range opts {
		o(&s)
	}
	if num == nil && len(s.checks) > 0 {
		panic("cli: numeric constraint on the non-numeric flag --" + name)
	}
	fl.Value = &checked{Value: fl.Value, want: want, num: num, checks: s.checks}
	if env != "" {
		fl.Usage += " (" + env + ")"
		_ = f.fs.SetAnnotation(name, annotationEnv, []string{env})
		if s.keepEmpty {
			_ = f.fs.SetAnnotation(name, annotationKeepEmpty, []string{"true"})
		}
	}
	return fl
}

// String registers a text flag. Its default is def, never a value from the
// environment, so help never shows a secret.
func (f Flags) String(p *string, name, env, def, usage string, opts ...Opt) {
	f.fs.StringVar(p, name, def, usage)
	f.add(name, env, "", nil, opts)
}

// Int registers an integer flag.
func (f Flags) Int(p *int, name, env string, def int, usage string, opts ...Opt) {
	f.fs.IntVar(p, name, def, usage)
	f.add(name, env, "an integer", func() float64 { return float64(*p) }, opts)
}

// Int64 registers a 64-bit integer flag.
func (f Flags) Int64(p *int64, name, env string, def int64, usage string, opts ...Opt) {
	f.fs.Int64Var(p, name, def, usage)
	f.add(name, env, "an integer", func() float64 { return float64(*p) }, opts)
}

// Float64 registers a number flag.
func (f Flags) Float64(p *float64, name, env string, def float64, usage string, opts ...Opt) {
	f.fs.Float64Var(p, name, def, usage)
	f.add(name, env, "a number", func() float64 { return *p }, opts)
}

// Duration registers a duration flag (Go syntax: 15s, 2m, 1h30m); the
// constraints compare seconds.
func (f Flags) Duration(p *time.Duration, name, env string, def time.Duration, usage string, opts ...Opt) {
	f.fs.DurationVar(p, name, def, usage)
	f.add(name, env, "a duration (such as 15s, 2m or 1h30m)", func() float64 { return p.Seconds() }, opts)
}

// Bool registers a boolean flag (true/false, 1/0 in the environment).
func (f Flags) Bool(p *bool, name, env string, def bool, usage string, opts ...Opt) {
	f.fs.BoolVar(p, name, def, usage)
	f.add(name, env, "a boolean (true or false)", nil, opts)
}

// Enum registers a text flag that takes one of choices (case-insensitive);
// the shell completes them.
func (f Flags) Enum(p *string, name, env, def string, choices []string, usage string, opts ...Opt) {
	*p = def
	f.fs.Var(&enumValue{p: p, choices: choices}, name, usage)
	f.fs.Lookup(name).DefValue = def
	f.add(name, env, "", nil, opts)
	_ = f.cmd.RegisterFlagCompletionFunc(name, cobra.FixedCompletions(choices, cobra.ShellCompDirectiveNoFileComp))
}

// Var registers a flag of a custom type.
func (f Flags) Var(v pflag.Value, name, env, usage string, opts ...Opt) {
	f.fs.Var(v, name, usage)
	f.add(name, env, "", nil, opts)
}

type enumValue struct {
	p       *string
	choices []string
}

func (e *enumValue) String() string { return *e.p }
func (e *enumValue) Type() string   { return "string" }
func (e *enumValue) Set(s string) error {
	for _, c := range e.choices {
		if strings.EqualFold(s, c) {
			*e.p = c
			return nil
		}
	}
	return fmt.Errorf("want one of %s", strings.Join(e.choices, ", "))
}

// EnvOf is the environment variable of a flag ("" when it has none).
func EnvOf(fl *pflag.Flag) string {
	if v := fl.Annotations[annotationEnv]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// ApplyEnv sets every flag of cmd (its own and the inherited ones) that was
// not given on the command line from its variable, else from the
// configuration file (--config, see ConfigFlag), through the flag's own
// parser and constraints: a malformed or out-of-range value is an error
// naming the variable or the file's key, never silently the default. All
// bad variables are reported together, on one line.
func ApplyEnv(cmd *cobra.Command, lookup func(string) (string, bool)) error {
	var bad []string
	fromEnv := map[string]bool{}
	cmd.Flags().VisitAll(func(fl *pflag.Flag) {
		env := EnvOf(fl)
		if env == "" || fl.Changed {
			return
		}
		v, ok := lookup(env)
		if !ok || (v == "" && len(fl.Annotations[annotationKeepEmpty]) == 0) {
			return
		}
		fromEnv[fl.Name] = true
		if err := fl.Value.Set(v); err != nil {
			bad = append(bad, fmt.Sprintf("%s=%q: %v", env, redact.URL(v), err))
		}
	})
	if len(bad) > 0 {
		return Usage("bad environment: %s", strings.Join(bad, "; "))
	}
	return applyConfig(cmd, fromEnv)
}
