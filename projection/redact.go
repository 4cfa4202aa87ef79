package projection

import "github.com/epitaph-dev/epitaph/internal/redact"

// redact hides the password of a connection URL for logs and errors.
func redactURL(raw string) string { return redact.URL(raw) }
