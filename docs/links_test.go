// Package docs holds the checks of the Markdown guide: every relative link
// of the README and of docs/*.md resolves, and every test that
// guarantees.md names exists. docs/cli is generated and checked by the
// binaries' own tests.
package docs

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"
	"unicode"

	"github.com/stretchr/testify/require"
)

// guideFiles are the Markdown files the links are checked in, relative to
// the repository root: the README and docs/*.md (not docs/cli/).
func guideFiles(t *testing.T, root string) []string {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	require.NoError(t, err)
	files = append(files, filepath.Join(root, "README.md"))
	sort.Strings(files)
	return files
}

func TestRelativeLinksResolve(t *testing.T) {
	t.Parallel()
	files := guideFiles(t, "..")
	require.GreaterOrEqual(t, len(files), 10, "the README and the guide")
	n := 0
	var broken []string
	for _, f := range files {
		links, bad := checkLinks(f)
		n += links
		broken = append(broken, bad...)
	}
	require.Empty(t, broken, "broken relative links")
	require.Greater(t, n, 50, "relative links checked")
}

// The checker finds a missing file, a missing heading in another file and
// in its own, and leaves external links, code and good anchors alone.
func TestLinkCheckerCanFail(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	write := func(name, text string) {
		require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(dir, name)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(dir, name), []byte(text), 0o644))
	}
	write("sub/other.md", "# Other\n\n## `make bench-x`: a vs `b_c`\n\n```sh\n# not a heading\n```\n\n## Twice\n\n## Twice\n")
	write("a.md", strings.Join([]string{
		"# A",
		"## 2. Roles",
		"[ok](sub/other.md) [ok](sub/other.md#make-bench-x-a-vs-b_c) [ok](sub/other.md#twice-1)",
		"[ok](#2-roles) [ok](sub/) [ok](https://example.com/x.md) [ok](mailto:a@b.c)",
		"`[code](missing-in-code.md)`",
		"```",
		"[fenced](missing-in-fence.md)",
		"```",
		"[gone](missing.md) [no heading](sub/other.md#not-a-heading) [self](#nowhere)",
		"[dir gone](nodir/) [fenced heading](sub/other.md#not-a-heading-1)",
	}, "\n"))
	links, broken := checkLinks(filepath.Join(dir, "a.md"))
	require.Equal(t, 10, links)
	require.Equal(t, []string{
		filepath.Join(dir, "a.md") + ": missing.md: no such file",
		filepath.Join(dir, "a.md") + ": sub/other.md#not-a-heading: no such heading",
		filepath.Join(dir, "a.md") + ": #nowhere: no such heading",
		filepath.Join(dir, "a.md") + ": nodir/: no such file",
		filepath.Join(dir, "a.md") + ": sub/other.md#not-a-heading-1: no such heading",
	}, broken)
}

var (
	fence    = regexp.MustCompile("(?ms)^\\s*```.*?^\\s*```[^\\n]*$")
	codeSpan = regexp.MustCompile("`[^`\\n]*`")
	link     = regexp.MustCompile(`\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)`)
	heading  = regexp.MustCompile(`(?m)^#{1,6}\s+(.+?)\s*#*\s*$`)
	external = regexp.MustCompile(`^[a-zA-Z][a-zA-Z0-9+.-]*:`)
)

// checkLinks reads one Markdown file and returns how many relative links
// it has and one line for each that does not resolve: the file (or
// directory) must exist, and an #anchor into a Markdown file must name one
// of its headings.
func checkLinks(file string) (int, []string) {
	text, err := os.ReadFile(file)
	if err != nil {
		return 0, []string{fmt.Sprintf("%s: %v", file, err)}
	}
	prose := codeSpan.ReplaceAllString(fence.ReplaceAllString(string(text), ""), "")
	n := 0
	var broken []string
	for _, m := range link.FindAllStringSubmatch(prose, -1) {
		target := m[1]
		if external.MatchString(target) {
			continue
		}
		n++
		path, anchor, _ := strings.Cut(target, "#")
		resolved := file
		if path != "" {
			resolved = filepath.Join(filepath.Dir(file), filepath.FromSlash(path))
			if _, err := os.Stat(resolved); err != nil {
				broken = append(broken, fmt.Sprintf("%s: %s: no such file", file, target))
				continue
			}
		}
		if anchor == "" || !strings.HasSuffix(resolved, ".md") {
			continue
		}
		anchors, err := headingAnchors(resolved)
		if err != nil {
			broken = append(broken, fmt.Sprintf("%s: %s: %v", file, target, err))
			continue
		}
		if !anchors[anchor] {
			broken = append(broken, fmt.Sprintf("%s: %s: no such heading", file, target))
		}
	}
	return n, broken
}

// headingAnchors returns the anchors GitHub gives the headings of a
// Markdown file: lower case, code marks and punctuation dropped, spaces as
// hyphens, and -1, -2 ... after a repeated one. Lines in fenced code are
// not headings.
func headingAnchors(file string) (map[string]bool, error) {
	text, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	anchors := map[string]bool{}
	seen := map[string]int{}
	for _, m := range heading.FindAllStringSubmatch(fence.ReplaceAllString(string(text), ""), -1) {
		slug := slugify(m[1])
		if k := seen[slug]; k > 0 {
			anchors[fmt.Sprintf("%s-%d", slug, k)] = true
		} else {
			anchors[slug] = true
		}
		seen[slug]++
	}
	return anchors, nil
}

func slugify(title string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(title) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// Every test that guarantees.md names as a proof exists: a func of that
// name in a _test.go file of the repository (its package may have moved).
func TestGuaranteesNameRealTests(t *testing.T) {
	t.Parallel()
	md, err := os.ReadFile("guarantees.md")
	require.NoError(t, err)
	names := map[string]bool{}
	for _, span := range codeSpan.FindAllString(string(md), -1) {
		for _, name := range testName.FindAllString(span, -1) {
			names[name] = true
		}
	}
	require.Greater(t, len(names), 150, "test names in guarantees.md")

	defined := map[string]bool{}
	require.NoError(t, filepath.WalkDir("..", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && (d.Name() == ".git" || d.Name() == "node_modules") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		for _, m := range testFunc.FindAllStringSubmatch(string(src), -1) {
			defined[m[1]] = true
		}
		return nil
	}))
	var missing []string
	for name := range names {
		if !defined[name] {
			missing = append(missing, name)
		}
	}
	sort.Strings(missing)
	require.Empty(t, missing, "guarantees.md names tests that do not exist")
}

var (
	testName = regexp.MustCompile(`\b(?:Test|Fuzz)[A-Z][A-Za-z0-9_]*`)
	testFunc = regexp.MustCompile(`(?m)^func ((?:Test|Fuzz)[A-Z][A-Za-z0-9_]*)\(`)
)
