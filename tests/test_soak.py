"""The soak's short CI form (scripts/soak.py runs the long one): a few clients mixing every dialect
and behaviour against SmolLM2, then the server idle with its memory where warm-up left it; then
SIGTERM under the same load: every open stream ends properly and the process exits 0.

The short run is a fixed amount of work, not a time: each client makes REQUESTS draws from its
seeded mix, however slow the machine (a suite beside it, a busy CI runner), so what it must have
covered (an ok reply in every dialect, a hang-up, a cut stream, a client_closed on /metrics) does
not depend on the wall clock. On an idle 2-core machine 3 clients made 67 to 69 requests in 30 s.
"""

from __future__ import annotations

import pytest

from tests.server_util import start_server
from tests.soak import Soak, table
from tests.soak_requests import DIALECTS, STREAMED

CTX = 512
REQUESTS = 12  # per client
TIMEOUT = 900.0  # seconds: only a stalled server comes near it


@pytest.fixture(scope="module")
def soak():
    with start_server("--engine", "cpu", "--ctx", str(CTX), "--batch", "2", "--kv-slots", "2") as server:
        yield Soak(server, CTX, seed=1)


def test_short_soak_leaves_the_server_idle_without_growth(soak):
    report = soak.run(clients=3, seconds=TIMEOUT, rss_warm=soak.warm_up(), requests=REQUESTS)
    print(table(report))
    assert not report.failures, table(report)
    ok = [o for o in report.outcomes if o.result == "ok"]
    assert len(report.outcomes) == 3 * REQUESTS, table(report)
    assert {o.dialect for o in ok} == set(DIALECTS), table(report)
    assert report.cuts(("hangup",)) >= 1 and report.cuts(STREAMED) >= 1, table(report)
    assert sum(report.client_closed.values()) >= 1, table(report)


def test_sigterm_under_soak_ends_every_stream_and_exits_zero(soak):
    report = soak.run(clients=3, seconds=300, rss_warm=0, sigterm_after=6)
    print(table(report))
    assert report.exit_code == 0 and not report.failures, table(report)
    assert any(o.result == "stopped" and "shutting down" in o.detail for o in report.outcomes), table(report)
