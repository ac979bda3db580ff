"""Flags from `config.toml` (`--config`, `$XDG_CONFIG_HOME`, `~/.config`), the command line over
them, and `--print-config`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from lmserve.cli import main
from lmserve.settings import UsageError, parse_settings
from tests.test_cli import assert_one_line_failure


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the config file is read from by default: a temporary HOME's ~/.config."""
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    path = tmp_path / ".config" / "lmserve" / "config.toml"
    path.parent.mkdir(parents=True)
    return path


def parse_args(argv: list[str]):
    return parse_settings(argv, env={})


def error(argv: list[str]) -> str:
    with pytest.raises(UsageError) as exc:
        parse_args(argv)
    return str(exc.value)


def test_no_file_no_change(config: Path) -> None:
    args = parse_args([])
    assert args.config is None and args.model is None and args.kv_slots == 4


def test_the_files_flags_apply(config: Path) -> None:
    config.write_text('model = "qwen3-coder:30b"\nctx = 32768\nkv-slots = 8\nsse_keepalive = 2\n'
                      'no-kv-reuse = true\nkv-slots-force = true\nkv-cache-dir = "~/kv"\nengine = "cpu"\n'
                      'cors = ["http://a.test"]\nallow-host = "box.local"\n')
    args = parse_args([])
    assert args.config == config
    assert (args.model, args.ctx, args.kv_slots, args.sse_keepalive) == ("qwen3-coder:30b", 32768, 8, 2.0)
    assert args.kv_reuse is False and args.kv_slots_force is True and args.engine == "cpu"
    assert args.kv_cache_dir == Path("~/kv") and args.cors == ["http://a.test"] and args.allow_host == ["box.local"]


def test_the_command_line_wins(config: Path) -> None:
    config.write_text('model = "qwen3-coder:30b"\nctx = 32768\nkv_slots = 8\ncors = ["http://a.test"]\n'
                      "no-kv-reuse = false\n")
    args = parse_args(["llama3.2", "--ctx", "4096", "--cors", "http://b.test", "--no-kv-reuse"])
    assert (args.model, args.ctx, args.kv_slots, args.cors) == ("llama3.2", 4096, 8, ["http://b.test"])
    assert args.kv_reuse is False


def test_config_flag_and_xdg_config_home(config: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config.write_text("ctx = 1000\n")
    other = tmp_path / "other.toml"
    other.write_text("ctx = 2000\n")
    assert parse_args(["--config", str(other)]).ctx == 2000
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert parse_args([]).ctx is None
    (tmp_path / "xdg" / "lmserve").mkdir(parents=True)
    (tmp_path / "xdg" / "lmserve" / "config.toml").write_text("ctx = 3000\n")
    assert parse_args([]).ctx == 3000


@pytest.mark.parametrize(("text", "needles"), [
    ("kv-slot = 8\n", ("unknown key 'kv-slot'", "kv-slots")),
    ("list = true\n", ("unknown key 'list'",)),
    ("ctx = \"big\"\n", ("'ctx'", "must be an integer")),
    ("ctx = 1.5\n", ("'ctx'", "must be an integer")),
    ("kv-slots-force = 1\n", ("'kv-slots-force'", "true or false")),
    ("engine = \"gpu\"\n", ("'engine'", "one of auto, cpu, mlx")),
    ("ctx = \n", ("not valid TOML",)),
])
def test_bad_files_name_the_key_and_the_file(config: Path, text: str, needles: tuple[str, ...]) -> None:
    config.write_text(text)
    message = error([])
    assert str(config) in message
    for needle in needles:
        assert needle in message, message


def test_a_missing_config_flag_file_is_an_error(tmp_path: Path) -> None:
    assert "cannot read config file" in error(["--config", str(tmp_path / "nope.toml")])


def test_a_bad_file_is_one_line_from_the_command(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text("threads = 4\n")
    result = subprocess.run([sys.executable, "-m", "lmserve.cli", "--config", str(path)],
                            capture_output=True, text=True, timeout=60)
    assert_one_line_failure(result, "unknown key 'threads'", str(path))


def test_print_config_shows_the_effective_settings(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config.write_text('model = "nowhere:1b"\nctx = 32768\nkv-slots = 8\napi-key = "secret"\n')
    main(["--print-config", "--kv-slots", "2"])
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"# lmserve settings from the command line over {config}"
    for line in ('model = "nowhere:1b"', "ctx = 32768", "kv-slots = 2", 'engine = "auto"', "no-kv-reuse = false",
                 "# kv-cache-dir is not set", 'api-key = "(set, not shown)"'):
        assert line in lines, line
    assert "secret" not in out
    assert lines[-1].startswith("# model file: none (no model file or stored model named 'nowhere:1b'")


def test_a_bad_flag_over_the_file_names_the_flag(config: Path) -> None:
    config.write_text("batch = 2\n")
    message = error(["--batch", "0"])
    assert message.startswith("--batch must be from 1 to 256") and str(config) not in message
