package status

import (
	"context"
	"fmt"

	"github.com/epitaph-dev/epitaph/progress"
	"github.com/epitaph-dev/epitaph/projection/archive"
	"github.com/epitaph-dev/epitaph/projection/version"
)

// What a reader of the live version is told (the read API's
// Epitaph-View-State header).
const (
	// ViewReady: archive.status.ready; a result is complete up to
	// complete_up_to_lsn.
	ViewReady = "ready"
	// ViewCatchingUp: every partition is owned and advancing, but the
	// version lags (or has not started every partition yet).
	ViewCatchingUp = "catching_up"
	// ViewUnavailable: no live version, a partition without an owner or
	// failing, or an unacknowledged blocking gap: waiting alone may not help.
	ViewUnavailable = "unavailable"
	// ViewQuarantined: an event of the live version is in quarantine.
	ViewQuarantined = "quarantined"
)

const unavailableSQL = `
SELECT count(*) = 0 OR bool_or(owner IS NULL OR lease_expires_at <= now() OR attempts >= $3)
FROM epitaph.progress WHERE projection = $1 AND version = $2`

// ViewState says what readers of projection's live version are told, with
// its archive.status row (nil when there is no live version).
func ViewState(ctx context.Context, db progress.DB, projection string) (string, *Readiness, error) {
	rs, err := ReadReadiness(ctx, db, projection)
	if err != nil {
		return ViewUnavailable, nil, err
	}
	var live *Readiness
	for i := range rs {
		if rs[i].State == version.StateLive {
			live = &rs[i]
		}
	}
	switch {
	case live == nil:
		return ViewUnavailable, nil, nil
	case live.Ready:
		return ViewReady, live, nil
	case live.QuarantineOpen > 0:
		return ViewQuarantined, live, nil
	case live.GapsUnacknowledged > 0:
		return ViewUnavailable, live, nil
	}
	var unavailable bool
	if err := db.QueryRow(ctx, unavailableSQL, projection, live.Version, archive.FailingAttempts).Scan(&unavailable); err != nil {
		return ViewUnavailable, live, fmt.Errorf("read partitions of %s v%d: %w", projection, live.Version, err)
	}
	if unavailable {
		return ViewUnavailable, live, nil
	}
	return ViewCatchingUp, live, nil
}
