"""The soak's short CI form (scripts/soak.py runs the long one): a few clients mixing every dialect
and behaviour against SmolLM2, then the server idle with its memory where warm-up left it; then
SIGTERM under the same load: every open stream ends properly and the process exits 0.

The short run must also have done real work. On a 2-core machine with OPENBLAS_NUM_THREADS=1 (a
test suite running beside it in two of three runs), 30 s with 3 clients finished 67 to 69
requests: 36 to 38 ok (7 to 12 per dialect), 21 or 22 cut (8 or 9 hang-ups, 13 streams), and
/metrics counted as many client_closed. The floors below sit at about a third of that, so a slow
runner passes and a server that stalls, refuses or stops cancelling does not.
"""

from __future__ import annotations

import os

import pytest

from tests.server_util import start_server
from tests.soak import Soak, table
from tests.soak_requests import DIALECTS, STREAMED

SECONDS = float(os.environ.get("LMSERVE_SOAK_SECONDS", "30"))
CTX = 512
MIN_REQUESTS = 24  # finished in the 30 s run, whatever their result
MIN_OK = 12  # and at least one ok per dialect, one hang-up and one stream cut, one client_closed


@pytest.fixture(scope="module")
def soak():
    with start_server("--engine", "cpu", "--ctx", str(CTX), "--batch", "2", "--kv-slots", "2") as server:
        yield Soak(server, CTX, seed=1)


def test_short_soak_leaves_the_server_idle_without_growth(soak):
    report = soak.run(clients=3, seconds=SECONDS, rss_warm=soak.warm_up())
    print(table(report))
    assert not report.failures, table(report)
    scale = min(1.0, SECONDS / 30)  # LMSERVE_SOAK_SECONDS may shorten the run
    ok = [o for o in report.outcomes if o.result == "ok"]
    assert len(report.outcomes) >= MIN_REQUESTS * scale and len(ok) >= MIN_OK * scale, table(report)
    assert {o.dialect for o in ok} == set(DIALECTS), table(report)
    assert report.cuts(("hangup",)) >= 1 and report.cuts(STREAMED) >= 1, table(report)
    assert sum(report.client_closed.values()) >= 1, table(report)


def test_sigterm_under_soak_ends_every_stream_and_exits_zero(soak):
    report = soak.run(clients=3, seconds=300, rss_warm=0, sigterm_after=6)
    print(table(report))
    assert report.exit_code == 0 and not report.failures, table(report)
    assert any(o.result == "stopped" and "shutting down" in o.detail for o in report.outcomes), table(report)
