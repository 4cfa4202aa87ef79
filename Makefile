# Epitaph — the two commands: `make demo` and `make test`.
GO        ?= go
BIN       := bin
PKGS      := ./...
# go test runs at most this many package binaries at once; each starts its
# own PostgreSQL, so keep it at the core count.
TEST_P    ?= 2
FUZZTIME  ?= 20s

.PHONY: all build demo test test-deps vet fmt-check fuzz bench-capture bench-projector clean

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/capture ./cmd/projector

## demo: throwaway Postgres + capture (embedded JetStream) + projector, a shop workload, the archive.
demo: build
	$(GO) run ./internal/demo

## test: every test against a real PostgreSQL and a real JetStream server, then a bounded fuzz run.
test: test-deps vet fmt-check
	$(GO) test -p $(TEST_P) -count=1 -timeout 45m $(PKGS)
	$(MAKE) fuzz

## test-deps: Debian packages some tests run as real programs (promtool/prometheus, chromium, docker-compose), installed if missing.
test-deps:
	@bash scripts/test-deps.sh

vet:
	$(GO) vet $(PKGS)

fmt-check:
	@out="$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))"; \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

fuzz:
	$(GO) test ./event -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME)

## bench-capture: capture vs pg_recvlogical on the same 300k-row backlog; peak RSS on a 1M-row transaction.
bench-capture:
	$(GO) run ./internal/bench/capture

## bench-projector: projector apply vs raw COPY; end-to-end rate with capture and projector together.
bench-projector:
	$(GO) run ./internal/bench/projector

clean:
	rm -rf $(BIN) .demo .bench
