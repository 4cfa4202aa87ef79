package clidoc

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/spf13/cobra"
)

var (
	fenced = regexp.MustCompile("(?ms)^[ \t]*```[a-z]*\n(.*?)^[ \t]*```")
	inline = regexp.MustCompile("`([^`\n]+(?:\n[^`\n]+)*)`")
)

// Commands returns the command lines of program name that a Markdown
// guide shows: the lines of its code blocks and its inline code spans that
// start with name and a space, split into arguments (the program name
// first) as a shell would, up to a comment, a pipe or a command separator.
// Lines of other programs are left out.
func Commands(md, name string) [][]string {
	var lines []string
	for _, m := range fenced.FindAllStringSubmatch(md, -1) {
		lines = append(lines, strings.Split(m[1], "\n")...)
	}
	rest := fenced.ReplaceAllString(md, "")
	for _, m := range inline.FindAllStringSubmatch(rest, -1) {
		lines = append(lines, strings.Join(strings.Fields(m[1]), " "))
	}
	var out [][]string
	for _, l := range lines {
		for _, part := range splitCommands(l) {
			if args := shellWords(part); len(args) > 0 && args[0] == name {
				out = append(out, args)
			}
		}
	}
	return out
}

// splitCommands splits a shell line at ;, && and || (outside quotes),
// and drops what follows a comment or a pipe.
func splitCommands(line string) []string {
	var parts []string
	var cur strings.Builder
	quote := rune(0)
	rs := []rune(line)
	for i := 0; i < len(rs); i++ {
		r := rs[i]
		switch {
		case quote != 0:
			if r == quote {
				quote = 0
			}
		case r == '\'' || r == '"':
			quote = r
		case r == '#' && (i == 0 || rs[i-1] == ' '):
			return append(parts, cur.String())
		case r == ';', r == '&' && i+1 < len(rs) && rs[i+1] == '&', r == '|' && i+1 < len(rs) && rs[i+1] == '|':
			parts = append(parts, cur.String())
			cur.Reset()
			if r != ';' {
				i++
			}
			continue
		case r == '|':
			return append(parts, cur.String())
		}
		cur.WriteRune(r)
	}
	return append(parts, cur.String())
}

// shellWords splits s at spaces outside quotes and removes the quotes.
func shellWords(s string) []string {
	var out []string
	var cur strings.Builder
	quote, in := rune(0), false
	for _, r := range s {
		switch {
		case quote != 0 && r == quote:
			quote = 0
		case quote != 0:
			cur.WriteRune(r)
		case r == '\'' || r == '"':
			quote, in = r, true
		case r == ' ' || r == '\t':
			if in {
				out = append(out, cur.String())
				cur.Reset()
				in = false
			}
		default:
			cur.WriteRune(r)
			in = true
		}
	}
	if in {
		out = append(out, cur.String())
	}
	return out
}

// CheckCommandLine parses args (the program name first) against the
// command tree root: the subcommand must exist, every flag must be one of
// its flags with a value where it takes one, and the positional arguments
// must be what the command accepts. root is consumed: use a fresh tree per
// line.
func CheckCommandLine(root *cobra.Command, args []string) error {
	line := strings.Join(args, " ")
	root.InitDefaultCompletionCmd()
	cmd, rest, err := root.Find(args[1:])
	if err != nil {
		return fmt.Errorf("%s: %w", line, err)
	}
	if err := cmd.ParseFlags(rest); err != nil {
		return fmt.Errorf("%s: %w", line, err)
	}
	pos := cmd.Flags().Args()
	if cmd.HasSubCommands() && cmd.Args == nil && !cmd.Runnable() {
		return fmt.Errorf("%s: %s needs a subcommand", line, cmd.CommandPath())
	}
	if err := cmd.ValidateArgs(pos); err != nil {
		return fmt.Errorf("%s: %w", line, err)
	}
	return nil
}
