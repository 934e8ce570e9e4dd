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

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

__all__ = ["LATENCY_BUCKETS", "MAX_LABEL_VALUES", "OTHER_LABEL", "PREFIX", "CoordinatorMetrics"]

PREFIX = "aiocoll_coordinator_"

# Store operations on loopback finish in tens of microseconds, while a waiting get or a
# rendezvous join may take seconds: roughly three buckets per decade from 10 us to 10 s.
LATENCY_BUCKETS: tuple[float, ...] = (
    0.00001, 0.000025, 0.00005,
    0.0001, 0.00025, 0.0005,
    0.001, 0.0025, 0.005,
    0.01, 0.025, 0.05,
    0.1, 0.25, 0.5,
    1.0, 2.5, 5.0,
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


class CoordinatorMetrics:
    """Counters, gauges and histograms of one coordinator, in a registry of its own.

    The asyncio shell calls the hooks as things happen; ``render()`` gives the Prometheus text
    exposition for ``/metrics``. All hooks are cheap (a dictionary lookup and an increment) so
    they can run on every operation.

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
        self._protocol_errors = Counter(
            PREFIX + "protocol_errors",
            "Connections closed because their bytes broke the protocol, by reason.",
            ["reason"],
            registry=reg,
        )
        self._operations = Counter(
            PREFIX + "operations",
            "Operations answered, by operation and outcome (ok or error).",
            ["op", "outcome"],
            registry=reg,
        )
        self._latency = Histogram(
            PREFIX + "operation_seconds",
            "Time from a request's arrival to its reply, by operation (waiting gets included).",
            ["op"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._jobs = Gauge(PREFIX + "jobs", "Jobs the coordinator currently holds.", registry=reg)
        self._members = Gauge(
            PREFIX + "members", "Rendezvous members currently registered, over all jobs.", registry=reg
        )
        self._op_labels = _BoundedLabels(max_label_values)
        self._reason_labels = _BoundedLabels(max_label_values)
        # Resolved label children, so the per-operation hook skips prometheus_client's label lookup.
        self._op_children: dict[tuple[str, bool], tuple[Counter, Histogram]] = {}

    # -- hooks -------------------------------------------------------------------------------
    def connection_opened(self) -> None:
        """A client connection was accepted."""
        self._connections.inc()
        self._connections_open.inc()

    def connection_closed(self) -> None:
        """A client connection ended, for whatever reason."""
        self._connections_open.dec()

    def auth_failure(self) -> None:
        """A handshake failed authentication (wrong or missing token)."""
        self._auth_failures.inc()

    def protocol_error(self, reason: str) -> None:
        """A connection was closed for breaking the protocol.

        Args:
            reason: a short, stable category (e.g. ``"bad_magic"``, ``"header_too_large"``);
                not the full error message, which belongs in the log.
        """
        self._protocol_errors.labels(reason=self._reason_labels.admit(reason)).inc()

    def observe_op(self, op: str, seconds: float, ok: bool) -> None:
        """One operation was answered.

        Args:
            op: the operation name from the request header.
            seconds: time from the request's arrival to its reply.
            ok: whether the reply was a success.
        """
        children = self._op_children.get((op, ok))
        if children is None:
            label = self._op_labels.admit(op)
            children = (
                self._operations.labels(op=label, outcome="ok" if ok else "error"),
                self._latency.labels(op=label),
            )
            if label != OTHER_LABEL:  # never cache unbounded made-up names
                self._op_children[(op, ok)] = children
        counter, histogram = children
        counter.inc()
        histogram.observe(max(0.0, seconds))

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
