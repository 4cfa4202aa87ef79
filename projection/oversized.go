package projection

import (
	"context"
	"fmt"

	"github.com/epitaph-dev/epitaph/event"
	"github.com/epitaph-dev/epitaph/quarantine"
)

// DefaultMaxRowBytes is the default Config.MaxRowBytes: 256 MiB.
const DefaultMaxRowBytes int64 = 256 << 20

// fetchRow reads a large row from the object store unless the event says it
// is bigger than Config.MaxRowBytes: then it is permanent (oversized) and
// nothing is fetched.
func (s *Service) fetchRow(ctx context.Context, ref *event.ObjectRef) ([]byte, error) {
	return fetchLimited(ctx, s.objects, ref, s.cfg.MaxRowBytes)
}

// fetchLimited is objectReader.fetch for an object of at most limit bytes
// (as the event tells its size); limit <= 0 means DefaultMaxRowBytes.
func fetchLimited(ctx context.Context, o *objectReader, ref *event.ObjectRef, limit int64) ([]byte, error) {
	if limit <= 0 {
		limit = DefaultMaxRowBytes
	}
	if ref.Size > limit {
		return nil, quarantine.Permanent(quarantine.CategoryOversized,
			fmt.Errorf("object %s/%s is %d bytes, above the limit of %d (max row bytes)", ref.Bucket, ref.Name, ref.Size, limit))
	}
	return o.fetch(ctx, ref)
}
