package capture

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/epitaph-dev/epitaph/internal/pgdial"
	"github.com/epitaph-dev/epitaph/internal/pgquote"
)

// stateSchema is the capture's own schema on the source: never published
// (ownSchema). Not "epitaph": a target that is also the source has the
// projector's schema of that name, owned by the projector's role.
const stateSchema = "epitaph_capture"

// sqlIdentityTable records the replica identity a relation had before
// --set-replica-identity-full (or the DDL guard) made it FULL, per
// publication, so capture uninstall can put it back. identity is
// pg_class.relreplident ('d', 'n' or 'i'); index_name the replica
// identity index of 'i'.
const sqlIdentityTable = `
CREATE SCHEMA IF NOT EXISTS epitaph_capture;
CREATE TABLE IF NOT EXISTS epitaph_capture.replica_identity (
  publication text NOT NULL,
  relid oid NOT NULL,
  relation text NOT NULL,
  identity "char" NOT NULL,
  index_name text,
  changed_at timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (publication, relid))`

// sqlRecordIdentity records $2 (a regclass text) as it is now; the first
// record of a relation wins, so a later change never hides the original.
const sqlRecordIdentity = `
INSERT INTO epitaph_capture.replica_identity (publication, relid, relation, identity, index_name)
SELECT $1, c.oid, $2::text, c.relreplident,
       (SELECT ic.relname FROM pg_index i JOIN pg_class ic ON ic.oid = i.indexrelid
         WHERE i.indrelid = c.oid AND i.indisreplident)
FROM pg_class c WHERE c.oid = $2::text::regclass AND c.relreplident <> 'f'
ON CONFLICT (publication, relid) DO NOTHING`

// setFullRecorded records rel's replica identity and sets it FULL, in one
// transaction: a FULL the capture made is never without its record.
func setFullRecorded(ctx context.Context, pool *pgxpool.Pool, pub, rel string) error {
	return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, sqlIdentityTable); err != nil {
			var pgErr *pgconn.PgError
			if errors.As(err, &pgErr) && pgErr.Code == "42501" {
				return configErr("cannot record the replica identity of %s before setting it FULL: %s (the capture role needs CREATE on the database for schema %s, as for the publication)", rel, pgErr.Message, stateSchema)
			}
			return fmt.Errorf("record replica identity of %s: %w", rel, err)
		}
		if _, err := tx.Exec(ctx, sqlRecordIdentity, pub, rel); err != nil {
			return fmt.Errorf("record replica identity of %s: %w", rel, err)
		}
		if _, err := tx.Exec(ctx, "ALTER TABLE "+rel+" REPLICA IDENTITY FULL"); err != nil {
			return fmt.Errorf("set replica identity full on %s: %w", rel, err)
		}
		return nil
	})
}

// UninstallConfig names what capture uninstall removes from the source.
type UninstallConfig struct {
	SourceURL       string
	SlotName        string // default "epitaph"
	PublicationName string // default "epitaph"
}

// UninstallPlan is what Uninstall does (or did), in order.
type UninstallPlan struct {
	// Steps are the SQL statements, in the order they run.
	Steps []string
	// Notes say what is left as it is, and why.
	Notes []string
	cfg   UninstallConfig
	// inUse is the process streaming the slot when the plan was made (0:
	// none): Apply refuses the plan.
	inUse int32
}

// PlanUninstall reads the source and says what Uninstall would do: drop
// the DDL guard of the publication, the publication and the slot, and put
// back the replica identities the capture set FULL (those still FULL).
// It changes nothing. A slot in use (a capture streaming it) is planned
// and noted, and InUse says so: Apply refuses it (stop the capture first).
func PlanUninstall(ctx context.Context, cfg UninstallConfig) (*UninstallPlan, error) {
	if cfg.SlotName == "" {
		cfg.SlotName = "epitaph"
	}
	if cfg.PublicationName == "" {
		cfg.PublicationName = "epitaph"
	}
	if cfg.SourceURL == "" {
		return nil, configErr("EPITAPH_SOURCE_URL is required (--source-url)")
	}
	conn, err := uninstallConnect(ctx, cfg.SourceURL)
	if err != nil {
		return nil, err
	}
	defer conn.Close(context.Background())
	p := &UninstallPlan{cfg: cfg}
	pub := pgx.Identifier{cfg.PublicationName}.Sanitize()

	// The trigger and its function are dropped by two statements: a run
	// stopped between them leaves the function, which the next one drops.
	var guard, guardFn bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_event_trigger WHERE evtname = $1), to_regprocedure($2) IS NOT NULL`,
		guardTriggerName(cfg.PublicationName), guardFunction(cfg.PublicationName)+"()").Scan(&guard, &guardFn); err != nil {
		return nil, fmt.Errorf("read event triggers: %w", err)
	}
	if guard {
		p.Steps = append(p.Steps, "DROP EVENT TRIGGER "+pgx.Identifier{guardTriggerName(cfg.PublicationName)}.Sanitize())
	}
	if guard || guardFn {
		p.Steps = append(p.Steps, "DROP FUNCTION IF EXISTS "+guardFunction(cfg.PublicationName)+"()")
	}

	var pubExists bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, cfg.PublicationName).Scan(&pubExists); err != nil {
		return nil, fmt.Errorf("read publication %s: %w", cfg.PublicationName, err)
	}
	if pubExists {
		p.Steps = append(p.Steps, "DROP PUBLICATION "+pub)
	} else {
		p.Notes = append(p.Notes, fmt.Sprintf("no publication %q", cfg.PublicationName))
	}
	moves := movesPublication(cfg.PublicationName)
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, moves).Scan(&pubExists); err != nil {
		return nil, fmt.Errorf("read publication %s: %w", moves, err)
	}
	if pubExists {
		p.Steps = append(p.Steps, "DROP PUBLICATION "+pgx.Identifier{moves}.Sanitize())
	}

	var (
		slotDB, curDB string
		activePID     *int32
		slotExists    bool
	)
	err = conn.QueryRow(ctx, `SELECT coalesce(database::text, ''), active_pid, current_database() FROM pg_replication_slots WHERE slot_name = $1`,
		cfg.SlotName).Scan(&slotDB, &activePID, &curDB)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		p.Notes = append(p.Notes, fmt.Sprintf("no replication slot %q", cfg.SlotName))
	case err != nil:
		return nil, fmt.Errorf("read replication slot %s: %w", cfg.SlotName, err)
	case slotDB != curDB:
		p.Notes = append(p.Notes, fmt.Sprintf("replication slot %q belongs to database %q, not this one: left as it is", cfg.SlotName, slotDB))
	case activePID != nil:
		p.inUse, slotExists = *activePID, true
		p.Notes = append(p.Notes, fmt.Sprintf("replication slot %q is in use by process %d (a capture streaming it): stop the capture first", cfg.SlotName, *activePID))
	default:
		slotExists = true
	}
	if slotExists {
		p.Steps = append(p.Steps, "SELECT pg_drop_replication_slot("+pgquote.Literal(cfg.SlotName)+")")
	}

	if err := p.planIdentities(ctx, conn); err != nil {
		return nil, err
	}
	for _, table := range []string{factsTable, leavesTable} {
		var exists bool
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
			return nil, fmt.Errorf("read %s: %w", table, err)
		}
		if exists {
			p.Steps = append(p.Steps, "DELETE FROM "+table+" WHERE publication = "+pgquote.Literal(p.cfg.PublicationName))
		}
	}
	p.Notes = append(p.Notes, "the JetStream stream and the capture's data directory are left as they are, and so is "+
		seqTable+" (the stream's partition sequences, kept while the stream is)")
	return p, nil
}

// planIdentities adds the statements that put back the recorded replica
// identities of relations still FULL.
func (p *UninstallPlan) planIdentities(ctx context.Context, conn *pgx.Conn) error {
	var recorded bool
	if err := conn.QueryRow(ctx, `SELECT to_regclass('epitaph_capture.replica_identity') IS NOT NULL`).Scan(&recorded); err != nil {
		return fmt.Errorf("read recorded replica identities: %w", err)
	}
	if !recorded {
		return nil
	}
	rows, err := conn.Query(ctx, `
SELECT r.relation, r.identity::text, coalesce(r.index_name, ''),
       n.nspname, c.relname, c.relreplident::text,
       EXISTS (SELECT 1 FROM pg_class ic WHERE ic.relname = r.index_name AND ic.relnamespace = c.relnamespace AND ic.relkind = 'i')
FROM epitaph_capture.replica_identity r
LEFT JOIN pg_class c ON c.oid = r.relid
LEFT JOIN pg_namespace n ON n.oid = c.relnamespace
WHERE r.publication = $1
ORDER BY r.relation`, p.cfg.PublicationName)
	if err != nil {
		return fmt.Errorf("read recorded replica identities: %w", err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			was, ident, index string
			schema, name, now *string
			indexExists       bool
		)
		if err := rows.Scan(&was, &ident, &index, &schema, &name, &now, &indexExists); err != nil {
			return fmt.Errorf("read recorded replica identities: %w", err)
		}
		switch {
		case name == nil:
			p.Notes = append(p.Notes, was+": dropped since the capture set it FULL")
			continue
		case *now != "f":
			p.Notes = append(p.Notes, was+": no longer FULL (changed since the capture set it): left as it is")
			continue
		}
		rel := pgx.Identifier{*schema, *name}.Sanitize()
		var to string
		switch {
		case ident == "n":
			to = "NOTHING"
		case ident == "i" && indexExists:
			to = "USING INDEX " + pgx.Identifier{index}.Sanitize()
		case ident == "i":
			to = "DEFAULT"
			p.Notes = append(p.Notes, fmt.Sprintf("%s: its replica identity index %q is gone: DEFAULT instead", rel, index))
		default:
			to = "DEFAULT"
		}
		p.Steps = append(p.Steps, "ALTER TABLE "+rel+" REPLICA IDENTITY "+to)
	}
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read recorded replica identities: %w", err)
	}
	p.Steps = append(p.Steps, "DELETE FROM epitaph_capture.replica_identity WHERE publication = "+pgquote.Literal(p.cfg.PublicationName))
	return nil
}

// InUse is a *ConfigError when a process streamed the slot as the plan
// was made (Apply refuses the plan), nil otherwise.
func (p *UninstallPlan) InUse() error {
	if p.inUse == 0 {
		return nil
	}
	return configErr("replication slot %q is in use by process %d (a capture streaming it): stop the capture, then uninstall", p.cfg.SlotName, p.inUse)
}

// Apply runs the plan's statements in order, the publication dropped
// before any replica identity is put back (a published table without a
// usable identity would make the application's DELETEs fail). The record
// table, and its schema, go when no other publication's records are left.
// A failed step stops it; running uninstall again picks up from there.
// A plan whose slot was in use (InUse) is refused, nothing run.
func (p *UninstallPlan) Apply(ctx context.Context) error {
	if err := p.InUse(); err != nil {
		return err
	}
	conn, err := uninstallConnect(ctx, p.cfg.SourceURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	for _, s := range p.Steps {
		if _, err := conn.Exec(ctx, s); err != nil {
			return fmt.Errorf("%s: %w", s, err)
		}
	}
	// Each record table goes when no other publication's records are
	// left in it; the schema when all are gone.
	records := []string{stateSchema + ".replica_identity", factsTable, leavesTable}
	gone := 0
	for _, table := range records {
		var exists, left bool
		if err := conn.QueryRow(ctx, `SELECT to_regclass($1) IS NOT NULL`, table).Scan(&exists); err != nil {
			return fmt.Errorf("read %s: %w", table, err)
		}
		if exists {
			if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+table+`)`).Scan(&left); err != nil {
				return fmt.Errorf("read %s: %w", table, err)
			}
			if left {
				continue
			}
			if _, err := conn.Exec(ctx, `DROP TABLE `+table); err != nil {
				return fmt.Errorf("drop %s: %w", table, err)
			}
		}
		gone++
	}
	var schema bool
	if err := conn.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = $1)`, stateSchema).Scan(&schema); err != nil {
		return fmt.Errorf("read schema %s: %w", stateSchema, err)
	}
	if gone < len(records) || !schema {
		return nil
	}
	// The schema only when empty (RESTRICT): nothing else of ours is there.
	if _, err := conn.Exec(ctx, `DROP SCHEMA `+stateSchema); err != nil {
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && pgErr.Code == "2BP01" {
			return nil
		}
		return fmt.Errorf("drop schema %s: %w", stateSchema, err)
	}
	return nil
}

// String is the plan as an operator reads it: the statements, then the notes.
func (p *UninstallPlan) String() string {
	var b strings.Builder
	for _, s := range p.Steps {
		b.WriteString("  " + s + ";\n")
	}
	if len(p.Steps) == 0 {
		b.WriteString("  (nothing to do)\n")
	}
	for _, n := range p.Notes {
		b.WriteString("  note: " + n + "\n")
	}
	return b.String()
}

// uninstallTimeout bounds uninstall's connect (unless the URL sets
// connect_timeout) and how long its sent data may go unacknowledged.
var uninstallTimeout = DefaultSourceTCPTimeout

// uninstallConnect connects to the source as the capture does: a source
// that does not answer fails the connect after uninstallTimeout (the
// URL's connect_timeout when it sets one), and a network path that dies
// mid-statement fails it about as soon (TCP_USER_TIMEOUT), instead of
// when TCP gives up minutes later.
func uninstallConnect(ctx context.Context, url string) (*pgx.Conn, error) {
	cfg, err := pgx.ParseConfig(url)
	if err != nil {
		return nil, configErr("EPITAPH_SOURCE_URL: %s", redactErr(err))
	}
	if cfg.ConnectTimeout <= 0 {
		cfg.ConnectTimeout = uninstallTimeout
	}
	pgdial.Set(&cfg.Config, uninstallTimeout)
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect to source %s: %s", RedactURL(url), redactErr(err))
	}
	return conn, nil
}
