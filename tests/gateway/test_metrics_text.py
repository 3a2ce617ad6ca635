"""/metrics' text (gateway/metrics_text.py): what prometheus-client's generate_latest writes, byte for byte, without
building a Sample and a labels dict for every per-tenant series at every scrape (3,000 tenants: 138,000 of them,
1.6 s of CPU holding the GIL a render, the event loop waiting its turn for it meanwhile)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest
from prometheus_client import Gauge, Histogram, generate_latest
from prometheus_client import metrics as client_metrics

from gateway.metrics import GatewayMetrics
from quotas.ledger import LedgerRow

ODD_TENANTS = ("acme", 'quo"te', "back\\slash", "new\nline", "ünï-çødé", "")


def row(tenant: str, tier: str = "mid", status: str = "ok", **kw: Any) -> LedgerRow:
    fields: dict[str, Any] = dict(
        request_id="r", ts=0.0, tenant=tenant, key_id="k", tier=tier, model="m", status=status, http_status=200,
        input_tokens=12, output_tokens=3, price_usd=Decimal("0.0012"), compute_cost_usd=Decimal("0.0004"),
        cost_basis="wall", ttft_s=0.05, total_s=0.3, route_saving_usd=Decimal("0.0001"),
        cache_saving_usd=Decimal("0.0002"))
    return LedgerRow(**(fields | kw))


def filled(tenants: int, names: tuple[str, ...] = ()) -> GatewayMetrics:
    metrics = GatewayMetrics()
    for tenant in names + tuple(f"tenant-{i}" for i in range(tenants)):
        for tier in ("small", "mid"):
            metrics.finished(row(tenant, tier), 0.001)
            metrics.finished(row(tenant, tier, "error", ttft_s=None), None)
        metrics.child(metrics.cache, tenant, "hit").inc()
    return metrics


def test_the_text_is_generate_latests_byte_for_byte() -> None:
    metrics = filled(3, ODD_TENANTS)
    metrics.child(metrics.tokens, "big", "full", "output").inc(123_456_789)  # Go's exponent form from 1e6 up
    metrics.child(metrics.price, "big", "full").inc(1e-7)
    metrics.child(metrics.tokens, "zero", "full", "input")  # a child never incremented: 0.0
    metrics.refused("rate_limit")
    metrics.degrade_changed(type("Event", (), {"to_level": 2, "who": "auto"})())
    Gauge("tiergate_test_gauge", "A gauge, with a \\ and a\nnewline in its help.", ["tenant"],
          registry=metrics.registry).labels('a"b').set(float("inf"))
    Histogram("tiergate_test_hist", "Per tenant.", ["tenant"], registry=metrics.registry).labels("x").observe(2)
    for _ in range(2):  # the second from the labels kept by the first
        assert metrics.render() == generate_latest(metrics.registry)
    metrics.child(metrics.requests, "acme", "mid", "ok").inc(5)
    metrics.child(metrics.requests, "late", "mid", "ok").inc()
    assert metrics.render() == generate_latest(metrics.registry)
    metrics.child(metrics.price, "acme", "mid").reset()  # a new _created
    assert metrics.render() == generate_latest(metrics.registry)


def test_the_text_is_generate_latests_without_created_series_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(client_metrics, "_use_created", False)  # PROMETHEUS_DISABLE_CREATED_SERIES
    metrics = filled(2, ODD_TENANTS)
    assert b"_created" not in metrics.render()
    assert metrics.render() == generate_latest(metrics.registry)


def samples_built(metrics: GatewayMetrics, monkeypatch: pytest.MonkeyPatch) -> int:
    built = 0
    sample = client_metrics.Sample

    def counted(*args: Any, **kw: Any) -> Any:
        nonlocal built
        built += 1
        return sample(*args, **kw)

    monkeypatch.setattr(client_metrics, "Sample", counted)
    metrics.render()
    monkeypatch.setattr(client_metrics, "Sample", sample)
    return built


def test_a_render_builds_no_object_per_tenant_series(monkeypatch: pytest.MonkeyPatch) -> None:
    """generate_latest builds a Sample (and a labels dict) for each series, two per counter child (_total and
    _created): 46 a tenant here. The per-tenant counters are written from their children: what a render builds does
    not grow with the tenants (the histograms, per tier, still go through the library)."""
    few, many = filled(2), filled(200)
    assert samples_built(few, monkeypatch) == samples_built(many, monkeypatch)
    # and every series is there: a tenant's 15 children (6 a tier, 3 of its own), each with its _created
    assert many.render().count(b'tenant="tenant-199"') == 30


def test_the_render_lets_the_loop_in_between_collectors(monkeypatch: pytest.MonkeyPatch) -> None:
    """On its thread, the render lets go of the GIL (sleep(0)) after each collector, so the event loop's thread
    gets it at each collector's end, not only when the interpreter's switch interval runs out."""
    metrics = filled(3)
    pauses: list[float] = []
    monkeypatch.setattr("gateway.metrics_text.time.sleep", pauses.append)
    text = metrics.render()
    collectors = len(metrics.registry._collector_to_names)  # type: ignore[attr-defined]
    assert collectors > 20 and pauses == [0] * collectors
    assert text == generate_latest(metrics.registry)
