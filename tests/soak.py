"""Soak runs: concurrent clients drawing from the request mix (tests/soak_requests.py) against one
lmserve process, then the server must be idle again (queue places, batch rows and KV slots, from
/health) with its resident memory within 5% of its level after warm-up, and its count of requests
whose client left (/metrics `lmserve_client_closed_total`) consistent with what the clients cut.

Used by scripts/soak.py (long runs) and tests/test_soak.py (the short CI form, and SIGTERM).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import signal
import statistics
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
import psutil

from tests.server_util import Server
from tests.soak_requests import DIALECTS, FILLER, KINDS, STREAMED, Mix, Planned, check_semantics
from tests.wire_check import PATHS, check_body, check_error, check_no_traceback, check_stream

RESULTS = ("ok", "refused", "busy", "cut", "stopped", "FAIL")
RSS_TOLERANCE = 0.05
REQUEST_TIMEOUT = 180.0  # a queued request waits its turn; past this it counts as a hang
RSS_SAMPLE_SECONDS = 10.0
KINDS_CUT = (*STREAMED, "hangup")  # the behaviours whose client may leave before the reply ends
LONG_MARGIN = 24  # a long prompt leaves about this many tokens of the context for its reply
HANGUP_AFTER = (0.2, 3.0)  # seconds a hang-up client waits for its non-streaming reply
CLOSED_METRIC = re.compile(r'^lmserve_client_closed_total\{route="([^"]*)"\} (\d+)$', re.M)


@dataclass
class Outcome:
    dialect: str
    kind: str
    result: str  # one of RESULTS
    seconds: float
    tokens: int = 0
    detail: str = ""


@dataclass
class Report:
    outcomes: list[Outcome]
    seconds: float
    rss_warm: int
    health: dict | None = None  # /health once idle again (None after a SIGTERM)
    rss_end: int = 0
    rss_trace: list[int] = field(default_factory=list)  # sampled during the run: plateau or climb?
    exit_code: int | None = None  # after a SIGTERM (under load, or once idle: Soak.stop)
    sigterm_under_load: bool = False
    client_closed: dict[str, int] | None = None  # /metrics, counted during the run, by route
    problems: list[str] = field(default_factory=list)  # server-side findings

    def cuts(self, kinds: tuple[str, ...]) -> int:
        return sum(o.result == "cut" and o.kind in kinds for o in self.outcomes)

    @property
    def failures(self) -> list[str]:
        return self.problems + [f"{o.dialect}/{o.kind}: {o.detail}" for o in self.outcomes if o.result == "FAIL"]


class Soak:
    """Clients, warm-up and the server-side checks for one running server."""

    def __init__(self, server: Server, ctx: int, seed: int = 0) -> None:
        self.server = server
        self.ctx = ctx
        self.seed = seed
        self.stopping = threading.Event()  # set once the server is told to stop
        self.mix_repeats = self._calibrate()

    # -- setup -------------------------------------------------------------------------------

    def _calibrate(self) -> tuple[int, int]:
        """Filler repeats for a prompt a little under the context, and for one well over it."""
        def tokens(repeats: int) -> int:
            body = {"messages": [{"role": "user", "content": FILLER * repeats + "Summarize item 123456."}]}
            r = httpx.post(self.server.base_url + "/v1/messages/count_tokens", json=body, timeout=60)
            return r.json()["input_tokens"]

        base, per = tokens(0), tokens(10) - tokens(0)
        fit = int((self.ctx - LONG_MARGIN - base) * 10 / per)
        return max(1, fit), fit * 2 + 10

    def mix(self, salt: int) -> Mix:
        return Mix(random.Random(self.seed * 1000 + salt), self.ctx, self.mix_repeats)

    def health(self) -> dict:
        return httpx.get(self.server.base_url + "/health", timeout=30).json()

    def client_closed(self) -> dict[str, int]:
        """`lmserve_client_closed_total` by route, from /metrics (cumulative since the start)."""
        text = httpx.get(self.server.base_url + "/metrics", timeout=30).text
        return {route: int(n) for route, n in CLOSED_METRIC.findall(text)}

    def rss(self) -> int:
        return psutil.Process(self.server.process.pid).memory_info().rss

    def wait_idle(self, timeout: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            h = self.health()
            if (h["queue_depth"], h["active_sequences"], h["kv"]["in_use"]) == (0, 0, 0) or \
                    time.monotonic() > deadline:
                return h
            time.sleep(0.2)

    def warm_up(self) -> int:
        """The kinds that allocate lasting memory (tool-format detection, grammar compilers), then
        one long prompt per KV slot so that every slot has grown to its full allocation; returns
        the resident memory once idle: the baseline the end of the run is held to."""
        mix = self.mix(10**6)
        kinds = ["plain", "tools", "grammar"] + ["long"] * self.health()["kv"]["slots"]
        with httpx.Client(base_url=self.server.base_url, timeout=REQUEST_TIMEOUT) as http:
            failed = [o for o in (self.execute(http, mix.draw(k), mix.rng) for k in kinds) if o.result == "FAIL"]
        assert not failed, f"warm-up failed: {failed}"
        self.wait_idle()
        return self.rss()

    # -- clients -----------------------------------------------------------------------------

    def execute(self, http: httpx.Client, plan: Planned, rng: random.Random) -> Outcome:
        start = time.monotonic()
        answered = False
        try:
            if plan.kind == "hangup":
                # A non-streaming request on its own connection whose client gives up: the timeout
                # closes the socket and the server must cancel the request. A reply that comes in
                # time is judged like any other.
                patience = httpx.Timeout(rng.uniform(*HANGUP_AFTER), connect=REQUEST_TIMEOUT)
                try:
                    with httpx.Client(base_url=self.server.base_url, timeout=patience) as impatient:
                        r = impatient.post(PATHS[plan.dialect], json=plan.body)
                except httpx.ReadTimeout:
                    return Outcome(plan.dialect, plan.kind, "cut", time.monotonic() - start)
                answered = True
                raw = r.content
            else:
                with http.stream("POST", PATHS[plan.dialect], json=plan.body) as r:
                    answered = True
                    if r.status_code == 200 and plan.kind == "disconnect":
                        lines = r.iter_lines()
                        for _ in range(rng.randint(1, 6)):
                            next(lines, None)
                        return Outcome(plan.dialect, plan.kind, "cut", time.monotonic() - start)
                    chunks = r.iter_raw()
                    first = next(chunks, b"")
                    if plan.kind == "stalled":
                        time.sleep(rng.uniform(1.0, 4.0))
                    raw = first + b"".join(chunks)
            outcome = self._judge(plan, r.status_code, r.headers.get("content-type", ""), raw.decode())
        except Exception as exc:  # a malformed reply in any way
            # Once the server is stopping, a connection may be refused or dropped before an answer;
            # a reply that had begun must still end properly.
            refused = isinstance(exc, httpx.TransportError) and not answered
            result = "stopped" if refused and self.stopping.is_set() else "FAIL"
            outcome = Outcome(plan.dialect, plan.kind, result, 0, detail=f"{type(exc).__name__}: {exc}"[:400])
        outcome.seconds = time.monotonic() - start
        return outcome

    def _judge(self, plan: Planned, status: int, content_type: str, text: str) -> Outcome:
        check_no_traceback(text)
        path = PATHS[plan.dialect]

        def outcome(result: str, tokens: int = 0, detail: str = "") -> Outcome:
            return Outcome(plan.dialect, plan.kind, result, 0, tokens, detail)

        if status >= 400:
            message = check_error(path, status, json.loads(text))
            if status == 503 and self.stopping.is_set():
                return outcome("stopped", detail=message)
            if status in (429, 503):
                return outcome("busy")
            if plan.expect_status == 200 or status >= 500:
                return outcome("FAIL", detail=f"{status}: {message}")
            if plan.kind == "overflow":
                assert "context" in message, message
            return outcome("refused")
        if plan.expect_status != 200:
            return outcome("FAIL", detail=f"200 where a {plan.expect_status} was due")
        stream = content_type.startswith("text/event-stream")
        reply = check_stream(plan.dialect, text) if stream else check_body(plan.dialect, json.loads(text))
        if reply.error is not None:
            stopped = self.stopping.is_set() and "shutting down" in reply.error
            return outcome("stopped" if stopped else "FAIL", detail=f"in-band error: {reply.error}")
        check_semantics(plan, reply, self.ctx)
        return outcome("ok", reply.completion_tokens)

    def run(self, clients: int, seconds: float, rss_warm: int, sigterm_after: float | None = None,
            requests: int | None = None) -> Report:
        """`clients` draw from the mix for `seconds`, or `requests` draws each (the same work
        however fast the machine is), or until a SIGTERM `sigterm_after` seconds in; then the
        server must be idle with its memory near `rss_warm`, or have exited 0."""
        outcomes: list[Outcome] = []
        deadline = time.monotonic() + seconds

        def client(i: int) -> None:
            mix = self.mix(i)
            with httpx.Client(base_url=self.server.base_url, timeout=REQUEST_TIMEOUT) as http:
                for _ in itertools.count() if requests is None else range(requests):
                    if time.monotonic() >= deadline or self.stopping.is_set():
                        break
                    outcomes.append(self.execute(http, mix.draw(), mix.rng))

        trace: list[int] = []
        done = threading.Event()
        closed_before = self.client_closed() if sigterm_after is None else {}

        def sample_rss() -> None:
            while not done.wait(RSS_SAMPLE_SECONDS) and not self.stopping.is_set():
                trace.append(self.rss())

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
        started = time.monotonic()
        for t in [*threads, threading.Thread(target=sample_rss, daemon=True)]:
            t.start()
        if sigterm_after is not None:
            time.sleep(sigterm_after)
            self.stopping.set()
            self.server.process.send_signal(signal.SIGTERM)
        for t in threads:
            t.join()
        done.set()
        report = Report(outcomes, time.monotonic() - started, rss_warm, rss_trace=trace,
                        sigterm_under_load=sigterm_after is not None)
        if sigterm_after is not None:
            report.exit_code = self.server.process.wait(30)
            if report.exit_code != 0:
                report.problems.append(f"exit status {report.exit_code} after SIGTERM")
            return report
        report.health = self.wait_idle()
        report.rss_end = self.rss()
        time.sleep(0.5)  # a cancelled request's handler counts it just after giving its places back
        report.client_closed = {route: n - closed_before.get(route, 0) for route, n in self.client_closed().items()
                                if n > closed_before.get(route, 0)}
        report.problems += self._server_problems(report)
        return report

    def stop(self, report: Report) -> None:
        """SIGTERM to the idle server after a run: it must exit with status 0."""
        self.stopping.set()
        self.server.process.send_signal(signal.SIGTERM)
        report.exit_code = self.server.process.wait(30)
        if report.exit_code != 0:
            report.problems.append(f"exit status {report.exit_code} after SIGTERM once idle")

    @staticmethod
    def _server_problems(report: Report) -> list[str]:
        h = report.health or {}
        problems = []
        if (h["queue_depth"], h["active_sequences"], h["kv"]["in_use"]) != (0, 0, 0):
            problems.append(f"not idle after the run: queue_depth {h['queue_depth']}, active_sequences "
                            f"{h['active_sequences']}, kv.in_use {h['kv']['in_use']}")
        growth = report.rss_end / report.rss_warm - 1
        if growth > RSS_TOLERANCE:
            problems.append(f"resident memory grew {growth:+.1%} after warm-up (limit {RSS_TOLERANCE:.0%})")
        # Only a client that leaves makes a client_closed (stalled readers finish reading), so the
        # server cannot count more than the clients cut; hang-ups cut must show up there.
        closed, cuts, hangups = sum((report.client_closed or {}).values()), report.cuts(KINDS_CUT), \
            report.cuts(("hangup",))
        if closed > cuts:
            problems.append(f"/metrics counts {closed} client_closed requests, the clients cut only {cuts}")
        if hangups and not closed:
            problems.append(f"{hangups} non-streaming requests hung up on, none counted as client_closed")
        return problems


# -- reporting ---------------------------------------------------------------------------------

def mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def _row(label: str, kind: str, rows: list[Outcome]) -> str:
    counts = Counter(o.result for o in rows)
    times = sorted(o.seconds for o in rows)
    p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
    return (f"{label:<12} {kind:<11} {len(rows):>5} " + " ".join(f"{counts[r]:>7}" for r in RESULTS)
            + f" {statistics.median(times):>7.2f} {p99:>7.2f} {sum(o.tokens for o in rows):>7}")


def table(report: Report) -> str:
    """Requests by dialect and behaviour, then by dialect and by behaviour alone, each with counts
    by result, latency p50/p99 and tokens delivered; then the server's state after the run."""
    by_pair: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    by_dialect: dict[str, list[Outcome]] = defaultdict(list)
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for o in report.outcomes:
        by_pair[(o.dialect, o.kind)].append(o)
        by_dialect[o.dialect].append(o)
        by_kind[o.kind].append(o)
    head = f"{'dialect':<12} {'kind':<11} {'n':>5} " + " ".join(f"{r:>7}" for r in RESULTS) + \
        f" {'p50 s':>7} {'p99 s':>7} {'tokens':>7}"
    rule = "-" * len(head)
    lines = [head, rule]
    lines += [_row(d, k, by_pair[(d, k)]) for d in DIALECTS for k in KINDS if (d, k) in by_pair]
    lines.append(rule)
    lines += [_row(d, "(all)", by_dialect[d]) for d in DIALECTS if d in by_dialect]
    lines.append(rule)
    lines += [_row("(all)", k, by_kind[k]) for k in KINDS if k in by_kind]
    if report.outcomes:
        lines += [rule, _row("total", "", report.outcomes)]
    tokens = sum(o.tokens for o in report.outcomes)
    lines.append(f"\n{len(report.outcomes)} requests in {report.seconds:.0f} s; {tokens} tokens delivered "
                 f"({tokens / max(report.seconds, 1e-9):.1f} tok/s)")
    totals = Counter(o.result for o in report.outcomes)
    lines.append("by result: " + ", ".join(f"{r} {totals[r]}" for r in RESULTS))
    lines.append("by dialect: " + ", ".join(f"{d} {len(by_dialect[d])} ({sum(o.result == 'ok' for o in by_dialect[d])} ok)"
                                            for d in DIALECTS))
    if report.health is not None:
        h = report.health
        idle = (h["queue_depth"], h["active_sequences"], h["kv"]["in_use"]) == (0, 0, 0)
        lines.append(f"/health after the run: queue_depth {h['queue_depth']}, active_sequences "
                     f"{h['active_sequences']}, kv.in_use {h['kv']['in_use']} of {h['kv']['slots']} "
                     f"({'all 0' if idle else 'NOT IDLE'})")
        growth = report.rss_end / report.rss_warm - 1
        lines.append(f"RSS after warm-up {mib(report.rss_warm)}, at end {mib(report.rss_end)} "
                     f"({growth:+.2%}; limit +{RSS_TOLERANCE:.0%}: {'flat' if growth <= RSS_TOLERANCE else 'GREW'})")
        if report.rss_trace:
            trace = report.rss_trace
            points = [trace[min(len(trace) - 1, len(trace) * q // 4)] for q in range(5)]
            lines.append("RSS during the run, at 0/25/50/75/100%: " + ", ".join(mib(n) for n in points))
    if report.client_closed is not None:
        closed = report.client_closed
        routes = ", ".join(f"{route} {n}" for route, n in sorted(closed.items())) or "none"
        lines.append(f"client_closed (/metrics, during the run): {sum(closed.values())} ({routes}); the clients "
                     f"cut {report.cuts(('hangup',))} non-streaming hang-ups and {report.cuts(STREAMED)} streams")
    if report.exit_code is not None:
        when = "under load" if report.sigterm_under_load else "once idle"
        lines.append(f"exit status after SIGTERM {when}: {report.exit_code}")
    lines += [f"PROBLEM: {p}" for p in report.failures[:20]]
    return "\n".join(lines)
