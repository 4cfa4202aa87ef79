package main

import (
	"context"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/spf13/cobra"

	"github.com/epitaph-dev/epitaph/cmd/internal/cli"
	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/migrations"
	"github.com/epitaph-dev/epitaph/projection/trust"
)

func init() { register(trustKeyCommand) }

func trustKeyCommand(env *Env) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "trust-key [--show | --key-file FILE | --key KEY]",
		Short: "signing keys the target trusts: --show | --key-file FILE (or --key KEY) [--note TEXT] adds one",
		Long: `trust-key lists the capture signing keys the target trusts and the legacy
boundaries (unsigned messages at or before them are believed), or adds a key:
the first key a projector meets is trusted; a new one is refused (its
transactions quarantined as unauthenticated) until trust-key adds it.`,
		Example: `  projector trust-key --show --json
  projector trust-key --key-file /var/lib/epitaph/signing.pub --note "capture moved hosts"`,
		Args: cli.NoArgs,
	}
	c := commonFlags(cmd, env)
	show := cmd.Flags().Bool("show", false, "list the trusted keys and the legacy boundaries (the default without --key-file/--key)")
	asJSON := jsonFlag(cmd, "the trusted keys and legacy boundaries (with --show, or alone)")
	keyFile := cmd.Flags().String("key-file", "", "trust the public key in FILE: the capture's <data-dir>/signing.pub (PEM), or its 32 bytes in base64 or hex")
	keyText := cmd.Flags().String("key", "", "trust this public key (base64 or hex of its 32 bytes, as the capture logs it)")
	note := cmd.Flags().String("note", "", "why the key is trusted (kept with it)")
	by := cmd.Flags().String("by", "", "who trusts it (kept with it; default: $USER, else \"operator\")")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if *by == "" {
			*by = "operator"
			if u, ok := env.lookup("USER"); ok && u != "" {
				*by = u
			}
		}
		return trustKey(cmd.Context(), c, env, *show, *asJSON, *keyFile, *keyText, *note, *by)
	}
	return cmd
}

func trustKey(ctx context.Context, c *common, env *Env, show, asJSON bool, keyFile, keyText, note, by string) error {
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
	pool, err := pgxpool.New(ctx, c.targetURL)
	if err != nil {
		return fmt.Errorf("connect to target %s: %w", redact(c.targetURL), err)
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
