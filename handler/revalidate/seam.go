package revalidate

import (
	"context"

	"github.com/epitaph-dev/epitaph/handler"
)

// Revalidator is the dispatcher's seam (handler.Revalidator): it evaluates
// the delivery afresh and returns the decision. The dispatcher's settle
// records the evaluation (outcome, observed fingerprint, evaluated_at)
// with the attempt's result, in the same row write, guarded by the claim
// token. What the settle cannot record is written here first, by Record,
// before the decision is returned: the next generation of a changed
// delivery (it must be queued before the old one stops) and the pair a
// full read refreshed. Such an evaluation that cannot be recorded defers.
// The error is non-nil only for a delivery that does not exist.
func (e *Evaluator) Revalidator() handler.Revalidator {
	return func(ctx context.Context, d handler.Delivery) (handler.Decision, error) {
		res, err := e.Evaluate(ctx, d.ID)
		v := e.verdict(ctx, res, err)
		return v.Decision, v.Err
	}
}

// needsRecord: does Record write anything the dispatcher's settle does not
// (a next generation, a refreshed pair)? A separate transaction per
// delivery for the outcome alone wrote every delivery once more than the
// settle, which writes the same columns.
func needsRecord(res Result) bool {
	return res.Outcome == StopChanged || (res.Outcome == Send && res.Path == PathFull)
}

// BatchRevalidator is the dispatcher's batch seam
// (handler.BatchRevalidator): EvaluateClaimed over a claimed batch, then,
// per delivery, what Revalidator does after its evaluation.
func (e *Evaluator) BatchRevalidator() handler.BatchRevalidator {
	return func(ctx context.Context, ds []handler.Delivery) []handler.Verdict {
		results := e.EvaluateClaimed(ctx, ds)
		vs := make([]handler.Verdict, len(ds))
		for i, res := range results {
			vs[i] = e.verdict(ctx, res, nil)
		}
		return vs
	}
}

// verdict records what the settle cannot (Record) and returns the
// decision.
func (e *Evaluator) verdict(ctx context.Context, res Result, err error) handler.Verdict {
	if err != nil {
		return handler.Verdict{Err: err}
	}
	if res.Outcome == Defer && res.Reason == ReasonNoSourceURL {
		// A setting only the operator can give: a failed attempt that says
		// so (retried with backoff, dead after the handler's attempts),
		// never a silent wait.
		return handler.Verdict{Err: handler.Explained(ReasonNoSourceURL, NoSourceURLText)}
	}
	if needsRecord(res) {
		if err := e.Record(ctx, res); err != nil {
			e.cfg.Logger.Warn("revalidation deferred: the evaluation could not be recorded", "delivery", res.d.id, "err", err)
			return handler.Verdict{Decision: handler.Decision{Outcome: handler.Defer}}
		}
	}
	return handler.Verdict{Decision: handler.Decision{Outcome: res.Outcome, Fingerprint: res.ObservedFingerprint}}
}
