package erasure_test

import (
	"testing"

	"github.com/epitaph-dev/epitaph/internal/testenv"
)

func TestMain(m *testing.M) { testenv.MainNoLeaks(m) }
