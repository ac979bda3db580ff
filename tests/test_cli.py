"""Startup failures exit non-zero with one clear line and no traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest


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


def test_help_prints_every_flag():
    """`--help` prints the usage and each flag's text, a percent sign in one included."""
    result = run_cli("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: lmserve-mac")
    text = " ".join(result.stdout.split())  # argparse wraps the texts
    assert "--cpu-dots" in text and "within about 1% of" in text


def test_flag_ranges_are_checked_before_the_model_is_looked_for(tmp_path: Path):
    """A bad value is named even when the model does not exist: nothing was resolved or loaded."""
    missing = str(tmp_path / "nope.gguf")
    assert_one_line_failure(run_cli(missing, "--reasoning-budget", "-2"), "--reasoning-budget")
    assert_one_line_failure(run_cli(missing, "--kv-checkpoints", "0"), "--kv-checkpoints")


BAD_VALUES = {  # flag -> values it refuses, and a word the one line must carry
    "--port": (["70000", "-1", "x"], "65535"), "--ctx": (["8", "99999999", "1.5"], "--ctx"),
    "--queue": (["0", "-3"], "at least 1"), "--conns": (["0"], "at least 1"), "--batch": (["0", "1000"], "--batch"),
    "--kv-slots": (["0", "-1"], "at least 1"), "--max-body": (["0", "100"], "at least 1024"),
    "--max-tokens": (["0"], "at least 1"), "--prefill-chunk": (["-1"], "at least 0"),
    "--sse-keepalive": (["0", "-2", "nan", "inf", "x"], "--sse-keepalive"), "--temp": (["-1", "2.5"], "from 0 to 2"),
    "--reasoning-budget": (["-2"], "at least -1"), "--kv-checkpoints": (["0"], "--kv-checkpoints"),
    "--kv-disk-slots": (["0"], "at least 1"), "--engine": (["gpu"], "invalid choice"),
    "--distributed": (["ring"], "invalid choice"), "--speculate": (["eagle"], "invalid choice"),
    "--draft": (["/no/such.gguf"], "no such file"), "--chat-template": (["/no/such.jinja"], "no such file"),
    "--host": ([""], "must not be empty"), "--kv-type": (["q5_k", "fp8"], "invalid choice"),
    "--cpu-dots": (["int4", "vnni"], "invalid choice"),
}


def test_every_flag_refuses_bad_values_in_one_line_with_status_2(tmp_path: Path, monkeypatch, capsys) -> None:
    """Each bad value: exit status 2, one line naming the flag, no traceback, nothing loaded
    (the model named does not exist, so only the settings check can have answered)."""
    from lmserve.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    missing = str(tmp_path / "nope.gguf")
    for flag, (values, needle) in BAD_VALUES.items():
        for value in values:
            with pytest.raises(SystemExit) as exc:
                main([missing, f"{flag}={value}"])
            err = capsys.readouterr().err
            lines = err.splitlines()
            assert exc.value.code == 2 and len(lines) == 1, (flag, value, err)
            assert flag in lines[0] and needle in lines[0] and "Traceback" not in err, (flag, value, err)


def test_settings_that_contradict_each_other(tmp_path: Path, monkeypatch, capsys) -> None:
    from lmserve.cli import main

    monkeypatch.setenv("HOME", str(tmp_path))
    missing = str(tmp_path / "nope.gguf")
    for argv, needle in ((["--kv-slots", "2", "--batch", "4"], "--kv-slots 2 must be at least --batch 4"),
                         (["--ctx", "32768", "--max-body", "4096"], "--max-body 4096 cannot hold"),
                         (["--distributed", "--engine", "cpu"], "MLX engine"),
                         (["--speculate", "draft"], "go together")):
        with pytest.raises(SystemExit) as exc:
            main([missing, *argv])
        assert exc.value.code == 2 and needle in capsys.readouterr().err, argv


def test_a_bad_config_value_names_the_key_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("port = 70000\n")
    for extra in ([], ["--print-config"]):  # --print-config checks what it prints
        result = subprocess.run([sys.executable, "-m", "lmserve.cli", "--config", str(path), *extra],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and not result.stdout
        assert_one_line_failure(result, "'port' in config file", str(path), "65535")


def test_print_config_names_the_embedded_model_and_survives_a_closed_pipe(tmp_path: Path) -> None:
    env = {**os.environ, "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "lmserve.cli", "--print-config"], capture_output=True, text=True,
                         timeout=60, env=env)
    assert out.returncode == 0 and "(the embedded default model)" in out.stdout.splitlines()[-1]
    piped = subprocess.run(f"{sys.executable} -m lmserve.cli --print-config | head -1", shell=True,
                           capture_output=True, text=True, timeout=60, env=env)
    assert piped.stdout.startswith("# lmserve settings") and "Traceback" not in piped.stderr, piped.stderr


def test_a_context_of_which_not_one_slot_fits_is_refused() -> None:
    """SmolLM2's NumPy KV is 46,080 bytes a token: 16M tokens is some 690 GiB, more than this
    machine has. One line from the RAM guard, naming the largest context that fits; nothing served."""
    result = run_cli("--engine", "cpu", "--ctx", "16000000")
    last = result.stderr.strip().splitlines()[-1]  # after the load progress lines
    assert result.returncode == 1 and "Traceback" not in result.stderr and "listening" not in result.stdout
    for needle in ("lmserve: RAM guard", "not even one slot of 16000000 tokens fits", "at most --ctx"):
        assert needle in last, result.stderr


def test_a_context_above_the_trained_one_warns_with_both_numbers() -> None:
    from dataclasses import replace

    from lmserve.cli import context_warning
    from lmserve.model.config import ModelConfig, YarnScaling
    from lmserve.model.default_model import default_model_path
    from lmserve.model.gguf_file import GGUFFile

    config = ModelConfig.from_gguf(GGUFFile(default_model_path()))  # SmolLM2: trained on 8192 tokens
    assert context_warning(8192, config) is None
    warning = context_warning(32768, config)
    assert "--ctx 32768 is above the model's trained context of 8192 tokens" in warning
    assert "sets no rope scaling" in warning
    yarn = replace(config, rope_yarn=YarnScaling(4.0, 8192))
    assert context_warning(32768, yarn) is None  # YaRN x4 over 8192 reaches it
    assert "YaRN rope scaling (factor 4 over 8192) reaches 32768" in context_warning(65536, yarn)
