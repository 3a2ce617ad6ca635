"""/metrics' text: what prometheus-client's `generate_latest` writes, without its cost on the per-tenant counters.

/metrics renders on a thread of its own (gateway/one_flight.py), but a render is pure Python and holds the GIL:
with 3,000 tenants (138,000 lines, 11.5 MB) `generate_latest` took 1.6-1.8 s of CPU, and 11 garbage collections
(gen 0-1) ran inside it, each holding the GIL throughout; the event loop, which has to win the GIL back after each
of its waits, waited behind it all that time. Nearly all of it is the per-tenant counters (tiergate_requests,
_tokens, _price_usd, ...: 23 children a tenant, each a `_total` and a `_created` line): for every series the
library builds a Sample and a labels dict, then sorts, validates and escapes each label at every scrape.

`MetricsText` writes those counters from their children: each child's labels are escaped and joined once, when
first seen, and kept with its `_created` value written (as many entries as the counters' children, none ever removed, as
`GatewayMetrics.child` keeps); a render formats one number a child and builds no object per series that the
garbage collector tracks: 0.17-0.19 s of CPU for the same text, no collection after the first render. Every
other collector (the histograms, which are per tier, and the collectors reading the gateway's state at scrape
time) goes through `generate_latest` itself, one collector at a time. The text is the same, byte for byte
(tests/gateway/test_metrics_text.py compares them). After each collector the thread lets go of the GIL
(`time.sleep(0)`), so a loop waiting for it gets it there rather than at the end of the switch interval.

The children are read as prometheus-client keeps them (`_metrics`, `_lock`, `_value`, `_created`, version 0.26);
a counter that does not look so (another version, a counter with no labels) goes through `generate_latest`.
`tiergate serve --workers N` renders the workers' summed families through prometheus-client
(gateway/worker_metrics.py), not through this.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client import metrics as client_metrics
from prometheus_client.openmetrics.exposition import escape_label_name, escape_metric_name
from prometheus_client.utils import floatToGoString


class MetricsText:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # id(counter) -> label values -> (`{a="x",b="y"} `, its creation time, that time as written)
        self._children: dict[int, dict[tuple[str, ...], tuple[str, float, str]]] = {}

    def render(self) -> bytes:
        chunks: list[bytes] = []
        for collector in self._collectors():
            if _readable(collector):
                chunks.append(self._counter(collector).encode())
            else:
                chunks.append(generate_latest(_One(collector)))  # type: ignore[arg-type]
            time.sleep(0)  # lets go of the GIL: the event loop's thread takes it now if it waits for it
        return b"".join(chunks)

    def _collectors(self) -> list[Any]:
        registry: Any = self.registry
        if getattr(registry, "_target_info", None):  # generate_latest writes it first; the gateway sets none
            return [_TargetInfo(registry), *self._registered()]
        return self._registered()

    def _registered(self) -> list[Any]:
        registry: Any = self.registry
        with registry._lock:
            return list(registry._collector_to_names)

    def _counter(self, counter: Any) -> str:
        total, created = escape_metric_name(counter._name + "_total"), escape_metric_name(counter._name + "_created")
        doc = counter._documentation.replace("\\", r"\\").replace("\n", r"\n")
        with counter._lock:
            children = counter._metrics.copy()
        known = self._children.setdefault(id(counter), {})
        names = [escape_label_name(n) for n in counter._labelnames]
        order = sorted(range(len(names)), key=lambda i: counter._labelnames[i])  # generate_latest sorts by name
        out = [f"# HELP {total} {doc}\n# TYPE {total} counter\n"]
        created_lines = []
        with_created = client_metrics._use_created
        for values, child in children.items():
            seen = known.get(values)
            if seen is None or (with_created and seen[1] != child._created):  # _created: set at birth (or a reset)
                labels = seen[0] if seen else "{" + ",".join(f'{names[i]}="{_escape(values[i])}"' for i in order) + "} "
                seen = known[values] = (labels, child._created, _number(child._created) if with_created else "")
            out.append(f"{total}{seen[0]}{_number(child._value.get())}\n")
            if with_created:
                created_lines.append(f"{created}{seen[0]}{seen[2]}\n")
        if created_lines:
            out.append(f"# HELP {created} {doc}\n# TYPE {created} gauge\n")
            out += created_lines
        return "".join(out)


def _readable(collector: Any) -> bool:
    """A counter with labels whose children this module can read (prometheus-client 0.26's layout)."""
    return (type(collector) is Counter and bool(collector._labelnames) and not collector._labelvalues
            and hasattr(collector, "_metrics") and hasattr(collector, "_lock"))


def _escape(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _number(value: float) -> str:
    # floatToGoString's answer for a float from 0 to 1e6 is its repr(); Go's exponents, inf, nan and an int (a reset
    # counter's 0) go through it
    return repr(value) if type(value) is float and 0.0 <= value < 1e6 else floatToGoString(value)


class _One:
    """One collector, as a registry `generate_latest` can write."""

    def __init__(self, collector: Any) -> None:
        self.collector = collector

    def collect(self) -> Iterable[Any]:
        return self.collector.collect()


class _TargetInfo:
    def __init__(self, registry: Any) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Any]:
        return [self.registry._target_info_metric()]
