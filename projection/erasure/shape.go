package erasure

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/epitaph-dev/epitaph/projection/archive"
)

// checkShape refuses a selector that can never match what the archive
// holds of the table, so an erasure or a hold typed wrong fails loudly
// instead of recording a fence that matches nothing: a --key whose columns
// are not the table's key columns, or whose values are of another JSON
// kind ({"id": "88"} for an integer key: fences compare values exactly),
// and a --match naming a column no archived row of the table has. A table
// with nothing archived passes: its rows may still be on their way, and
// the fence is what keeps them out.
//
// It returns the selector to record: for a --key archived under an equal
// key, that key as the archive holds it (archivedKey); sel otherwise.
func checkShape(ctx context.Context, db querier, schema, name, mode string, sel json.RawMessage) (json.RawMessage, error) {
	rows, err := archivedRows(ctx, db)
	if err != nil || rows == "" {
		return sel, err
	}
	if mode == EraseByKey {
		// A key archived as given is right, whatever other keys the
		// table had before or since (its key may have changed).
		if have, err := archivedKey(ctx, db, rows, schema, name, sel); err != nil || have != nil {
			return have, err
		}
	}
	return sel, shapeErr(ctx, db, rows, schema, name, mode, sel)
}

// archivedRows is what checkShape reads: the live version's verified
// rows, expired ones included (a row past its expiry that a legal hold,
// an open delivery or a cleanup batch not run yet still keeps shows the
// table's keys and columns as well as a row readers see). "" when no
// version is live yet.
func archivedRows(ctx context.Context, db querier) (string, error) {
	var schema string
	err := db.QueryRow(ctx, `SELECT schema_name FROM epitaph.projection_versions WHERE projection = $1 AND state = 'live'`,
		archive.Projection).Scan(&schema)
	if err != nil {
		return "", nothingArchived(err)
	}
	return `(SELECT * FROM ` + pgx.Identifier{schema, "rows"}.Sanitize() + ` WHERE verified)`, nil
}

// shapeErr is checkShape's refusal of a selector no archived key equals;
// rows is archivedRows'.
func shapeErr(ctx context.Context, db querier, rows, schema, name, mode string, sel json.RawMessage) error {
	want := decodeObject(sel)
	if mode == EraseByKey {
		var sample []byte
		err := db.QueryRow(ctx, `SELECT key::text FROM `+rows+` r
			WHERE schema_name = $1 AND table_name = $2 AND key IS NOT NULL LIMIT 1`, schema, name).Scan(&sample)
		if err = nothingArchived(err); err != nil || sample == nil {
			return err
		}
		have := decodeObject(sample)
		if !sameColumns(have, want) {
			return fmt.Errorf("%w: --key has the columns %s, but the archived keys of %s.%s have %s: a key with other columns never matches (--match selects by any columns)",
				ErrBadSelector, columnList(want), schema, name, columnList(have))
		}
		for c, v := range want {
			if k, hk := kindOf(v), kindOf(have[c]); k != "null" && hk != "null" && k != hk {
				return fmt.Errorf("%w: --key column %q is a JSON %s, but in the archived keys of %s.%s it is a %s: fences compare values exactly, so it would never match",
					ErrBadSelector, c, k, schema, name, hk)
			}
		}
		return nil
	}
	var archived bool
	err := db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+rows+` r WHERE schema_name = $1 AND table_name = $2)`,
		schema, name).Scan(&archived)
	if err = nothingArchived(err); err != nil || !archived {
		return err
	}
	for _, c := range slices.Sorted(maps.Keys(want)) {
		var has bool
		err = db.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM `+rows+` r
			WHERE schema_name = $1 AND table_name = $2 AND row ? $3)`, schema, name, c).Scan(&has)
		if err = nothingArchived(err); err != nil {
			return err
		}
		if !has {
			return fmt.Errorf("%w: --match column %q: no archived row of %s.%s has it, so the match would never match",
				ErrBadSelector, c, schema, name)
		}
	}
	return nil
}

// nothingArchived passes err on with context, but for the errors that
// only say there is nothing archived to check against: no row, or no
// archive yet (no version has been created on this target).
func nothingArchived(err error) error {
	var pg *pgconn.PgError
	switch {
	case err == nil, errors.Is(err, pgx.ErrNoRows):
		return nil
	case errors.As(err, &pg) && (pg.Code == "42P01" || pg.Code == "3F000"):
		return nil
	default:
		return fmt.Errorf("check the selector against the archive: %w", err)
	}
}

func sameColumns(a, b map[string]json.RawMessage) bool {
	if len(a) != len(b) {
		return false
	}
	for c := range a {
		if _, ok := b[c]; !ok {
			return false
		}
	}
	return true
}

func columnList(m map[string]json.RawMessage) string {
	return strings.Join(slices.Sorted(maps.Keys(m)), ", ")
}

// kindOf is the JSON kind of a scalar value.
func kindOf(v json.RawMessage) string {
	t := strings.TrimSpace(string(v))
	switch {
	case t == "" || t == "null":
		return "null"
	case t[0] == '"':
		return "string"
	case t == "true" || t == "false":
		return "boolean"
	default:
		return "number"
	}
}

// archivedKey is an erasure's --key as the archive holds it, when a row
// of the table is archived under an equal key. The archive compares keys
// as jsonb, by value ({"id": 42.0} finds {"id": 42}), but the fence
// compares a digest of the text the events carry, which the archive
// keeps: a fence of the text as typed would miss the next delete of the
// row it erased. nil: nothing archived under an equal key. rows is
// archivedRows'.
func archivedKey(ctx context.Context, db querier, rows, schema, name string, sel json.RawMessage) (json.RawMessage, error) {
	var have []byte
	err := db.QueryRow(ctx, `SELECT key::text FROM `+rows+` r WHERE schema_name = $1 AND table_name = $2 AND key = $3::jsonb LIMIT 1`,
		schema, name, string(sel)).Scan(&have)
	if err = nothingArchived(err); err != nil || have == nil {
		return nil, err
	}
	return have, nil
}
