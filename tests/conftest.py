"""Shared test fixtures: paths to the test data in tests/data and the embedded SmolLM2 model."""

from __future__ import annotations

import json
import os
import tempfile

# Servers started by the tests share two cores with pytest itself and with each other; a
# two-thread BLAS collapses under that contention (measured: decode 36 -> 1-4 tok/s), one thread
# does not. Set before NumPy loads; production keeps the BLAS default, and so do scripts/ benches.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
# The goldens are an f32 reference's: engines and servers multiply in float32 unless a test asks
# for int8 activations (--cpu-dots int8, the default on AVX-512 VNNI and AVX2 CPUs; see int8_dots below).
os.environ["LMSERVE_CPU_DOTS"] = "float32"
# A developer's own ~/.config/lmserve/config.toml must not reach the servers the suite starts.
os.environ["XDG_CONFIG_HOME"] = tempfile.mkdtemp(prefix="lmserve-test-config-")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from lmserve.model.default_model import default_model_path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"  # the one place test data lives; see tests/data/README.md
GOLDENS = DATA / "goldens" / "smollm2"
TINY_LLAMA = DATA / "fixtures" / "tiny-llama"
TEMPLATES = DATA / "templates"
CLIENTS = DATA / "clients"
SPECS = DATA / "specs"


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="session")
def chat_goldens() -> list[dict]:
    return read_jsonl(GOLDENS / "chat.jsonl")


@pytest.fixture(scope="session")
def tokenizer_goldens() -> list[dict]:
    return read_jsonl(GOLDENS / "tokenizer.jsonl")


@pytest.fixture(scope="session")
def smollm2_server():
    """One SmolLM2 server on the NumPy engine shared by the end-to-end tests."""
    from tests.server_util import start_server

    with start_server("--engine", "cpu", "--batch", "4") as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_long_context():
    """SmolLM2 with room for Codex's instructions and tools (about 9,100 of its tokens), greedy for
    requests that send no temperature (neither client does; the embedded model's default, and
    `--temp 0` here says so explicitly): sampled at its card's 0.2, SmolLM2 sometimes loops until
    Claude Code's 64,000-token budget runs out. 16,384 tokens is above its trained 8,192 (the
    server warns); the smoke runs need the room, not answers past 8,192. Shared by the agent-client
    smoke runs and the Codex capture replay: Codex's instructions and tools, prefilled once (a
    minute and a half here), are a KV prefix the later requests adopt."""
    from tests.server_util import start_server

    with start_server("--engine", "cpu", "--ctx", "16384", "--temp", "0") as server:
        yield server



@pytest.fixture(scope="session")
def qwen3(tmp_path_factory: pytest.TempPathFactory):
    """The tokenizer of a tiny Qwen3-shaped fixture (tests/fixture_models.py)."""
    from lmserve.model.gguf_file import GGUFFile
    from lmserve.model.tokenizer import Tokenizer
    from tests.fixture_models import write_model

    return Tokenizer.from_gguf(GGUFFile(write_model(tmp_path_factory.mktemp("q3") / "q3.gguf", "qwen3")))


@pytest.fixture(scope="session")
def planner(qwen3):
    """A reply planner over that tokenizer and the real Qwen3 chat template."""
    from lmserve.chat.planner import ReplyPlanner
    from lmserve.model.chat_template import ChatTemplate

    return ReplyPlanner(qwen3, ChatTemplate((TEMPLATES / "qwen3.jinja").read_text()))


@pytest.fixture
def int8_dots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NumPy engine's products with int8 activations, where this CPU has them, on the VNNI (or
    AVX2) kernels (whose rows have their one-row bits at any count): the AMX tiles' tests turn those on
    themselves (tests/test_amx_kernels.py)."""
    from lmserve.engine_cpu import amx_kernels, int8_kernels

    if not int8_kernels.available():
        pytest.skip("int8 activations need AVX-512 VNNI or AVX2")
    monkeypatch.setattr(int8_kernels, "ENABLED", True)
    monkeypatch.setenv(amx_kernels.ENV, "off")


@pytest.fixture(params=["float32", "int8"])
def cpu_dots(request: pytest.FixtureRequest) -> str:
    """A test once with each of the NumPy engine's products: float32, then int8 activations."""
    if request.param == "int8":
        request.getfixturevalue("int8_dots")
    return request.param


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under `-n` (pytest-xdist, --dist loadgroup) a module's tests stay on one worker, so its
    module fixtures (servers, loaded engines) start once; tests that share the long-context server
    across modules name one group of their own."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
