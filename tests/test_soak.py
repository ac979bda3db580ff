"""The soak's short CI form (scripts/soak.py runs the long one): a few clients mixing every dialect
and behaviour against SmolLM2, then the server idle with its memory where warm-up left it; then
SIGTERM under the same load: every open stream ends properly and the process exits 0."""

from __future__ import annotations

import os

import pytest

from tests.server_util import start_server
from tests.soak import Soak, table

SECONDS = float(os.environ.get("LMSERVE_SOAK_SECONDS", "30"))
CTX = 512


@pytest.fixture(scope="module")
def soak():
    with start_server("--engine", "cpu", "--ctx", str(CTX), "--batch", "2", "--kv-slots", "2") as server:
        yield Soak(server, CTX, seed=1)


def test_short_soak_leaves_the_server_idle_without_growth(soak):
    report = soak.run(clients=3, seconds=SECONDS, rss_warm=soak.warm_up())
    print(table(report))
    assert not report.failures, table(report)
    assert sum(o.result == "ok" for o in report.outcomes) >= 3, table(report)


def test_sigterm_under_soak_ends_every_stream_and_exits_zero(soak):
    report = soak.run(clients=3, seconds=300, rss_warm=0, sigterm_after=6)
    print(table(report))
    assert report.exit_code == 0 and not report.failures, table(report)
    assert any(o.result == "stopped" and "shutting down" in o.detail for o in report.outcomes), table(report)
