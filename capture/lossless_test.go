package capture

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/internal/testenv"
	"github.com/epitaph-dev/epitaph/projection"
	"github.com/epitaph-dev/epitaph/restore"
)

// losslessColumns is one column per built-in type family, with three
// values each: ordinary, edge and NULL-ish.
var losslessColumns = []struct {
	name, typ string
	vals      [3]string // SQL expressions
}{
	{"i2", "smallint", [3]string{"-32768", "32767", "NULL"}},
	{"i4", "integer", [3]string{"-2147483648", "0", "42"}},
	{"i8", "bigint", [3]string{"9007199254740993", "-9223372036854775808", "9223372036854775807"}},
	{"o", "oid", [3]string{"4294967295", "0", "NULL"}},
	{"num", "numeric", [3]string{"1234567890123456789012345678901234567890.0123456789", "'-Infinity'", "-0.000000000000000000000000000000000000001"}},
	{"num_t", "numeric(12,2)", [3]string{"12.50", "9999999999.99", "-0.10"}},
	{"f4", "real", [3]string{"1.1", "'NaN'", "'-Infinity'"}},
	{"f8", "double precision", [3]string{"0.1", "'Infinity'", "'-0'"}},
	{"f8e", "double precision", [3]string{"1e-310", "1.7976931348623157e308", "-4.2e-05"}},
	{"txt", "text", [3]string{`E'h\u00e9llo \u4e16\u754c \U0001F389 "q" \\ back\nline\ttab'`, "''", "E'<>&\\u2028'"}},
	{"vc", "varchar(10)", [3]string{"'abc'", "'  spaced '", "NULL"}},
	{"ch", "char(5)", [3]string{"'ab'", "''", "'abcde'"}},
	{"by", "bytea", [3]string{`'\x00ff10'`, `''::bytea`, `'\x5c27'`}},
	{"bo", "boolean", [3]string{"true", "false", "NULL"}},
	{"d", "date", [3]string{"'2026-11-30'", "'infinity'", "'4713-01-01 BC'"}},
	{"tm", "time(3)", [3]string{"'09:00:00.123'", "'24:00:00'", "'00:00'"}},
	{"ttz", "timetz", [3]string{"'09:00:00.123456+05:30'", "'23:59:59-12'", "NULL"}},
	{"ts", "timestamp", [3]string{"'2026-11-30 09:00:00.123456'", "'-infinity'", "'0001-01-01 00:00:00 BC'"}},
	{"tstz", "timestamptz", [3]string{"'2026-11-30 09:00:00.123456+02'", "'infinity'", "'1900-01-01 00:00:00+00'"}},
	{"iv", "interval", [3]string{"'1 year 2 mons 3 days 04:05:06.789'", "'-1 day +02:00'", "'0'"}},
	{"u", "uuid", [3]string{"'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "'00000000-0000-0000-0000-000000000000'", "NULL"}},
	{"ip", "inet", [3]string{"'192.168.1.5/24'", "'::1'", "'2001:db8::1/64'"}},
	{"net", "cidr", [3]string{"'10.0.0.0/8'", "'2001:db8::/32'", "NULL"}},
	{"mac", "macaddr", [3]string{"'08:00:2b:01:02:03'", "'ff:ff:ff:ff:ff:ff'", "NULL"}},
	{"js", "json", [3]string{`'{"b": 1,  "a":[1, 2], "b": 2}'`, `'"x"'`, `'null'`}},
	{"jb", "jsonb", [3]string{`'{"a": 1.10, "big": 123456789012345678901234567890, "s": "\u00e9\n"}'`, `'[]'`, `'null'`}},
	{"jbs", "jsonb", [3]string{`'"null"'`, `'1.50'`, `'"x"'`}},
	{"ia", "integer[]", [3]string{"'{1,NULL,3}'", "'{}'", "'[0:1]={7,8}'"}},
	{"ta", "text[]", [3]string{`'{{a,"b c"},{NULL,"d\"e"}}'`, `'{"NULL",""}'`, "NULL"}},
	{"na", "numeric[]", [3]string{"'{1.5,NaN,NULL,Infinity}'", "'{{1},{2}}'", "NULL"}},
	{"mo", "mood", [3]string{"'happy'", "'sad'", "NULL"}},
	{"dom", "posint", [3]string{"1", "2147483647", "NULL"}},
	{"comp", "pair", [3]string{"ROW(1, 'x y')::pair", "ROW(NULL, '')::pair", "ROW(NULL, NULL)::pair"}},
	{"compa", "pair[]", [3]string{"ARRAY[ROW(1,'a')::pair, NULL]", "'{}'", "NULL"}},
	{"r", "int4range", [3]string{"'[1,5)'", "'empty'", "'(,3]'"}},
	{"tr", "tstzrange", [3]string{"'[2026-01-01 00:00+00,2026-02-01 00:00+00)'", "'(,)'", "NULL"}},
	{"nr", "numrange", [3]string{"'[1.5,2.25]'", "'empty'", "NULL"}},
	{"pt", "point", [3]string{"'(1.5,-2)'", "'(0,0)'", "NULL"}},
	{"bits", "bit varying(8)", [3]string{"B'101'", "B''", "NULL"}},
	{"mny", "money", [3]string{"12.34", "-0.01", "NULL"}},
	// 20 more: text search, xml, geometry, multiranges, WAL positions,
	// the odd built-ins, and jsonb scalars a JSON reader takes for SQL.
	{"x", "xml", [3]string{"'<a b=\"1\">t &amp; u</a>'", "'text only'", "NULL"}},
	{"tsv", "tsvector", [3]string{"'a fat:2A cat:1 sat'", "''", "NULL"}},
	{"tsq", "tsquery", [3]string{"'fat & (rat | cat:*)'", "'!x'", "NULL"}},
	{"ln", "line", [3]string{"'{1,-1,0}'", "'{0,1,-2.5}'", "NULL"}},
	{"ls", "lseg", [3]string{"'[(0,0),(1,1.5)]'", "'[(-1,-1),(-1,-1)]'", "NULL"}},
	{"bx", "box", [3]string{"'(1,1),(0,0)'", "'(-0.5,2),(3,4)'", "NULL"}},
	{"pa", "path", [3]string{"'[(0,0),(1,1),(2,0)]'", "'((0,0),(1,1))'", "NULL"}},
	{"pg", "polygon", [3]string{"'((0,0),(1,0),(1,1))'", "'((0,0))'", "NULL"}},
	{"ci", "circle", [3]string{"'<(0,0),1.5>'", "'<(1e10,-1),0>'", "NULL"}},
	{"mr", "int4multirange", [3]string{"'{[1,3),[5,7)}'", "'{}'", "NULL"}},
	{"dmr", "datemultirange", [3]string{"'{[2026-01-01,2026-02-01)}'", "'{(,2026-01-01)}'", "NULL"}},
	{"lsn", "pg_lsn", [3]string{"'0/16B3748'", "'FFFFFFFF/FFFFFFFF'", "NULL"}},
	{"m8", "macaddr8", [3]string{"'08:00:2b:01:02:03:04:05'", "'00:00:00:ff:fe:00:00:00'", "NULL"}},
	{"b3", "bit(3)", [3]string{"B'101'", "B'000'", "NULL"}},
	{"nm", "name", [3]string{"'a name'", "''", "NULL"}},
	{"c1", `"char"`, [3]string{`'x'`, `''`, "NULL"}},
	{"dr", "daterange", [3]string{"'[2026-01-01,2026-01-31]'", "'empty'", "NULL"}},
	{"jp", "jsonpath", [3]string{`'$.a[*] ? (@ > 1)'`, `'strict $."k y"'`, "NULL"}},
	{"f8a", "double precision[]", [3]string{"'{-0,NaN,1e-310}'", "'{Infinity,-Infinity}'", "NULL"}},
	{"jbn", "jsonb", [3]string{"'42'", "'true'", `'"42"'`}},
}

// TestLosslessValues deletes rows holding every type family, rebuilds an
// INSERT from each event alone (RestoreSQL) and checks that the restored
// row equals the deleted one by row::text; then deletes them again and
// puts them back from the archive alone (capture -> stream -> projector ->
// archive_v1.rows -> restore.Run), equal by row::text again.
func TestLosslessValues(t *testing.T) {
	t.Parallel()
	e := setup(t)
	var cols []string
	for _, c := range losslessColumns {
		cols = append(cols, c.name+" "+c.typ)
	}
	e.exec(t, `CREATE TYPE mood AS ENUM ('sad', 'happy');
		CREATE DOMAIN posint AS integer CHECK (VALUE > 0);
		CREATE TYPE pair AS (x integer, y text);
		CREATE TABLE lossless (id integer PRIMARY KEY, `+strings.Join(cols, ", ")+`);
		ALTER TABLE lossless REPLICA IDENTITY FULL`)
	for row := 0; row < 3; row++ {
		var names, vals []string
		for _, c := range losslessColumns {
			names = append(names, c.name)
			vals = append(vals, c.vals[row])
		}
		e.exec(t, `INSERT INTO lossless (id, `+strings.Join(names, ", ")+`) VALUES (`+itoa(row+1)+`, `+strings.Join(vals, ", ")+`)`)
	}
	e.exec(t, `INSERT INTO lossless (id) VALUES (4)`) // every column NULL

	ctx := context.Background()
	conn, err := pgx.Connect(ctx, e.db)
	require.NoError(t, err)
	defer conn.Close(ctx)
	readAll := func() []string {
		rows, err := conn.Query(ctx, `SELECT t::text FROM lossless t ORDER BY id`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		return out
	}
	before := readAll()
	require.Len(t, before, 4)

	e.start(t, nil)
	e.exec(t, `DELETE FROM lossless`)
	ms := e.deletes(t, "main", 4)
	require.Len(t, ms, 4)
	require.Empty(t, readAll())

	for _, m := range ms {
		require.Equal(t, event.IdentityFull, m.ev.Identity)
		sql, args, err := RestoreSQL(m.ev)
		require.NoError(t, err)
		_, err = conn.Exec(ctx, sql, args...)
		require.NoError(t, err, "restore %s", m.ev.Key)
	}
	after := readAll()
	require.Equal(t, before, after)

	// Types are named as format_type names them; JSON mapping per family.
	cols0 := map[string]string{}
	for _, c := range ms[0].ev.Columns {
		cols0[c.Name] = c.Type
	}
	require.Equal(t, "public.mood", cols0["mo"])
	require.Equal(t, "public.posint", cols0["dom"])
	require.Equal(t, "numeric(12,2)", cols0["num_t"])
	require.Equal(t, "integer[]", cols0["ia"])
	row1, _, err := objectFields(ms[0].ev.Row)
	require.NoError(t, err)
	require.Equal(t, "9007199254740993", string(row1["i8"]))
	require.Equal(t, `"1234567890123456789012345678901234567890.0123456789"`, string(row1["num"]))
	require.Equal(t, "true", string(row1["bo"]))
	require.Equal(t, `"1"`, string(row1["dom"]), "a domain travels as its text form")
	require.JSONEq(t, `{"a": 1.10, "big": 123456789012345678901234567890, "s": "\u00e9\n"}`, string(row1["jb"]))
	require.Equal(t, `"{\"b\": 1,  \"a\":[1, 2], \"b\": 2}"`, string(row1["js"]), "json keeps its exact text")
	row2, _, err := objectFields(ms[1].ev.Row)
	require.NoError(t, err)
	require.Equal(t, `"NaN"`, string(row2["f4"]))
	require.Equal(t, `"Infinity"`, string(row2["f8"]))
	require.Equal(t, "-9223372036854775808", string(row2["i8"]))
	require.Equal(t, "[]", string(row2["jb"]))
	require.Equal(t, `"1.50"`, string(row2["jbs"]), "jsonb scalars travel as text")
	row3, _, err := objectFields(ms[2].ev.Row)
	require.NoError(t, err)
	require.Equal(t, `"null"`, string(row3["jb"]), "jsonb null is not SQL NULL")
	row4, _, err := objectFields(ms[3].ev.Row)
	require.NoError(t, err)
	require.Equal(t, "null", string(row4["jb"]))

	// Through the archive: no event at hand, only what archive.rows keeps.
	target := testenv.NewDatabase(t)
	proj, err := projection.New(projection.Config{TargetURL: target, NATSURL: e.nats.URL, SourceName: "main", WorkerID: "w1",
		LeaseTTL: 3 * time.Second, FetchWait: 100 * time.Millisecond, StatusInterval: 300 * time.Millisecond},
		projection.WithLogger(testLogger(t)), projection.WithRegistry(prometheus.NewRegistry()))
	require.NoError(t, err)
	require.NoError(t, proj.Start(ctx))
	t.Cleanup(func() { require.NoError(t, proj.Stop(context.Background())) })
	e.exec(t, `DELETE FROM lossless`)
	again := e.deletes(t, "main", 8)[4:]
	require.Empty(t, readAll())
	corr := again[0].ev.CorrelationID()
	pool, err := pgxpool.New(ctx, target)
	require.NoError(t, err)
	defer pool.Close()
	require.Eventually(t, func() bool {
		var n int
		return pool.QueryRow(ctx, `SELECT count(*) FROM archive.rows WHERE correlation_id = $1`, corr).Scan(&n) == nil && n == 4
	}, 90*time.Second, 50*time.Millisecond, "the second delete is archived")
	var negZero string
	require.NoError(t, pool.QueryRow(ctx, `SELECT text_values::text FROM archive.rows
		WHERE correlation_id = $1 AND key = '{"id": 3}'`, corr).Scan(&negZero))
	require.JSONEq(t, `{"f8": "-0"}`, negZero, "jsonb keeps -0 as 0: the archive keeps its text")
	res, err := restore.Run(ctx, pool, conn, restore.Config{Source: "main", CorrelationID: corr, Actor: "test"})
	require.NoError(t, err)
	require.Equal(t, 4, res.Restored)
	require.Equal(t, before, readAll(), "restored from the archive alone, equal by row::text")
}
