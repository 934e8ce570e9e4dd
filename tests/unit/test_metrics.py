"""The coordinator's Prometheus metrics, read back through prometheus_client's own text parser."""

from __future__ import annotations

import pytest
from aiocoll.server._metrics import LATENCY_BUCKETS, OTHER_LABEL, CoordinatorMetrics
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.timeout(30)


def _samples(metrics: CoordinatorMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode("utf-8")):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _value(metrics: CoordinatorMetrics, name: str, **labels: str) -> float:
    return _samples(metrics)[("aiocoll_coordinator_" + name, tuple(sorted(labels.items())))]


def test_connections_count_opened_and_currently_open() -> None:
    m = CoordinatorMetrics()
    for _ in range(3):
        m.connection_opened()
    m.connection_closed()
    assert _value(m, "connections_total") == 3
    assert _value(m, "connections_open") == 2


def test_auth_failures_and_protocol_errors_by_reason() -> None:
    m = CoordinatorMetrics()
    m.auth_failure()
    m.auth_failure()
    m.protocol_error("bad_magic")
    m.protocol_error("header_too_large")
    m.protocol_error("bad_magic")
    assert _value(m, "auth_failures_total") == 2
    assert _value(m, "protocol_errors_total", reason="bad_magic") == 2
    assert _value(m, "protocol_errors_total", reason="header_too_large") == 1


def test_operations_counted_by_op_and_outcome_with_latency_histogram() -> None:
    m = CoordinatorMetrics()
    m.observe_op("set", 0.00002, True)
    m.observe_op("set", 0.003, True)
    m.observe_op("get", 2.0, False)
    assert _value(m, "operations_total", op="set", outcome="ok") == 2
    assert _value(m, "operations_total", op="get", outcome="error") == 1
    assert _value(m, "operation_seconds_count", op="set") == 2
    assert _value(m, "operation_seconds_sum", op="set") == pytest.approx(0.00302)
    # Cumulative buckets: 20 us lands at le=2.5e-05, 3 ms at le=0.005.
    assert _value(m, "operation_seconds_bucket", op="set", le="1e-05") == 0
    assert _value(m, "operation_seconds_bucket", op="set", le="2.5e-05") == 1
    assert _value(m, "operation_seconds_bucket", op="set", le="0.0025") == 1
    assert _value(m, "operation_seconds_bucket", op="set", le="0.005") == 2
    assert _value(m, "operation_seconds_bucket", op="get", le="1.0") == 0
    assert _value(m, "operation_seconds_bucket", op="get", le="2.5") == 1
    assert _value(m, "operation_seconds_bucket", op="get", le="+Inf") == 1


def test_latency_buckets_span_ten_microseconds_to_ten_seconds() -> None:
    assert LATENCY_BUCKETS[0] == pytest.approx(1e-5)
    assert LATENCY_BUCKETS[-1] == pytest.approx(10.0)
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))
    m = CoordinatorMetrics()
    m.observe_op("nkeys", 0.0, True)
    buckets = [k for k in _samples(m) if k[0] == "aiocoll_coordinator_operation_seconds_bucket"]
    assert len(buckets) == len(LATENCY_BUCKETS) + 1  # plus +Inf


def test_jobs_and_members_gauges_follow_the_last_value_set() -> None:
    m = CoordinatorMetrics()
    m.set_jobs(4)
    m.set_members(12)
    m.set_jobs(3)
    assert _value(m, "jobs") == 3
    assert _value(m, "members") == 12


def test_made_up_operation_names_are_bounded_as_other() -> None:
    m = CoordinatorMetrics(max_label_values=2)
    m.observe_op("set", 0.001, True)
    m.observe_op("get", 0.001, True)
    for i in range(100):
        m.observe_op(f"bogus{i}", 0.001, False)
    ops = {dict(k[1]).get("op") for k in _samples(m) if k[0] == "aiocoll_coordinator_operations_total"}
    assert ops == {"set", "get", OTHER_LABEL}
    assert _value(m, "operations_total", op=OTHER_LABEL, outcome="error") == 100


def test_protocol_error_reasons_are_bounded_and_truncated() -> None:
    m = CoordinatorMetrics(max_label_values=1)
    m.protocol_error("x" * 500)
    m.protocol_error("another")
    name = "aiocoll_coordinator_protocol_errors_total"
    reasons = {dict(k[1])["reason"] for k in _samples(m) if k[0] == name}
    assert reasons == {"x" * 64, OTHER_LABEL}


def test_each_instance_has_its_own_registry() -> None:
    a, b = CoordinatorMetrics(), CoordinatorMetrics()
    a.auth_failure()
    assert _value(a, "auth_failures_total") == 1
    assert _value(b, "auth_failures_total") == 0


def test_every_metric_name_has_the_coordinator_prefix_and_help() -> None:
    m = CoordinatorMetrics()
    m.observe_op("set", 0.001, True)
    m.protocol_error("bad_magic")
    body, _ = m.render()
    families = list(text_string_to_metric_families(body.decode()))
    assert {f.name for f in families} >= {
        "aiocoll_coordinator_connections_open",
        "aiocoll_coordinator_connections",
        "aiocoll_coordinator_auth_failures",
        "aiocoll_coordinator_protocol_errors",
        "aiocoll_coordinator_operations",
        "aiocoll_coordinator_operation_seconds",
        "aiocoll_coordinator_jobs",
        "aiocoll_coordinator_members",
    }
    for family in families:
        assert family.name.startswith("aiocoll_coordinator_")
        assert family.documentation
