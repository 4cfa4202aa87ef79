package revalidate

import (
	"context"

	"github.com/epitaph-dev/epitaph/handler"
)

// Revalidator is the dispatcher's seam (handler.Revalidator): it evaluates
// the delivery afresh and records the evaluation before returning the
// decision. An evaluation that cannot be recorded defers (a changed
// delivery must not stop before its next generation is queued, and nothing
// unrecorded is sent). The error is non-nil only for a delivery that does
// not exist.
func (e *Evaluator) Revalidator() handler.Revalidator {
	return func(ctx context.Context, d handler.Delivery) (handler.Decision, error) {
		res, err := e.Evaluate(ctx, d.ID)
		if err != nil {
			return handler.Decision{}, err
		}
		if err := e.Record(ctx, res); err != nil {
			e.cfg.Logger.Warn("revalidation deferred: the evaluation could not be recorded", "delivery", d.ID, "err", err)
			return handler.Decision{Outcome: handler.Defer}, nil
		}
		return handler.Decision{Outcome: res.Outcome, Fingerprint: res.ObservedFingerprint}, nil
	}
}
