package projection

import "time"

// WithFirstBackoff sets a partition's first wait after a transient
// failure (100ms otherwise).
func WithFirstBackoff(d time.Duration) Option { return func(o *options) { o.firstBackoff = d } }
