package cli

import (
	"io"
	"log/slog"
	"strings"

	"github.com/spf13/cobra"
)

// Logging is the --log-level and --log-format of a binary.
type Logging struct {
	Level  string
	Format string
}

// LogFlags registers --log-level (EPITAPH_LOG_LEVEL) and --log-format
// (EPITAPH_LOG_FORMAT) on root and every subcommand.
func LogFlags(root *cobra.Command) *Logging {
	l := &Logging{}
	f := Persistent(root)
	f.Enum(&l.Level, "log-level", "EPITAPH_LOG_LEVEL", "info", []string{"debug", "info", "warn", "error"}, "log level: debug, info, warn or error")
	f.Enum(&l.Format, "log-format", "EPITAPH_LOG_FORMAT", "text", []string{"text", "json"},
		"log format: text (key=value) or json (one object per line, log/slog's JSON handler)")
	return l
}

// Logger builds the logger the flags ask for, writing to w.
func (l *Logging) Logger(w io.Writer) *slog.Logger {
	var lv slog.Level
	_ = lv.UnmarshalText([]byte(strings.ToUpper(l.Level))) // the flag only takes valid levels
	opts := &slog.HandlerOptions{Level: lv}
	if l.Format == "json" {
		return slog.New(slog.NewJSONHandler(w, opts))
	}
	return slog.New(slog.NewTextHandler(w, opts))
}
