package capture

import (
	"context"
	"errors"
	"time"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// sqlEndOwnWalsender ends backend $1 if it is the walsender streaming slot
// $3 with application_name $2, in one statement: no other session is
// signalled even if the slot changed hands since it was read. No row: it
// is not (or no longer) that walsender.
const sqlEndOwnWalsender = `
SELECT pg_terminate_backend(a.pid) FROM pg_stat_activity a
WHERE a.pid = $1 AND a.backend_type = 'walsender' AND a.application_name = $2
  AND a.pid = (SELECT active_pid FROM pg_replication_slots WHERE slot_name = $3)`

// endOwnWalsender ends the walsender active on the slot, pid, when it is
// provably this process's own stale one: the backend of the replication
// connection this process last started replication on, with this
// process's application_name. After a silently dead path the source keeps
// it until wal_sender_timeout (60 s by default) tells it the capture is
// gone; a capture, a standby's holder or any other client streaming the
// slot is never signalled. It reports whether it is done with pid (ended,
// not its own, or refused), false when it could not tell (try again).
// Refused (pg_terminate_backend revoked, or another role's walsender), it
// says so once and the session waits for wal_sender_timeout as before.
func (s *Service) endOwnWalsender(ctx context.Context, pid int32) bool {
	if s.walsender == 0 || uint32(pid) != s.walsender {
		return true
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	var ended bool
	err := s.pool.QueryRow(ctx, sqlEndOwnWalsender, pid, storedAppName(s.cfg.ApplicationName), s.cfg.SlotName).Scan(&ended)
	if errors.Is(err, pgx.ErrNoRows) {
		return true
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == "42501" { // insufficient_privilege
		s.terminateRefused.Do(func() {
			s.log.Warn("cannot end this capture's own stale walsender: the source keeps it until wal_sender_timeout ends it, and the new session waits for that",
				"slot", s.cfg.SlotName, "walsender_pid", pid, "err", pgErr.Message,
				"fix", "let the capture role execute pg_terminate_backend, or lower wal_sender_timeout")
		})
		return true
	}
	if err != nil {
		s.log.Debug("could not end this capture's own stale walsender; trying again", "walsender_pid", pid, "err", redactErr(err))
		return false
	}
	if ended {
		s.log.Info("ended this capture's own stale walsender", "slot", s.cfg.SlotName, "walsender_pid", pid)
	}
	return true
}

// storedAppName is application_name as pg_stat_activity shows it: its
// first 63 bytes (NAMEDATALEN - 1), cut at a character boundary. A name
// with other than printable ASCII, which the server rewrites, never
// matches: the capture then waits as for any other session.
func storedAppName(name string) string {
	const keep = 63
	if len(name) <= keep {
		return name
	}
	end := keep
	for end > 0 && !utf8.RuneStart(name[end]) {
		end--
	}
	return name[:end]
}
