package capture

import (
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	lagBytes      prometheus.Gauge
	lagSeconds    prometheus.Gauge
	retainedWAL   prometheus.Gauge
	safeWAL       prometheus.Gauge
	timeToInvalid prometheus.Gauge
	slotFailover  prometheus.Gauge
	published     *prometheus.CounterVec
	publishErrors prometheus.Counter
	transactions  prometheus.Counter
	confirmedLSN  prometheus.Gauge
	withoutFull   prometheus.Gauge
	heartbeatAge  prometheus.GaugeFunc
	active        prometheus.Gauge
	// connected is 1 per link (source, broker) while it is up, 0 while
	// the capture has not connected yet or reconnects.
	connected *prometheus.GaugeVec
	largeRows prometheus.Counter
	// limitsRestored counts stream limits restored after a change behind
	// the capture's back, by limit ("failed": could not be restored).
	limitsRestored *prometheus.CounterVec
	// streamUnsafe is 1 for a stream setting that lets events be removed
	// and that the broker never lets the capture undo.
	streamUnsafe *prometheus.GaugeVec
	// Partition sequences kept outside the stream.
	tailRemoved     prometheus.Counter
	seqRecordErrors prometheus.Counter
	foreign         prometheus.Counter
	implausible     prometheus.Counter
	collisions      prometheus.Counter
	sessions        prometheus.Counter
	// Following the source's schema.
	tablesAdded    prometheus.Counter
	partitionMoves prometheus.Counter
	tablesRemoved  prometheus.Counter
	madeFull       prometheus.Counter
	catalogErrors  prometheus.Counter
	// ddlListenUp is 1 while the notify DDL guard's LISTEN is up.
	ddlListenUp prometheus.Gauge
	// The CPU mode (cpumode.go).
	cpus            prometheus.Gauge
	catchingUp      prometheus.Gauge
	cpuNice         prometheus.Gauge
	backlogBytes    prometheus.Gauge
	cpuModeSwitches *prometheus.CounterVec

	// confirmLag is the age of unconfirmedSince: the Unix nanoseconds at
	// which the oldest written position not yet confirmed to the slot was
	// written (0: none), kept by the session's tracker.
	confirmLag       prometheus.GaugeFunc
	unconfirmedSince atomic.Int64
	syncInterval     prometheus.Gauge
}

func newMetrics(reg *prometheus.Registry, heartbeatAge func() float64, now func() time.Time) (*metrics, error) {
	g := func(name, help string) prometheus.Gauge {
		return prometheus.NewGauge(prometheus.GaugeOpts{Name: name, Help: help})
	}
	c := func(name, help string) prometheus.Counter {
		return prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	}
	m := &metrics{
		lagBytes:      g("epitaph_capture_replication_lag_bytes", "WAL bytes between the source's current position and the LSN capture confirmed to its slot."),
		lagSeconds:    g("epitaph_capture_replication_lag_seconds", "Seconds between a source commit (or heartbeat) and its publication, at the last one published."),
		retainedWAL:   g("epitaph_capture_slot_retained_wal_bytes", "WAL bytes the replication slot keeps on the source (current LSN - restart_lsn)."),
		safeWAL:       g("epitaph_capture_slot_safe_wal_bytes", "WAL bytes that can still be written before the slot is invalidated (-1: unlimited; 0: past the limit, lost at the next checkpoint)."),
		timeToInvalid: g("epitaph_capture_slot_time_to_invalidation_seconds", "Estimated seconds until the slot is invalidated at the current WAL rate (-1: unlimited or unknown)."),
		slotFailover:  g("epitaph_capture_slot_failover", "1 when the replication slot has FAILOVER (PostgreSQL 17+: standbys with sync_replication_slots keep a copy that survives their promotion), 0 otherwise."),
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "epitaph_capture_events_published_total",
			Help: "Messages published to JetStream, by table and op (commit, mark and gap have empty schema and table).",
		}, []string{"schema", "table", "op"}),
		publishErrors: c("epitaph_capture_publish_errors_total", "Publishes that failed (each stops the capture loop)."),
		transactions:  c("epitaph_capture_transactions_total", "Source transactions published (with a commit message)."),
		confirmedLSN:  g("epitaph_capture_confirmed_lsn", "LSN last confirmed to the replication slot, as a number."),
		withoutFull:   g("epitaph_capture_tables_without_full_identity", "Captured tables whose deletes carry only the key (REPLICA IDENTITY not FULL)."),
		active:        g("epitaph_capture_active", "1 while capture is streaming, 0 otherwise."),
		largeRows:     c("epitaph_capture_large_rows_total", "Rows larger than the broker's payload limit, published via the object store."),
		limitsRestored: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "epitaph_capture_stream_limits_restored_total",
			Help: "Stream limits changed behind the capture's back and restored to what --retention asks, by limit; limit=\"deny_purge\" or \"allow_rollup_hdrs\": a setting that let the stream be purged, restored (limit=\"failed\": could not be restored, the capture stopped).",
		}, []string{"limit"}),
		streamUnsafe: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "epitaph_capture_stream_setting_unsafe",
			Help: "1 when the stream has a setting that lets events be removed and that the broker never undoes (allow_msg_ttl, deny_delete, which breaks erase --purge-stream), by setting.",
		}, []string{"setting"}),
		tailRemoved:     c("epitaph_capture_partition_tail_removed_total", "Partitions found at start with their last published messages missing from the stream: their sequence continues after the missing ones (readers record a gap)."),
		seqRecordErrors: c("epitaph_capture_partition_seq_record_errors_total", "Failed records of the partition sequences in the data dir or on the source (retried at the next confirmation)."),
		foreign:         c("epitaph_capture_foreign_messages_total", "Messages found in the stream that this capture did not publish (ignored for the resume), each counted once."),
		implausible:     c("epitaph_capture_implausible_positions_total", "Messages signed with this capture's key whose position is beyond the source's current WAL, refused as resume positions."),
		collisions:      c("epitaph_capture_msg_id_collisions_total", "Messages of the capture whose Nats-Msg-Id a foreign message had taken, republished under another id."),
		sessions:        c("epitaph_capture_session_restarts_total", "Streaming sessions restarted in the same process because another writer got in the way (chain broken, id taken)."),
		tablesAdded:     c("epitaph_capture_tables_added_total", "Tables added to the publication while streaming (new tables, or tables safe again)."),
		partitionMoves:  c("epitaph_capture_partition_moves_total", "Rows an UPDATE moved to another partition: their delete was not published."),
		tablesRemoved:   c("epitaph_capture_tables_removed_total", "Tables removed from the publication because they lost their usable replica identity (each records a gap)."),
		madeFull:        c("epitaph_capture_replica_identity_set_full_total", "Relations set to REPLICA IDENTITY FULL by --set-replica-identity-full."),
		catalogErrors:   c("epitaph_capture_catalog_poll_errors_total", "Catalog checks that failed (retried at the next poll)."),
		ddlListenUp:     g("epitaph_capture_ddl_listen_up", "1 while the capture LISTENs for the notify DDL guard's signals (--install-ddl-guard --ddl-guard-mode notify), 0 while it reconnects (the catalog poll publishes new tables meanwhile) or without that guard."),
		cpus:            g("epitaph_capture_cpus", "CPUs the capture process uses (GOMAXPROCS): --tail-cpus while tailing, every CPU while catching up or when not limited."),
		cpuNice:         g("epitaph_capture_autogroup_nice", "Nice value the capture set on its scheduling group (its Linux autogroup): --tail-nice while tailing, 0 otherwise or when it cannot be set (see /status cpu_nice_unavailable)."),
		catchingUp:      g("epitaph_capture_catching_up", "1 while the capture catches up on every CPU (a backlog of at least --catch-up-bytes, or found at start), 0 otherwise."),
		backlogBytes:    g("epitaph_capture_backlog_bytes", "WAL bytes between what the capture has received and the source's current WAL position, at the last check (every second while --tail-cpus limits it; -1: not measured)."),
		cpuModeSwitches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "epitaph_capture_cpu_mode_switches_total",
			Help: "Switches of the CPU mode, by the mode switched to (tail, catch_up; the start's choice counts).",
		}, []string{"mode"}),
	}
	m.connected = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Name: "epitaph_capture_connected",
		Help: "1 while the capture's connection to the source (to=\"source\") or the broker (to=\"broker\") is up, 0 before it connected and while it reconnects after an outage.",
	}, []string{"to"})
	m.heartbeatAge = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "epitaph_capture_heartbeat_age_seconds",
		Help: "Seconds since the last heartbeat came back through the replication slot (-1: none yet).",
	}, heartbeatAge)
	m.syncInterval = g("epitaph_capture_broker_sync_interval_seconds", "How long confirmations to the slot trail the broker's acknowledgements (--broker-sync-interval; 0: they do not).")
	m.confirmLag = prometheus.NewGaugeFunc(prometheus.GaugeOpts{
		Name: "epitaph_capture_confirm_lag_seconds",
		Help: "Seconds since the oldest position JetStream acknowledged but not yet confirmed to the replication slot was acknowledged (0: none). Normally at most the broker sync interval plus about a second.",
	}, func() float64 {
		n := m.unconfirmedSince.Load()
		if n == 0 {
			return 0
		}
		return max(now().Sub(time.Unix(0, n)).Seconds(), 0)
	})
	// Every label exists from the start, so increase() sees the first restore.
	for _, l := range append(append([]string{}, limitNames...), "failed", guardDenyPurge, guardAllowRollup) {
		m.limitsRestored.WithLabelValues(l)
	}
	for _, g := range []string{guardAllowMsgTTL, guardDenyDelete} {
		m.streamUnsafe.WithLabelValues(g)
	}
	for _, mode := range []string{CPUModeTail, CPUModeCatchUp} {
		m.cpuModeSwitches.WithLabelValues(mode)
	}
	m.backlogBytes.Set(-1)
	m.safeWAL.Set(-1)
	m.timeToInvalid.Set(-1)
	for _, col := range []prometheus.Collector{m.lagBytes, m.lagSeconds, m.retainedWAL, m.safeWAL, m.timeToInvalid, m.slotFailover,
		m.published, m.publishErrors, m.transactions, m.confirmedLSN, m.withoutFull, m.heartbeatAge, m.active, m.connected, m.largeRows, m.limitsRestored, m.streamUnsafe,
		m.confirmLag, m.syncInterval,
		m.foreign, m.implausible, m.collisions, m.sessions, m.tailRemoved, m.seqRecordErrors,
		m.tablesAdded, m.partitionMoves, m.tablesRemoved, m.madeFull, m.catalogErrors, m.ddlListenUp,
		m.cpus, m.catchingUp, m.cpuNice, m.backlogBytes, m.cpuModeSwitches} {
		if err := reg.Register(col); err != nil {
			return nil, err
		}
	}
	return m, nil
}
