"""One scrape of a server's /metrics, parsed with prometheus_client's text parser into a `Snapshot`.

Names are kept without their prefix: pagedllm exports every metric as `pagedllm:X` and again as `vllm:X`;
the first is read when present, else the second, so `pagedllm top` also reads a vLLM server.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

PREFIXES = ("pagedllm:", "vllm:")


class ScrapeError(RuntimeError):
    """The server could not be read, or what it sent is not Prometheus text."""


@dataclass
class Histogram:
    """Cumulative bucket counts by upper bound (the last one +Inf), the sum and the count of observations."""

    buckets: list[tuple[float, float]] = field(default_factory=list)
    sum: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations made since `earlier` (the same histogram, scraped before)."""
        if earlier is None or len(earlier.buckets) != len(self.buckets):
            return self
        buckets = [(le, n - m) for (le, n), (_, m) in zip(self.buckets, earlier.buckets)]
        return Histogram(buckets, self.sum - earlier.sum, self.count - earlier.count)

    @property
    def mean(self) -> float | None:
        return self.sum / self.count if self.count else None

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear inside the bucket holding the q-th observation; a rank in the
        +Inf bucket answers the largest finite bound."""
        if not self.count or not self.buckets:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le, cumulative in self.buckets:
            if cumulative >= rank:
                if le == float("inf"):
                    return lower_bound
                in_bucket = cumulative - lower_count
                fraction = (rank - lower_count) / in_bucket if in_bucket else 1.0
                return lower_bound + (le - lower_bound) * fraction
            lower_bound, lower_count = le, cumulative
        return lower_bound


@dataclass
class Snapshot:
    time: float  # time.monotonic() of the scrape
    # Gauges and counters: name -> the sum over label sets (one model per server); labelled samples kept too.
    values: dict[str, float] = field(default_factory=dict)
    labelled: dict[str, list[tuple[dict[str, str], float]]] = field(default_factory=dict)
    histograms: dict[str, Histogram] = field(default_factory=dict)
    prefix: str = PREFIXES[0]

    def value(self, name: str, default: float = 0.0) -> float:
        return self.values.get(name, default)


def fetch(url: str, timeout: float) -> str:
    target = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout) as response:
            return str(response.read().decode("utf-8", errors="replace"))
    except urllib.error.HTTPError as exc:
        raise ScrapeError(f"{target} answered {exc.code} {exc.reason}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ScrapeError(f"cannot reach {target}: {reason}") from None


def scrape(url: str, timeout: float = 5.0) -> Snapshot:
    return parse(fetch(url, timeout))


def parse(text: str) -> Snapshot:
    try:
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as exc:
        raise ScrapeError('pagedllm top needs prometheus-client: pip install "pagedllm[server]"') from exc
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise ScrapeError(f"the /metrics answer is not Prometheus text: {exc}") from None
    names = {f.name for f in families}
    prefix = next((p for p in PREFIXES if any(n.startswith(p) for n in names)), None)
    if prefix is None:
        raise ScrapeError("the /metrics answer has no pagedllm: or vllm: metrics: is this an LLM server?")
    snap = Snapshot(time.monotonic(), prefix=prefix)
    for family in families:
        if not family.name.startswith(prefix):
            continue
        name = family.name[len(prefix):]
        if family.type == "histogram":
            _add_histogram(snap.histograms.setdefault(name, Histogram()), family.samples)
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            snap.values[name] = snap.values.get(name, 0.0) + sample.value
            snap.labelled.setdefault(name, []).append((dict(sample.labels), sample.value))
    return snap


def _add_histogram(h: Histogram, samples: Iterable[Any]) -> None:
    by_bound: dict[float, float] = {}
    for s in samples:
        if s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            by_bound[le] = by_bound.get(le, 0.0) + s.value
        elif s.name.endswith("_sum"):
            h.sum += s.value
        elif s.name.endswith("_count"):
            h.count += s.value
    h.buckets = sorted(by_bound.items())
