"""The coordinator's Prometheus metrics: connections, jobs, members, operations with latency
histograms, authentication failures and protocol errors.

May import prometheus_client and the standard library only (no asyncio, no other aiocoll
layers): the asyncio shell calls these hooks and the HTTP server serves ``render()``. Each
``CoordinatorMetrics`` owns its own CollectorRegistry, so several coordinators in one process (an
embedded one next to a test's) never share or collide on counters. Label values that come from
the network (operation names, error reasons) are bounded, so a client sending made-up operations
cannot grow the metric set without limit.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

__all__ = ["LATENCY_BUCKETS", "MAX_LABEL_VALUES", "OTHER_LABEL", "PREFIX", "CoordinatorMetrics"]

PREFIX = "aiocoll_coordinator_"

# Store operations on loopback finish in tens of microseconds, while a waiting get or a
# rendezvous join may take seconds: roughly three buckets per decade from 10 us to 10 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00001,
    0.000025,
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)

# At most this many distinct values per network-derived label; later ones are counted as OTHER_LABEL.
MAX_LABEL_VALUES = 64
OTHER_LABEL = "other"
_MAX_LABEL_CHARS = 64


class _BoundedLabels:
    """Admits at most ``limit`` distinct label values; the rest map to OTHER_LABEL."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def admit(self, value: str) -> str:
        value = str(value)[:_MAX_LABEL_CHARS] or OTHER_LABEL
        if value in self._seen:
            return value
        if len(self._seen) >= self._limit:
            return OTHER_LABEL
        self._seen.add(value)
        return value


class _OpStats:
    """Plain counts for one operation label: updated on every answer without locks, read by
    ``_OpCollector`` only when /metrics is scraped (the coordinator runs on one thread)."""

    __slots__ = ("buckets", "created", "error_created", "errors", "ok", "ok_created", "total")

    def __init__(self) -> None:
        self.ok = 0
        self.errors = 0
        self.total = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS) + 1)  # per bucket, not cumulative; last: +Inf
        self.created = time.time()
        self.ok_created = 0.0
        self.error_created = 0.0


class _OpCollector(Collector):
    """Exposes ``operations_total`` and ``operation_seconds`` from the plain counts, with the
    names, labels and samples prometheus_client's Counter and Histogram would give them."""

    def __init__(self, stats: dict[str, _OpStats], fold: Callable[[], None]) -> None:
        self._stats = stats
        self._fold = fold  # brings the counts kept elsewhere into ``stats`` first
        self._bounds = [floatToGoString(b) for b in LATENCY_BUCKETS] + ["+Inf"]

    def describe(self) -> list[Metric]:
        return []  # known only at collect time: never checked against other collectors' names

    def collect(self) -> Iterator[Metric]:
        ops = CounterMetricFamily(
            PREFIX + "operations",
            "Operations answered, by operation and outcome (ok or error).",
            labels=["op", "outcome"],
        )
        latency = HistogramMetricFamily(
            PREFIX + "operation_seconds",
            "Time from a request's arrival to its reply, by operation (waiting gets included).",
            labels=["op"],
        )
        self._fold()
        for label, st in list(self._stats.items()):
            if st.ok:
                ops.add_metric([label, "ok"], st.ok, created=st.ok_created)
            if st.errors:
                ops.add_metric([label, "error"], st.errors, created=st.error_created)
            running, cumulative = 0, []
            for bound, count in zip(self._bounds, st.buckets, strict=True):
                running += count
                cumulative.append((bound, float(running)))
            latency.add_metric([label], cumulative, st.total)
            latency.samples.append(Sample(PREFIX + "operation_seconds_created", {"op": label}, st.created))
        yield ops
        yield latency


class CoordinatorMetrics:
    """Counters, gauges and histograms of one coordinator, in a registry of its own.

    The asyncio shell calls the hooks as things happen; ``render()`` gives the Prometheus text
    exposition for ``/metrics``. All hooks are cheap (a dictionary lookup and an increment) so
    they can run on every operation. Not thread-safe: call the hooks from the coordinator's loop
    (``render()`` may run there too; the HTTP endpoint does).

    Args:
        max_label_values: the most distinct operation names and protocol-error reasons kept as
            label values; further ones are counted under ``"other"``.
    """

    def __init__(self, *, max_label_values: int = MAX_LABEL_VALUES) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self._connections_open = Gauge(
            PREFIX + "connections_open", "Client connections currently open.", registry=reg
        )
        self._connections = Counter(
            PREFIX + "connections", "Client connections accepted since the coordinator started.", registry=reg
        )
        self._auth_failures = Counter(
            PREFIX + "auth_failures",
            "Connections refused because the peer did not prove it holds the token.",
            registry=reg,
        )
        self._abandoned = Counter(
            PREFIX + "handshakes_abandoned",
            "Connections closed by the client in the middle of their handshake, without a verdict, by "
            "the stage they reached (after_challenge: the client had the coordinator's proof).",
            ["stage"],
            registry=reg,
        )
        self._refused = Counter(
            PREFIX + "refused_connections",
            "Connections refused before their handshake because the coordinator could not take "
            "them, by reason (descriptors: no file descriptor to spare; handshakes_queued: as many "
            "connections as allowed are in their handshake, waiting for the coordinator).",
            ["reason"],
            registry=reg,
        )
        self._descriptors_open = Gauge(
            PREFIX + "descriptors_open", "File descriptors the coordinator holds (an estimate).", registry=reg
        )
        self._descriptor_limit = Gauge(
            PREFIX + "descriptor_limit", "The most file descriptors the coordinator may hold.", registry=reg
        )
        self._protocol_errors = Counter(
            PREFIX + "protocol_errors",
            "Connections closed because their bytes broke the protocol, by reason.",
            ["reason"],
            registry=reg,
        )
        # Operations are counted in plain ints per label (no locks, no label look-ups on the hot
        # path: prometheus_client's Counter.inc + Histogram.observe were an eighth of the
        # coordinator's busy time under store load) and exposed by a collector at scrape time.
        self._op_stats: dict[str, _OpStats] = {}
        reg.register(_OpCollector(self._op_stats, self.fold_at_once))
        # Store requests answered at once (no time spent), by operation name: counted by the
        # state machine into this dict as it answers them (CoordinatorState's ``at_once``) and
        # folded into the stats only when they are read, so the request path makes no call.
        self.at_once: dict[str, int] = {}
        self._jobs = Gauge(PREFIX + "jobs", "Jobs the coordinator currently holds.", registry=reg)
        self._members = Gauge(
            PREFIX + "members", "Rendezvous members currently registered, over all jobs.", registry=reg
        )
        self._op_labels = _BoundedLabels(max_label_values)
        self._reason_labels = _BoundedLabels(max_label_values)
        # Operation name -> its label's stats (made-up names share the OTHER_LABEL entry).
        self._op_by_name: dict[str, _OpStats] = {}

    # -- hooks -------------------------------------------------------------------------------
    def connection_opened(self) -> None:
        """A client connection was accepted."""
        self._connections.inc()
        self._connections_open.inc()

    def connection_closed(self) -> None:
        """A client connection ended, for whatever reason."""
        self._connections_open.dec()

    def refused(self, reason: str) -> None:
        """A connection was refused before its handshake (``reason``: e.g. ``"descriptors"``)."""
        self._refused.labels(reason=reason).inc()

    def set_descriptors(self, open_now: int, limit: int) -> None:
        """How many file descriptors are held, and the most that may be."""
        self._descriptors_open.set(open_now)
        self._descriptor_limit.set(limit)

    def auth_failure(self) -> None:
        """A handshake failed authentication (wrong or missing token)."""
        self._auth_failures.inc()

    def handshake_abandoned(self, stage: str) -> None:
        """A client closed its connection in the middle of its handshake (``stage``)."""
        self._abandoned.labels(stage).inc()

    def protocol_error(self, reason: str) -> None:
        """A connection was closed for breaking the protocol.

        Args:
            reason: a short, stable category (e.g. ``"bad_magic"``, ``"header_too_large"``);
                not the full error message, which belongs in the log.
        """
        self._protocol_errors.labels(reason=self._reason_labels.admit(reason)).inc()

    def _stats_of(self, op: str) -> _OpStats:
        st = self._op_by_name.get(op)
        if st is None:
            label = self._op_labels.admit(op)
            st = self._op_stats.get(label)
            if st is None:
                st = self._op_stats[label] = _OpStats()
            if label != OTHER_LABEL:  # never cache unbounded made-up names
                self._op_by_name[op] = st
        return st

    def observe_op(self, op: str, seconds: float, ok: bool) -> None:
        """One operation was answered.

        Args:
            op: the operation name from the request header.
            seconds: time from the request's arrival to its reply.
            ok: whether the reply was a success.
        """
        st = self._stats_of(op)
        if ok:
            if not st.ok:
                st.ok_created = time.time()
            st.ok += 1
        else:
            if not st.errors:
                st.error_created = time.time()
            st.errors += 1
        if seconds > 0.0:
            st.total += seconds
            st.buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        else:
            st.buckets[0] += 1

    def fold_at_once(self) -> None:
        """Count the operations answered at once (``at_once``) in their stats, and start over."""
        at_once = self.at_once
        for op, count in list(at_once.items()):
            st = self._stats_of(op)
            if not st.ok:
                st.ok_created = time.time()
            st.ok += count
            st.buckets[0] += count
        at_once.clear()

    def set_jobs(self, n: int) -> None:
        """The number of jobs held now."""
        self._jobs.set(n)

    def set_members(self, n: int) -> None:
        """The number of rendezvous members registered now, over all jobs."""
        self._members.set(n)

    # -- exposition --------------------------------------------------------------------------
    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition of every metric.

        Returns:
            (body, content type) ready for an HTTP 200 reply.
        """
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
