package testenv_test

import (
	"context"
	"os"
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.Main(m) }

func TestPostgresIsLogical(t *testing.T) {
	t.Parallel()
	url := testenv.NewDatabase(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var level string
	require.NoError(t, conn.QueryRow(ctx, "SHOW wal_level").Scan(&level))
	require.Equal(t, "logical", level)
	var db string
	require.NoError(t, conn.QueryRow(ctx, "SELECT current_database()").Scan(&db))
	require.NotEqual(t, "postgres", db, "each test gets its own database")
}

func TestJetStreamPersistsAcrossRestart(t *testing.T) {
	t.Parallel()
	n := testenv.NewNATS(t)
	_, js := n.Connect(t)
	ctx := context.Background()
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "T", Subjects: []string{"t.>"}, Storage: jetstream.FileStorage})
	require.NoError(t, err)
	_, err = js.Publish(ctx, "t.a", []byte("hello"))
	require.NoError(t, err)
	n.Restart()
	_, js2 := n.Connect(t)
	s, err := js2.Stream(ctx, "T")
	require.NoError(t, err)
	msg, err := s.GetMsg(ctx, 1)
	require.NoError(t, err)
	require.Equal(t, "hello", string(msg.Data))
}

func TestNoSearchPathFailsAnUnqualifiedName(t *testing.T) {
	t.Parallel()
	url := testenv.NewDatabase(t)
	testenv.Exec(t, url, `CREATE TABLE items (id int); INSERT INTO items VALUES (7)`)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, testenv.NoSearchPath(url))
	require.NoError(t, err)
	defer conn.Close(ctx)
	var path string
	require.NoError(t, conn.QueryRow(ctx, "SHOW search_path").Scan(&path))
	require.Empty(t, path)
	var n int
	err = conn.QueryRow(ctx, "SELECT count(*) FROM items").Scan(&n)
	require.ErrorContains(t, err, `relation "items" does not exist`)
	require.NoError(t, conn.QueryRow(ctx, "SELECT id FROM public.items").Scan(&n))
	require.Equal(t, 7, n)
}

// The version matrix relies on EPITAPH_TEST_PG choosing the server: a
// fallback to Debian's would pass every test on the wrong version.
func TestServerIsTheRequestedMajor(t *testing.T) {
	t.Parallel()
	want := os.Getenv("EPITAPH_TEST_PG")
	if want == "" {
		t.Skip("EPITAPH_TEST_PG is not set: the default server is whichever is installed")
	}
	url := testenv.NewDatabase(t)
	ctx := context.Background()
	conn, err := pgx.Connect(ctx, url)
	require.NoError(t, err)
	defer conn.Close(ctx)
	var num int
	require.NoError(t, conn.QueryRow(ctx, "SELECT current_setting('server_version_num')::int").Scan(&num))
	require.Equal(t, want, strconv.Itoa(num/10000))
}
