package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/internal/redact"
)

// Exit codes of both binaries.
const (
	ExitOK    = 0
	ExitError = 1
	// ExitUsage: the command line or the environment is wrong (unknown
	// command or flag, a bad value, missing or extra arguments).
	ExitUsage = 2
	// ExitTimeout: `projector wait` gave up (2 by the documented contract
	// of wait; the same number as a usage error).
	ExitTimeout = 2
	// ExitNotEqual: the command worked and the answer is "no": compare
	// found differences, wait timed out or cannot complete, a status check
	// failed.
	ExitNotEqual = 3
)

// UsageError is a mistake on the command line or in the environment
// (exit 2).
type UsageError struct{ Err error }

func (e *UsageError) Error() string { return e.Err.Error() }
func (e *UsageError) Unwrap() error { return e.Err }

// Usage makes a UsageError.
func Usage(format string, args ...any) error {
	return &UsageError{Err: fmt.Errorf(format, args...)}
}

// CodeError carries an exit code other than 1 (ExitNotEqual).
type CodeError struct {
	Code int
	Err  error
}

func (e *CodeError) Error() string { return e.Err.Error() }
func (e *CodeError) Unwrap() error { return e.Err }

// WithCode makes err exit with code.
func WithCode(code int, err error) error { return &CodeError{Code: code, Err: err} }

// Code is the exit code for the error a command returned.
func Code(err error) int {
	var ue *UsageError
	var ce *CodeError
	switch {
	case err == nil:
		return ExitOK
	case errors.As(err, &ce):
		return ce.Code
	case errors.As(err, &ue):
		return ExitUsage
	}
	return ExitError
}

// Report prints err as one line "<name>: <message>" on w, passwords
// hidden, and returns the exit code.
func Report(w io.Writer, name string, err error) int {
	if err == nil {
		return ExitOK
	}
	msg := strings.Join(strings.Fields(strings.ReplaceAll(err.Error(), "\n", " ")), " ")
	fmt.Fprintln(w, name+": "+redact.Text(msg))
	return Code(err)
}

// annotationUsageExit on a command replaces ExitUsage for its usage errors
// (wait gives 2 to a timeout, so a usage error is 1).
const annotationUsageExit = "epitaph_usage_exit"

// UsageExit makes cmd's usage errors exit with code instead of ExitUsage.
func UsageExit(cmd *cobra.Command, code int) {
	if cmd.Annotations == nil {
		cmd.Annotations = map[string]string{}
	}
	cmd.Annotations[annotationUsageExit] = strconv.Itoa(code)
}

// Execute runs root and returns the error of the command that ran, with
// that command's own exit code for usage errors (UsageExit).
func Execute(ctx context.Context, root *cobra.Command) error {
	cmd, err := root.ExecuteContextC(ctx)
	var ue *UsageError
	var ce *CodeError
	if err == nil || cmd == nil || !errors.As(err, &ue) || errors.As(err, &ce) {
		return err
	}
	if code, convErr := strconv.Atoi(cmd.Annotations[annotationUsageExit]); convErr == nil {
		return WithCode(code, err)
	}
	return err
}

// Args requires exactly n positional arguments (extra ones are refused,
// never ignored).
func Args(n int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return usageArgs(cmd, fmt.Sprintf("want %d argument(s), got %d", n, len(args)))
		}
		return nil
	}
}

// RangeArgs requires between lo and hi positional arguments.
func RangeArgs(lo, hi int) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) < lo || len(args) > hi {
			return usageArgs(cmd, fmt.Sprintf("want %d to %d arguments, got %d", lo, hi, len(args)))
		}
		return nil
	}
}

// NoArgs refuses any positional argument.
func NoArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		if cmd.HasSubCommands() {
			return unknownCommand(cmd, args[0])
		}
		return usageArgs(cmd, fmt.Sprintf("takes no arguments, got %q", strings.Join(args, " ")))
	}
	return nil
}

func usageArgs(cmd *cobra.Command, what string) error {
	return Usage("%s: %s (usage: %s)", cmd.CommandPath(), what, cmd.UseLine())
}

func unknownCommand(cmd *cobra.Command, name string) error {
	msg := fmt.Sprintf("unknown command %q for %q", name, cmd.CommandPath())
	if s := cmd.SuggestionsFor(name); len(s) > 0 {
		msg += "; did you mean " + strings.Join(s, " or ") + "?"
	}
	return Usage("%s (see '%s --help')", msg, cmd.CommandPath())
}

// Group makes cmd a command that only holds subcommands: run alone it is
// a usage error naming them, and an unknown subcommand is refused.
func Group(cmd *cobra.Command) *cobra.Command {
	cmd.Args = cobra.ArbitraryArgs
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return unknownCommand(cmd, args[0])
		}
		var names []string
		for _, c := range cmd.Commands() {
			if c.IsAvailableCommand() {
				names = append(names, c.Name())
			}
		}
		return Usage("%s needs a subcommand: %s (see '%s --help')", cmd.CommandPath(), strings.Join(names, ", "), cmd.CommandPath())
	}
	return cmd
}

// Prepare readies a command tree writing to stdout and stderr (nil: the
// process's): flag errors are usage errors, errors and usage are printed by
// Report (once, on one line), and every runnable command without an
// argument rule refuses extra arguments. Call it last, once every command
// has its Run (a command without one is taken for a group).
func Prepare(root *cobra.Command, stdout, stderr io.Writer) {
	if stdout != nil {
		root.SetOut(stdout)
	}
	if stderr != nil {
		root.SetErr(stderr)
	}
	root.SilenceErrors = true
	root.SilenceUsage = true
	root.SetFlagErrorFunc(func(cmd *cobra.Command, err error) error {
		return Usage("%v (see '%s --help')", err, cmd.CommandPath())
	})
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd() // after SetOut: it keeps the writer it finds
	var walk func(c *cobra.Command)
	walk = func(c *cobra.Command) {
		switch {
		case c.Name() == "help" && c.Parent() == root:
			// cobra's help command takes a command path.
		case !c.Runnable() && c.HasSubCommands():
			Group(c) // completion: an unknown shell is refused
		case c.Args == nil && c.Runnable():
			c.Args = NoArgs
		case c.Args != nil:
			// Arguments that do not fit are a usage error, also for the
			// commands cobra adds (completion).
			check := c.Args
			c.Args = func(cmd *cobra.Command, args []string) error {
				err := check(cmd, args)
				var ue *UsageError
				if err != nil && !errors.As(err, &ue) {
					return Usage("%v (see '%s --help')", err, cmd.CommandPath())
				}
				return err
			}
		}
		for _, sub := range c.Commands() {
			walk(sub)
		}
	}
	walk(root)
}
