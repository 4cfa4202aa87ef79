package deploy_test

import (
	"context"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

// composeFile is the subset of the Compose Specification deploy/compose.yaml
// uses. It is decoded strictly: a key not declared here (a typo such as
// `enviroment`, or a feature this test does not know) fails the test.
type composeFile struct {
	Name     string                    `yaml:"name"`
	Services map[string]composeService `yaml:"services"`
	Volumes  map[string]any            `yaml:"volumes"`
	Secrets  map[string]struct {
		File string `yaml:"file"`
	} `yaml:"secrets"`
	Extensions map[string]any `yaml:",inline"`
}

type composeService struct {
	Image string `yaml:"image"`
	Build *struct {
		Context    string            `yaml:"context"`
		Dockerfile string            `yaml:"dockerfile"`
		Args       map[string]string `yaml:"args"`
	} `yaml:"build"`
	Entrypoint  []string          `yaml:"entrypoint"`
	Command     []string          `yaml:"command"`
	Secrets     []string          `yaml:"secrets"`
	Hostname    string            `yaml:"hostname"`
	Environment map[string]string `yaml:"environment"`
	Ports       []string          `yaml:"ports"`
	Volumes     []string          `yaml:"volumes"`
	Restart     string            `yaml:"restart"`
	Healthcheck *struct {
		Test     []string `yaml:"test"`
		Interval string   `yaml:"interval"`
		Timeout  string   `yaml:"timeout"`
		Retries  int      `yaml:"retries"`
	} `yaml:"healthcheck"`
	// Long form only, so every dependency says what it waits for.
	DependsOn map[string]struct {
		Condition string `yaml:"condition"`
	} `yaml:"depends_on"`
}

func loadCompose(t *testing.T) composeFile {
	t.Helper()
	var c composeFile
	readYAML(t, "compose.yaml", &c, true)
	return c
}

var (
	// Compose interpolation: $$ is a literal $, otherwise ${NAME},
	// ${NAME:-default} or ${NAME:?error} (required).
	interpolationRe = regexp.MustCompile(`\$\$|\$\{[A-Z_][A-Z0-9_]*(:?[-?][^}]*)?\}`)
	interpolateRe   = regexp.MustCompile(`\$\{([A-Z_][A-Z0-9_]*)(?::?-([^}]*))?\}`)
	requiredRe      = regexp.MustCompile(`\$\{([A-Z_][A-Z0-9_]*):?\?[^}]*\}`)
)

// interpolate resolves ${NAME:-default} to its default, as compose does
// with NAME unset, and a required ${NAME:?error} to "required-NAME".
func interpolate(s string) string {
	s = requiredRe.ReplaceAllString(s, "required-$1")
	return interpolateRe.ReplaceAllString(s, "$2")
}

func epitaphServices(c composeFile) []string {
	var names []string
	for _, name := range sortedKeys(c.Services) {
		if len(c.Services[name].Command) > 0 && strings.HasPrefix(c.Services[name].Command[0], "epitaph-") {
			names = append(names, name)
		}
	}
	return names
}

// TestComposeStructure validates compose.yaml the way `docker compose
// config` would (references resolve, volumes are declared, files exist) and
// checks the wiring Epitaph needs.
func TestComposeStructure(t *testing.T) {
	t.Parallel()
	raw, err := os.ReadFile("compose.yaml")
	require.NoError(t, err)
	for _, m := range regexp.MustCompile(`\$[^$]?[^\n]{0,80}`).FindAllString(string(raw), -1) {
		if strings.HasPrefix(m, "$$") {
			continue
		}
		require.Regexp(t, `^`+interpolationRe.String(), m, "bad interpolation")
	}

	// No default password: every *PASSWORD* value is required (${NAME:?...}).
	for _, m := range regexp.MustCompile(`\$\{[A-Z_]*PASSWORD[A-Z_]*(:?[-?])?`).FindAllStringSubmatch(string(raw), -1) {
		require.Contains(t, m[1], "?", "a password with a default: %s", m[0])
	}
	require.NotContains(t, string(raw), "admin/admin")

	c := loadCompose(t)
	require.Equal(t, "epitaph", c.Name)
	for k := range c.Extensions {
		require.True(t, strings.HasPrefix(k, "x-"), "unknown top-level key %q", k)
	}
	for _, want := range []string{"postgres", "nats-1", "nats-2", "nats-3", "capture", "projector-1", "projector-2", "prometheus", "grafana"} {
		require.Contains(t, c.Services, want)
	}

	hostPorts := map[string]string{}
	for _, name := range sortedKeys(c.Services) {
		s := c.Services[name]
		require.True(t, s.Image != "" || s.Build != nil, "%s: image or build", name)
		if s.Build != nil {
			dockerfile := filepath.Join(s.Build.Context, s.Build.Dockerfile)
			require.FileExists(t, dockerfile, "%s: build", name)
		}
		for dep, d := range s.DependsOn {
			target, ok := c.Services[dep]
			require.True(t, ok, "%s depends on unknown service %s", name, dep)
			require.Contains(t, []string{"service_started", "service_healthy", "service_completed_successfully"}, d.Condition, "%s -> %s", name, dep)
			if d.Condition == "service_healthy" {
				require.NotNil(t, target.Healthcheck, "%s waits for %s to be healthy, which has no healthcheck", name, dep)
			}
			if d.Condition == "service_completed_successfully" {
				require.Equal(t, "no", target.Restart, "%s waits for %s to complete; it must not restart", name, dep)
			}
		}
		for _, v := range s.Volumes {
			parts := strings.Split(v, ":")
			require.GreaterOrEqual(t, len(parts), 2, "%s: volume %q", name, v)
			src := parts[0]
			if strings.HasPrefix(src, ".") || strings.HasPrefix(src, "/") {
				_, err := os.Stat(src)
				require.NoError(t, err, "%s: bind mount source %s", name, src)
			} else {
				require.Contains(t, c.Volumes, src, "%s: named volume %s is not declared", name, src)
			}
		}
		for _, p := range s.Ports {
			p = interpolate(p)
			parts := strings.Split(p, ":")
			require.Len(t, parts, 3, "%s: port %q names the host address", name, p)
			require.Equal(t, "127.0.0.1", parts[0], "%s: port %q is published on every interface", name, p)
			host := parts[1]
			require.NotContains(t, hostPorts, host, "host port %s used by %s and %s", host, hostPorts[host], name)
			hostPorts[host] = name
		}
		for _, sec := range s.Secrets {
			require.Contains(t, c.Secrets, sec, "%s: secret %s is not declared", name, sec)
		}
		if s.Healthcheck != nil {
			require.Contains(t, []string{"CMD", "CMD-SHELL"}, s.Healthcheck.Test[0], "%s: healthcheck", name)
		}
	}
	// No declared volume left unused.
	used := map[string]bool{}
	for _, s := range c.Services {
		for _, v := range s.Volumes {
			used[strings.Split(v, ":")[0]] = true
		}
	}
	for v := range c.Volumes {
		require.True(t, used[v], "volume %s is declared but not used", v)
	}
}

// TestComposeWiring checks that the services agree: URLs point at services
// that exist, partition counts match, the stream replicas match the NATS
// nodes, every worker has its own id, and Prometheus scrapes each process on
// the port it listens on.
func TestComposeWiring(t *testing.T) {
	t.Parallel()
	c := loadCompose(t)
	_, targets := loadPromConfig(t)

	var natsNodes []string
	for _, name := range sortedKeys(c.Services) {
		s := c.Services[name]
		if strings.HasPrefix(s.Image, "nats:") {
			natsNodes = append(natsNodes, name)
			require.Equal(t, name, s.Environment["SERVER_NAME"], "%s: SERVER_NAME (unique per node)", name)
			require.True(t, slices.ContainsFunc(s.Volumes, func(v string) bool { return strings.HasSuffix(v, ":/data") }),
				"%s: JetStream store on its own volume", name)
		}
	}
	require.Len(t, natsNodes, 3, "a three-node JetStream cluster")

	pg := c.Services["postgres"]
	require.Regexp(t, `^postgres:15(\b|$)`, pg.Image)
	require.Contains(t, pg.Command, "wal_level=logical")
	initSQL, err := os.ReadFile("postgres/init.sql")
	require.NoError(t, err)
	databases := []string{pg.Environment["POSTGRES_DB"]}
	for _, m := range regexp.MustCompile(`(?i)CREATE DATABASE\s+(\w+)`).FindAllStringSubmatch(string(initSQL), -1) {
		databases = append(databases, m[1])
	}

	epitaph := epitaphServices(c)
	require.Subset(t, epitaph, []string{"capture", "projector-1", "projector-2", "migrate"})
	binaries := dockerfileBinaries(t)
	partitions := map[string]string{}
	workers := map[string]string{}
	projectors := 0
	for _, name := range epitaph {
		s := c.Services[name]
		require.Contains(t, binaries, s.Command[0], "%s runs a binary the Dockerfile does not build", name)
		require.NotNil(t, s.Build, "%s: built from the repository", name)
		require.Equal(t, "epitaph:dev", s.Image)
		for k, v := range s.Environment {
			requireReadsEnv(t, s.Command[0], k, name)
			v = interpolate(v)
			switch k {
			case "EPITAPH_SOURCE_URL", "EPITAPH_TARGET_URL":
				u, err := url.Parse(v)
				require.NoError(t, err, "%s: %s", name, k)
				require.Contains(t, c.Services, u.Hostname(), "%s: %s host", name, k)
				require.Contains(t, databases, strings.TrimPrefix(u.Path, "/"), "%s: %s database is made by the postgres service", name, k)
				if k == "EPITAPH_TARGET_URL" && name != "migrate" {
					require.Contains(t, s.DependsOn, "migrate", "%s starts on a migrated target", name)
				} else {
					require.Equal(t, "service_healthy", s.DependsOn[u.Hostname()].Condition, "%s waits for %s", name, u.Hostname())
				}
			case "EPITAPH_NATS_URL":
				var hosts []string
				for _, one := range strings.Split(v, ",") {
					u, err := url.Parse(one)
					require.NoError(t, err, "%s: %s", name, k)
					require.Equal(t, "4222", u.Port())
					hosts = append(hosts, u.Hostname())
					require.Contains(t, s.DependsOn, u.Hostname(), "%s starts before %s", name, u.Hostname())
				}
				require.ElementsMatch(t, natsNodes, hosts, "%s: every NATS node in EPITAPH_NATS_URL", name)
			case "EPITAPH_PARTITIONS":
				partitions[name] = v
			case "EPITAPH_REPLICAS":
				require.Equal(t, fmt.Sprint(len(natsNodes)), v, "%s: one stream replica per NATS node", name)
			case "EPITAPH_WORKER_ID":
				require.NotContains(t, workers, v, "%s and %s share a worker id", name, workers[v])
				workers[v] = name
			case "EPITAPH_METRICS_ADDR":
				_, port, err := net.SplitHostPort(v)
				require.NoError(t, err)
				job := "epitaph-capture"
				if s.Command[0] == "epitaph-projector" {
					job = "epitaph-projector"
				}
				require.Contains(t, targets[job], name+":"+port, "Prometheus scrapes %s on %s", name, port)
				require.Contains(t, strings.Join(s.Healthcheck.Test, " "), ":"+port+"/readyz", "%s: healthcheck port", name)
			}
		}
		if s.Command[0] == "epitaph-projector" && s.Command[1] == "run" {
			projectors++
			require.Contains(t, s.Environment, "EPITAPH_WORKER_ID", name)
		}
	}
	require.GreaterOrEqual(t, projectors, 2, "two projector workers")

	checkNATSRoles(t, c, epitaph, natsNodes)
	require.Equal(t, "3", c.Services["capture"].Environment["EPITAPH_REPLICAS"])
	require.Equal(t, "true", c.Services["capture"].Environment["EPITAPH_STANDBY"])
	// P belongs to the capture (the stream keeps it; projectors read it there).
	require.Equal(t, map[string]string{"capture": "8"}, partitions)

	// Prometheus and Grafana see the files they are configured with.
	prom := c.Services["prometheus"]
	require.Contains(t, prom.Volumes, "./prometheus/prometheus.yml:/etc/prometheus/prometheus.yml:ro")
	require.Contains(t, prom.Volumes, "./prometheus/alerts.yaml:/etc/prometheus/alerts.yaml:ro")
	require.Contains(t, prom.Command, "--config.file=/etc/prometheus/prometheus.yml")
	require.NotContains(t, prom.Command, "--web.enable-lifecycle", "no one stops Prometheus over HTTP")
	require.NotContains(t, prom.Command, "--web.enable-admin-api", "no one deletes Prometheus data over HTTP")
	for _, targetList := range targets {
		for _, target := range targetList {
			host, _, err := net.SplitHostPort(target)
			require.NoError(t, err)
			require.True(t, host == "localhost" || c.Services[host].Image != "", "scrape target %s is not a service", target)
		}
	}
}

// checkNATSRoles: one writer: the capture and the projectors authenticate
// as their roles of nats/nats.conf, with the password from a secret file
// that every NATS node reads too.
func checkNATSRoles(t *testing.T, c composeFile, epitaph, natsNodes []string) {
	t.Helper()
	for _, name := range epitaph {
		s := c.Services[name]
		if _, uses := s.Environment["EPITAPH_NATS_URL"]; !uses {
			continue
		}
		role := "projector"
		if s.Command[0] == "epitaph-capture" {
			role = "capture"
		}
		require.Equal(t, role, s.Environment["EPITAPH_NATS_USER"], "%s: NATS user", name)
		secret := "nats-" + role + "-password"
		require.Equal(t, "/run/secrets/"+secret, s.Environment["EPITAPH_NATS_PASSWORD_FILE"], "%s", name)
		want := []string{secret}
		if role == "projector" {
			want = append(want, "projector-http-token") // the read API's bearer token
		}
		require.Equal(t, want, s.Secrets, "%s mounts its own role's secret only", name)
		for _, n := range natsNodes {
			require.Contains(t, c.Services[n].Secrets, secret, "%s reads %s", n, secret)
			require.Contains(t, strings.Join(c.Services[n].Command, " "), "/run/secrets/"+secret, "%s sets its password from the file", n)
		}
	}
}

// TestComposeConfigWithDockerCompose validates compose.yaml with a real
// Compose implementation (`docker compose config`, or Debian's
// docker-compose 1.29, which validates against the Compose schema without a
// Docker engine). docker-compose 1.x predates the top-level `name` key, so
// it gets a copy without that one line; everything else is checked as is.
// With neither installed the test skips: TestComposeStructure covers the
// references by hand.
func TestComposeConfigWithDockerCompose(t *testing.T) {
	t.Parallel()
	dir, err := filepath.Abs(".")
	require.NoError(t, err)
	var cmd *exec.Cmd
	if out, err := exec.Command("docker", "compose", "version").CombinedOutput(); err == nil && strings.Contains(string(out), "version") {
		cmd = exec.Command("docker", "compose", "-f", "compose.yaml", "config", "--quiet")
	} else if p, err := exec.LookPath("docker-compose"); err == nil {
		out, err := exec.Command(p, "version", "--short").CombinedOutput()
		require.NoError(t, err, "%s", out)
		file := "compose.yaml"
		if strings.HasPrefix(strings.TrimSpace(string(out)), "1.") {
			raw, err := os.ReadFile("compose.yaml")
			require.NoError(t, err)
			stripped := regexp.MustCompile(`(?m)^name: .*\n`).ReplaceAll(raw, nil)
			require.NotEqual(t, raw, stripped, "compose.yaml has a top-level name")
			file = filepath.Join(t.TempDir(), "compose.yaml")
			require.NoError(t, os.WriteFile(file, stripped, 0o600))
		}
		cmd = exec.Command(p, "-f", file, "--project-directory", dir, "config", "--quiet")
	} else {
		t.Skip("no Compose implementation installed (docker compose plugin, or Debian's docker-compose); references checked by TestComposeStructure")
	}
	cmd.Dir = dir
	// The required passwords (${NAME:?...}) as an operator sets them.
	cmd.Env = append(os.Environ(), "POSTGRES_PASSWORD=compose-test", "GRAFANA_ADMIN_PASSWORD=compose-test")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
}

// TestComposePostgresSettings starts a real Postgres 15 with the settings the
// compose file passes with -c, and runs the compose init script: a misspelt
// or invalid setting fails here instead of at `docker compose up`.
func TestComposePostgresSettings(t *testing.T) {
	t.Parallel()
	lines := composePostgresSettings(t)
	settings := map[string]string{}
	for _, l := range lines {
		name, value, _ := strings.Cut(l, " = ")
		settings[name] = strings.Trim(value, "'")
	}
	require.Equal(t, "logical", settings["wal_level"])
	require.NotEmpty(t, settings["max_slot_wal_keep_size"], "the slot alerts need a limit to estimate invalidation")

	pg := testenv.NewPostgres(t)
	require.NoError(t, pg.SetConfig(lines...))
	require.NoError(t, pg.Restart())

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	conn, err := pgx.Connect(ctx, pg.URL("postgres"))
	require.NoError(t, err)
	defer conn.Close(ctx)
	for name := range settings {
		var applied bool
		var errText *string
		err := conn.QueryRow(ctx, `SELECT applied, error FROM pg_file_settings WHERE name = $1 ORDER BY seqno DESC LIMIT 1`, name).Scan(&applied, &errText)
		require.NoError(t, err, "setting %s", name)
		require.Nil(t, errText, "setting %s", name)
		require.True(t, applied, "setting %s = %s not applied", name, settings[name])
	}
	var walLevel, keep string
	require.NoError(t, conn.QueryRow(ctx, `SELECT current_setting('wal_level'), current_setting('max_slot_wal_keep_size')`).Scan(&walLevel, &keep))
	require.Equal(t, "logical", walLevel)
	require.Equal(t, settings["max_slot_wal_keep_size"], keep)

	initSQL, err := os.ReadFile("postgres/init.sql")
	require.NoError(t, err)
	_, err = conn.Exec(ctx, string(initSQL))
	require.NoError(t, err)
	var exists bool
	require.NoError(t, conn.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_database WHERE datname = 'archive')`).Scan(&exists))
	require.True(t, exists, "init.sql makes the archive database")
	// Drop it again so the private server's cleanup is not surprised.
	_, err = conn.Exec(ctx, `DROP DATABASE archive`)
	require.NoError(t, err)
}

// composePostgresSettings are the compose Postgres's `-c name=value`
// arguments as postgresql.conf lines.
func composePostgresSettings(t *testing.T) []string {
	t.Helper()
	cmd := loadCompose(t).Services["postgres"].Command
	require.Equal(t, "postgres", cmd[0])
	var lines []string
	for i := 1; i < len(cmd); i++ {
		require.Equal(t, "-c", cmd[i], "postgres arguments are -c name=value pairs")
		i++
		name, value, ok := strings.Cut(cmd[i], "=")
		require.True(t, ok, cmd[i])
		lines = append(lines, fmt.Sprintf("%s = '%s'", name, value))
	}
	return lines
}

var (
	goDirectiveRe   = regexp.MustCompile(`(?m)^go (\d+)\.(\d+)`)
	dockerGoImageRe = regexp.MustCompile(`(?m)^FROM golang:(\d+)\.(\d+)\S* AS build`)
	dockerOutRe     = regexp.MustCompile(`-o /out/(\S+) \./(cmd/\S+)`)
	dockerCopyBinRe = regexp.MustCompile(`(?m)^COPY --from=build (.+) /usr/local/bin/$`)
)

// dockerfileBinaries returns the binary names the Dockerfile builds and
// installs, checking each is built from a cmd/ directory of the module.
func dockerfileBinaries(t *testing.T) []string {
	t.Helper()
	df, err := os.ReadFile("Dockerfile")
	require.NoError(t, err)
	var names []string
	for _, m := range dockerOutRe.FindAllStringSubmatch(string(df), -1) {
		require.DirExists(t, filepath.Join("..", m[2]))
		names = append(names, m[1])
	}
	cp := dockerCopyBinRe.FindStringSubmatch(string(df))
	require.NotNil(t, cp, "Dockerfile copies the binaries to /usr/local/bin/")
	for _, n := range names {
		require.Contains(t, cp[1], "/out/"+n, "binary %s is built but not installed", n)
	}
	return names
}

// TestDockerfile checks the image builds both binaries with a Go at least
// as new as go.mod asks for.
func TestDockerfile(t *testing.T) {
	t.Parallel()
	require.ElementsMatch(t, []string{"epitaph-capture", "epitaph-projector"}, dockerfileBinaries(t))
	gomod, err := os.ReadFile("../go.mod")
	require.NoError(t, err)
	df, err := os.ReadFile("Dockerfile")
	require.NoError(t, err)
	want := goDirectiveRe.FindStringSubmatch(string(gomod))
	got := dockerGoImageRe.FindStringSubmatch(string(df))
	require.NotNil(t, want)
	require.NotNil(t, got, "Dockerfile build stage is FROM golang:X.Y... AS build")
	require.Equal(t, want[1:], got[1:], "Dockerfile Go version vs go.mod")
	require.Contains(t, string(df), "CGO_ENABLED=0", "static binaries for the alpine stage")
	require.Regexp(t, `(?m)^USER \d+`, string(df), "the image does not run as root")

	// The image compose builds says which version it is: every build
	// argument the Dockerfile takes for --version is passed, from a
	// variable the header's command line sets.
	for _, name := range epitaphServices(loadCompose(t)) {
		b := loadCompose(t).Services[name].Build
		require.NotNil(t, b, name)
		for _, arg := range []string{"VERSION", "COMMIT"} {
			require.Regexp(t, `(?m)^ARG `+arg+`=`, string(df))
			require.Equal(t, "${EPITAPH_"+arg+":-}", b.Args[arg], "%s: build argument %s", name, arg)
		}
	}

	// The ignore file keeps nothing out that the build needs: go.mod,
	// go.sum and every directory with Go code of the binaries.
	ignore, err := os.ReadFile("Dockerfile.dockerignore")
	require.NoError(t, err)
	var patterns []string
	for _, l := range strings.Split(string(ignore), "\n") {
		if l = strings.TrimSpace(l); l != "" && !strings.HasPrefix(l, "#") {
			patterns = append(patterns, l)
		}
	}
	require.Contains(t, patterns, ".git")
	needed := []string{"go.mod", "go.sum"}
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.Dir}}{{end}}", "../cmd/capture", "../cmd/projector").Output()
	require.NoError(t, err)
	root, err := filepath.Abs("..")
	require.NoError(t, err)
	for _, dir := range strings.Fields(string(out)) {
		if rel, err := filepath.Rel(root, dir); err == nil && !strings.HasPrefix(rel, "..") {
			needed = append(needed, filepath.ToSlash(rel))
		}
	}
	require.Contains(t, needed, "cmd/capture")
	for _, path := range needed {
		parts := strings.Split(path, "/")
		for i := range parts {
			prefix := strings.Join(parts[:i+1], "/")
			for _, p := range patterns {
				matched, err := filepath.Match(strings.TrimPrefix(p, "**/"), prefix)
				require.NoError(t, err)
				require.False(t, matched, "Dockerfile.dockerignore pattern %q excludes %s, which the build needs", p, path)
			}
		}
	}
}

// pendingEnv are settings the deployment files already use for behaviour
// the deployment asks of the code and the code does not have yet. While a binary
// does not read one, it is ignored; once it does, the entry is harmless.
var pendingEnv = map[string]string{}

var envNameRe = regexp.MustCompile(`"(EPITAPH_[A-Z0-9_]+)"`)

// binaryEnv returns the EPITAPH_* variables a binary's main package names,
// read from its source (the Dockerfile says which cmd/ directory builds it).
func binaryEnv(t *testing.T, binary string) map[string]bool {
	t.Helper()
	df, err := os.ReadFile("Dockerfile")
	require.NoError(t, err)
	var dir string
	for _, m := range dockerOutRe.FindAllStringSubmatch(string(df), -1) {
		if m[1] == binary {
			dir = filepath.Join("..", m[2])
		}
	}
	require.NotEmpty(t, dir, "the Dockerfile does not build %s", binary)
	files, err := filepath.Glob(filepath.Join(dir, "*.go"))
	require.NoError(t, err)
	// The flags both binaries share live in cmd/internal/cli (--log-level,
	// --log-format) and internal/natsconn (NATS authentication, one table).
	shared, err := filepath.Glob(filepath.Join("..", "cmd", "internal", "cli", "*.go"))
	require.NoError(t, err)
	files = append(files, shared...)
	shared, err = filepath.Glob(filepath.Join("..", "internal", "natsconn", "*.go"))
	require.NoError(t, err)
	files = append(files, shared...)
	names := map[string]bool{}
	for _, f := range files {
		if strings.HasSuffix(f, "_test.go") {
			continue
		}
		src, err := os.ReadFile(f)
		require.NoError(t, err)
		for _, m := range envNameRe.FindAllStringSubmatch(string(src), -1) {
			names[m[1]] = true
		}
	}
	require.NotEmpty(t, names, "%s reads no EPITAPH_* variable?", dir)
	return names
}

// requireReadsEnv fails unless binary reads the variable: a setting in a
// deployment file that the program ignores is a silent misconfiguration.
func requireReadsEnv(t *testing.T, binary, variable, where string) {
	t.Helper()
	if variable == "GOMEMLIMIT" {
		return // read by the Go runtime of every binary (the memory rule: docs/operator.md)
	}
	require.True(t, strings.HasPrefix(variable, "EPITAPH_"), "%s: %s is not an Epitaph setting", where, variable)
	if _, pending := pendingEnv[variable]; pending {
		return
	}
	require.True(t, binaryEnv(t, binary)[variable], "%s: %s sets %s, which it does not read", where, binary, variable)
}
