package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/trust"
	"github.com/epitaph-dev/epitaph/projection/version"
)

func init() { register(trustKeyCommand) }

func trustKeyCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "trust-key [--show | --key-file FILE | --key KEY | --legacy-boundary last|P=SEQ,...]",
		Short: "signing keys the target trusts: --show | --key-file FILE (or --key KEY) [--note TEXT] adds one",
		Long: `trust-key lists the capture signing keys the target trusts and the legacy
boundaries (unsigned messages at or before them are believed), or adds a key:
the first key a projector meets is trusted; a new one is refused (its
transactions quarantined as unauthenticated) until trust-key adds it.

--legacy-boundary vouches for a stream written before signing: unsigned
messages of a partition at or before its boundary (a stream sequence) are
believed, unsigned ones after it quarantined. "last" records the stream's
last sequence now for every partition; P=SEQ,... records the given ones.
A projector never infers a boundary: without one, every unsigned message
is quarantined (a stream emptied and refilled by a forger looks just like
an old one). Workers read it when a partition starts: record it before
the first run (or restart the projectors).`,
		Example: `  projector trust-key --show --json
  projector trust-key --key-file /var/lib/epitaph/signing.pub --note "capture moved hosts"
  projector trust-key --legacy-boundary last`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	show := cmd.Flags().Bool("show", false, "list the trusted keys and the legacy boundaries (the default without --key-file/--key)")
	asJSON := jsonFlag(cmd, "the trusted keys and legacy boundaries (with --show, or alone)")
	keyFile := cmd.Flags().String("key-file", "", "trust the public key in FILE: the capture's <data-dir>/signing.pub (PEM), or its 32 bytes in base64 or hex")
	keyText := cmd.Flags().String("key", "", "trust this public key (base64 or hex of its 32 bytes, as the capture logs it)")
	note := cmd.Flags().String("note", "", "why the key is trusted (kept with it)")
	legacy := cmd.Flags().String("legacy-boundary", "", `record legacy boundaries: "last" (the stream's last sequence now, every partition) or P=SEQ[,P=SEQ...]`)
	by := cmd.Flags().String("by", "", "who trusts it (kept with it; default: $USER, else \"operator\")")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if *by == "" {
			*by = "operator"
			if u, ok := env.lookup("USER"); ok && u != "" {
				*by = u
			}
		}
		if *legacy != "" {
			if *keyFile != "" || *keyText != "" {
				return cli.Usage("trust-key: give --legacy-boundary alone, not with a key")
			}
			if err := legacyBoundary(cmd.Context(), c, env, *legacy); err != nil {
				return err
			}
			if !*show {
				return nil
			}
		}
		return trustKey(cmd.Context(), c, env, trustKeyParams{show: *show, asJSON: *asJSON,
			keyFile: *keyFile, keyText: *keyText, note: *note, by: *by})
	}
	return cmd
}

// trustKeyParams are trust-key's flags but --legacy-boundary.
type trustKeyParams struct {
	show, asJSON               bool
	keyFile, keyText, note, by string
}

func trustKey(ctx context.Context, c *common, env *Env, p trustKeyParams) error {
	show, asJSON, keyFile, keyText, note, by := p.show, p.asJSON, p.keyFile, p.keyText, p.note, p.by
	if keyFile != "" && keyText != "" {
		return cli.Usage("trust-key: give --key-file or --key, not both")
	}
	if err := c.check(); err != nil {
		return err
	}
	var pub []byte
	switch {
	case keyFile != "":
		b, err := os.ReadFile(keyFile)
		if err != nil {
			return fmt.Errorf("read key file: %w", err)
		}
		k, err := event.ParsePublicKey(b)
		if err != nil {
			return fmt.Errorf("key file %s: %w", keyFile, err)
		}
		pub = k
	case keyText != "":
		k, err := event.ParsePublicKey([]byte(keyText))
		if err != nil {
			return fmt.Errorf("--key: %w", err)
		}
		pub = k
	}
	pool, err := c.targetPool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Apply(ctx, pool); err != nil {
		return err
	}
	if pub != nil {
		added, err := trust.TrustKey(ctx, pool, pub, by, note)
		if err != nil {
			return err
		}
		if added {
			fmt.Fprintf(env.Stdout, "trusted key %s (%s); messages it signs are verified from now on (to recover what it signed before, which was quarantined as unauthenticated, rebuild the version: projector rebuild archive)\n",
				event.KeyID(pub), event.PublicKeyString(pub))
		} else {
			fmt.Fprintf(env.Stdout, "key %s is trusted already\n", event.KeyID(pub))
		}
		if !show {
			return nil
		}
	}
	keys, err := trust.TrustedKeys(ctx, pool)
	if err != nil {
		return err
	}
	bounds, err := trust.LegacyBoundaries(ctx, pool)
	if err != nil {
		return err
	}
	if asJSON {
		type jkey struct {
			KeyID       string    `json:"key_id"`
			PublicKey   string    `json:"public_key"`
			FirstSeenAt time.Time `json:"first_seen_at"`
			TrustedAt   time.Time `json:"trusted_at"`
			TrustedBy   string    `json:"trusted_by"`
			Note        string    `json:"note,omitempty"`
		}
		type jbound struct {
			Stream      string    `json:"stream"`
			Partition   int       `json:"partition"`
			BoundarySeq uint64    `json:"boundary_seq"`
			RecordedAt  time.Time `json:"recorded_at"`
		}
		out := struct {
			Keys   []jkey   `json:"trusted_keys"`
			Bounds []jbound `json:"legacy_boundaries"`
		}{Keys: []jkey{}, Bounds: []jbound{}}
		for _, k := range keys {
			out.Keys = append(out.Keys, jkey{k.KeyID, event.PublicKeyString(k.PublicKey), k.FirstSeenAt, k.TrustedAt, k.TrustedBy, k.Note})
		}
		for _, b := range bounds {
			out.Bounds = append(out.Bounds, jbound{b.Stream, b.Partition, b.BoundarySeq, b.RecordedAt})
		}
		return writeJSON(env.Stdout, out)
	}
	if len(keys) == 0 {
		fmt.Fprintln(env.Stdout, "trusted keys: none yet (the first key a projector meets is trusted and recorded)")
	} else {
		fmt.Fprintln(env.Stdout, "trusted keys:")
		for _, k := range keys {
			fmt.Fprintf(env.Stdout, "  %s  %s  trusted %s by %s", k.KeyID, event.PublicKeyString(k.PublicKey), k.TrustedAt.UTC().Format(time.RFC3339), k.TrustedBy)
			if k.Note != "" {
				fmt.Fprintf(env.Stdout, "  (%s)", k.Note)
			}
			fmt.Fprintln(env.Stdout)
		}
	}
	if len(bounds) == 0 {
		fmt.Fprintln(env.Stdout, "legacy boundaries: none recorded yet")
		return nil
	}
	fmt.Fprintln(env.Stdout, "legacy boundaries (unsigned messages at or before them are believed):")
	for _, b := range bounds {
		fmt.Fprintf(env.Stdout, "  %s partition %d: sequence %d (recorded %s)\n", b.Stream, b.Partition, b.BoundarySeq, b.RecordedAt.UTC().Format(time.RFC3339))
	}
	return nil
}

// parseBoundaries reads P=SEQ[,P=SEQ...] (partition, stream sequence).
func parseBoundaries(spec string) (map[int]uint64, error) {
	out := map[int]uint64{}
	for _, part := range strings.Split(spec, ",") {
		ps, ss, ok := strings.Cut(strings.TrimSpace(part), "=")
		p, err1 := strconv.Atoi(ps)
		seq, err2 := strconv.ParseUint(ss, 10, 63)
		if !ok || err1 != nil || err2 != nil || p < 0 {
			return nil, cli.Usage("--legacy-boundary: %q is not \"last\" or PARTITION=SEQUENCE[,...]", spec)
		}
		if _, dup := out[p]; dup {
			return nil, cli.Usage("--legacy-boundary: partition %d given twice", p)
		}
		out[p] = seq
	}
	return out, nil
}

// legacyBoundary records the legacy boundaries spec names ("last": the
// stream's last sequence now, for every partition of the stream).
func legacyBoundary(ctx context.Context, c *common, env *Env, spec string) error {
	var bounds map[int]uint64
	if spec != "last" {
		var err error
		if bounds, err = parseBoundaries(spec); err != nil {
			return err
		}
	}
	if err := c.check(); err != nil {
		return err
	}
	nc, err := c.natsConnect()
	if err != nil {
		return fmt.Errorf("connect to NATS %s: %w", redact(c.natsURL), err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	name := event.StreamName(c.sourceName)
	st, err := js.Stream(ctx, name)
	if err != nil {
		return fmt.Errorf("stream %s: %w", name, err)
	}
	info := st.CachedInfo()
	parts, err := version.StreamPartitions(info)
	if err != nil {
		return err
	}
	if bounds == nil {
		bounds = map[int]uint64{}
		for p := 0; p < parts; p++ {
			bounds[p] = info.State.LastSeq
		}
	}
	for p := range bounds {
		if p >= parts {
			return cli.Usage("--legacy-boundary: stream %s has %d partitions, no partition %d", name, parts, p)
		}
	}
	pool, err := c.targetPool(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	if err := migrations.Apply(ctx, pool); err != nil {
		return err
	}
	for p := 0; p < parts; p++ {
		seq, ok := bounds[p]
		if !ok {
			continue
		}
		if err := trust.RecordLegacyBoundary(ctx, pool, name, p, seq); err != nil {
			return err
		}
		fmt.Fprintf(env.Stdout, "legacy boundary of %s partition %d: sequence %d (unsigned messages at or before it are believed)\n", name, p, seq)
	}
	return nil
}
