"""Startup failures exit non-zero with one clear line and no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmserve.cli", *args, "--port", "0"],
                          capture_output=True, text=True, timeout=60)


def assert_one_line_failure(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_model_file(tmp_path: Path):
    assert_one_line_failure(run_cli(str(tmp_path / "nope.gguf")), "not found", "nope.gguf")


def test_file_that_is_not_gguf(tmp_path: Path):
    path = tmp_path / "weights.gguf"
    path.write_bytes(b"PK\x03\x04 definitely a zip file")
    assert_one_line_failure(run_cli(str(path)), "not a GGUF file")


def test_unsupported_architecture_names_it_and_the_supported_list(tmp_path: Path):
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_one_line_failure(run_cli(str(path)), "unsupported architecture 'gpt2'", "llama, qwen2, qwen3")


def test_version_flag():
    result = run_cli("--version")
    assert result.returncode == 0 and result.stdout.startswith("lmserve ")


def test_flag_ranges_are_checked_before_the_model_is_looked_for(tmp_path: Path):
    """A bad value is named even when the model does not exist: nothing was resolved or loaded."""
    missing = str(tmp_path / "nope.gguf")
    assert_one_line_failure(run_cli(missing, "--reasoning-budget", "-2"), "--reasoning-budget")
    assert_one_line_failure(run_cli(missing, "--kv-checkpoints", "0"), "--kv-checkpoints")
