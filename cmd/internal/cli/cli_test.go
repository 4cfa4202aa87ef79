package cli

import (
	"bytes"
	"errors"
	"fmt"
	"regexp"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/cobra"
	"github.com/stretchr/testify/require"
)

type settings struct {
	name     string
	n        int
	d        time.Duration
	share    float64
	on       bool
	mode     string
	optional string
}

func testCommand(s *settings) *cobra.Command {
	cmd := &cobra.Command{Use: "t", RunE: func(*cobra.Command, []string) error { return nil }}
	f := Local(cmd)
	f.String(&s.name, "name", "T_NAME", "def", "a name", KeepEmpty())
	f.String(&s.optional, "optional", "T_OPTIONAL", "fallback", "empty means unset")
	f.Int(&s.n, "n", "T_N", 8, "a count", Min(1), Max(10))
	f.Duration(&s.d, "d", "T_D", time.Second, "a duration", Positive())
	f.Float64(&s.share, "share", "T_SHARE", 0.5, "a share", Positive(), Max(1))
	f.Bool(&s.on, "on", "T_ON", false, "a switch")
	f.Enum(&s.mode, "mode", "T_MODE", "a", []string{"a", "b"}, "a mode")
	return cmd
}

func TestApplyEnv(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		args []string
		want settings
		err  string
	}{
		{want: settings{name: "def", optional: "fallback", n: 8, d: time.Second, share: 0.5, mode: "a"}},
		{env: map[string]string{"T_NAME": "", "T_OPTIONAL": "", "T_N": "3", "T_D": "2m", "T_SHARE": "1", "T_ON": "true", "T_MODE": "B"},
			want: settings{name: "", optional: "fallback", n: 3, d: 2 * time.Minute, share: 1, on: true, mode: "b"}},
		// The command line wins over the environment.
		{env: map[string]string{"T_N": "3"}, args: []string{"--n", "4"},
			want: settings{name: "def", optional: "fallback", n: 4, d: time.Second, share: 0.5, mode: "a"}},
		// A bad variable is not hidden by a good flag for another setting.
		{env: map[string]string{"T_N": "0"}, err: `bad environment: T_N="0": must be at least 1`},
		{env: map[string]string{"T_N": "11"}, err: `T_N="11": must be at most 10`},
		{env: map[string]string{"T_N": "x"}, err: `T_N="x": not an integer`},
		{env: map[string]string{"T_D": "0s"}, err: `T_D="0s": must be positive`},
		{env: map[string]string{"T_D": "10"}, err: `T_D="10": not a duration`},
		{env: map[string]string{"T_SHARE": "1.5"}, err: `T_SHARE="1.5": must be at most 1`},
		{env: map[string]string{"T_ON": "yes"}, err: `T_ON="yes": not a boolean (true or false)`},
		{env: map[string]string{"T_MODE": "c"}, err: `T_MODE="c": want one of a, b`},
		{env: map[string]string{"T_NAME": "postgres://u:hunter2@h/db", "T_N": "0"}, err: `T_N="0"`},
		{args: []string{"--n", "0"}, err: `invalid argument "0" for "--n" flag: must be at least 1`},
		{args: []string{"--d", "-1s"}, err: `invalid argument "-1s" for "--d" flag: must be positive`},
	} {
		t.Run(fmt.Sprint(tc.env, tc.args), func(t *testing.T) {
			var s settings
			cmd := testCommand(&s)
			cmd.PersistentPreRunE = func(cmd *cobra.Command, _ []string) error {
				return ApplyEnv(cmd, func(k string) (string, bool) { v, ok := tc.env[k]; return v, ok })
			}
			Prepare(cmd, &bytes.Buffer{}, &bytes.Buffer{})
			cmd.SetArgs(tc.args)
			err := cmd.Execute()
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				require.Equal(t, ExitUsage, Code(err))
				require.NotContains(t, err.Error(), "hunter2")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.want, s)
		})
	}
}

func TestCodesAndReport(t *testing.T) {
	require.Equal(t, 0, Code(nil))
	require.Equal(t, 1, Code(errors.New("boom")))
	require.Equal(t, 2, Code(Usage("bad")))
	require.Equal(t, 3, Code(fmt.Errorf("wrapped: %w", WithCode(ExitNotEqual, errors.New("differs")))))
	var b bytes.Buffer
	code := Report(&b, "projector", fmt.Errorf("connect to postgres://u:hunter2@db/app:\n  refused"))
	require.Equal(t, 1, code)
	require.Equal(t, "projector: connect to postgres://u:xxxxx@db/app: refused\n", b.String())
}

func TestBuildInfoGauge(t *testing.T) {
	reg := prometheus.NewRegistry()
	b := Build{Version: "v1.2.3", Commit: "abc", GoVersion: "go1.26.8"}
	require.NoError(t, RegisterBuildInfo(reg, b))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	require.Len(t, mfs, 1)
	require.Equal(t, "epitaph_build_info", mfs[0].GetName())
	require.Len(t, mfs[0].GetMetric(), 1)
	m := mfs[0].GetMetric()[0]
	require.Equal(t, 1.0, m.GetGauge().GetValue())
	labels := map[string]string{}
	for _, l := range m.GetLabel() {
		labels[l.GetName()] = l.GetValue()
	}
	require.Equal(t, map[string]string{"version": "v1.2.3", "commit": "abc", "go_version": "go1.26.8"}, labels)
	require.Error(t, RegisterBuildInfo(reg, b), "registered twice")
	require.Equal(t, "v1.2.3 (commit abc, built , go1.26.8)", b.String())
	got := BuildInfo()
	require.NotEmpty(t, got.Version)
	require.NotEmpty(t, got.Commit)
	require.Regexp(t, `^go1\.`, got.GoVersion)
}

func TestLogger(t *testing.T) {
	var b bytes.Buffer
	(&Logging{Level: "warn", Format: "json"}).Logger(&b).Info("hidden")
	require.Empty(t, b.String())
	(&Logging{Level: "warn", Format: "json"}).Logger(&b).Warn("shown", "k", 1)
	require.JSONEq(t, `{"level":"WARN","msg":"shown","k":1,"time":"x"}`,
		regexpTime.ReplaceAllString(b.String(), `"time":"x"`))
	b.Reset()
	(&Logging{Level: "debug", Format: "text"}).Logger(&b).Debug("shown")
	require.Contains(t, b.String(), "level=DEBUG msg=shown")
}

var regexpTime = regexp.MustCompile(`"time":"[^"]*"`)
