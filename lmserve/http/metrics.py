"""Prometheus metrics in the text exposition format, without a client library.

A handful of counters, gauges read at scrape time, and two latency histograms are a few dozen
lines; the format is stable and `prometheus_client`'s parser reads it (the tests check that).
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += value

    def render(self, name: str) -> list[str]:
        lines = [f'{name}_bucket{{le="{bound}"}} {n}' for bound, n in zip(self.buckets, self.counts, strict=True)]
        return lines + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}",
                        f"{name}_count {self.count}"]


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """Server-wide counters; `gauges` are callables read at every scrape."""

    def __init__(self, gauges: dict[str, tuple[str, Callable[[], float]]]) -> None:
        self._lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = defaultdict(int)
        self.client_closed: dict[str, int] = defaultdict(int)
        self.tokens = {"prompt": 0, "completion": 0, "cached": 0, "draft": 0, "draft_accepted": 0}
        self.ttft = Histogram()
        self.inter_token = Histogram()
        self.gauges = gauges

    def count_request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def count_client_closed(self, route: str) -> None:
        with self._lock:
            self.client_closed[route] += 1

    def count_tokens(self, prompt: int, completion: int, cached: int) -> None:
        with self._lock:
            self.tokens["prompt"] += prompt
            self.tokens["completion"] += completion
            self.tokens["cached"] += cached

    def count_drafts(self, drafted: int, accepted: int) -> None:
        with self._lock:
            self.tokens["draft"] += drafted
            self.tokens["draft_accepted"] += accepted

    def render(self) -> str:
        with self._lock:
            out = ["# HELP lmserve_requests_total HTTP requests by route and status.",
                   "# TYPE lmserve_requests_total counter"]
            out += [f'lmserve_requests_total{{route="{_label(route)}",status="{status}"}} {n}'
                    for (route, status), n in sorted(self.requests.items())]
            out += ["# HELP lmserve_client_closed_total Requests whose client left before the reply was complete.",
                    "# TYPE lmserve_client_closed_total counter"]
            out += [f'lmserve_client_closed_total{{route="{_label(route)}"}} {n}'
                    for route, n in sorted(self.client_closed.items())]
            for kind, help_text in (("prompt", "Prompt tokens of requests that finished."),
                                    ("completion", "Tokens of replies that finished (not of those whose client left)."),
                                    ("cached", "Prompt tokens served from the KV cache."),
                                    ("draft", "Speculative draft tokens verified, in replies that finished."),
                                    ("draft_accepted", "Of those draft tokens, the ones the model accepted.")):
                name = f"lmserve_{kind}_tokens_total"
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} counter", f"{name} {self.tokens[kind]}"]
            for name, (help_text, read) in self.gauges.items():
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} gauge", f"{name} {read()}"]
            for name, hist, help_text in (
                ("lmserve_time_to_first_token_seconds", self.ttft, "Request arrival to the first output: text, reasoning or a tool call."),
                ("lmserve_inter_token_latency_seconds", self.inter_token, "Gap between streamed text pieces."),
            ):
                out += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *hist.render(name)]
        return "\n".join(out) + "\n"
