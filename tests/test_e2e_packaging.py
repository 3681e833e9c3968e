"""The package as users install it: a regular (non-editable) wheel holds every module and imports.

An editable install finds modules in the source tree whatever pyproject.toml lists; a wheel holds only
the listed packages, so a subpackage missing from the list fails here, not on a user's machine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("cli", "launcher", "trainer", "traces", "analysis")
TOP_PACKAGE_DIR = "cli/package/"
"""`import fleetscope` itself: pyproject.toml maps the package `fleetscope` to this folder."""


def _clean_copy(destination: Path) -> Path:
    """The files git would check out (tracked and untracked-not-ignored), copied to `destination`."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        path = ROOT / name
        if path.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, destination / name)
    return destination


def source_modules() -> set[str]:
    modules = set()
    for package in PACKAGE_DIRS:
        for path in (ROOT / package).rglob("*.py"):
            relative = path.relative_to(ROOT).as_posix()
            modules.add("fleetscope/" + relative.removeprefix(TOP_PACKAGE_DIR))
    return modules


def test_a_regular_wheel_holds_and_imports_every_module(tmp_path):
    source = _clean_copy(tmp_path / "src")  # a build/ folder left in the tree would leak old modules in
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout[-3000:] + built.stderr[-3000:]
    wheel = next((tmp_path / "dist").glob("fleetscope-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        archive.extractall(tmp_path / "site")
    missing = sorted(source_modules() - names)
    assert not missing, f"not in the wheel: {missing}"
    modules = sorted(name[: -len(".py")].replace("/", ".").removesuffix(".__init__") for name in source_modules())
    # every module must come from the wheel, never from the source tree (an editable install's finder
    # would otherwise supply what the wheel lacks)
    script = ("import importlib, sys\nsite = sys.path[0]\nfor m in sys.argv[1:]:\n"
              "    f = importlib.import_module(m).__file__\n"
              "    assert f.startswith(site), f'{m} imported from {f}'\nprint('ok')")
    # -I: only the extracted wheel (and the venv's site-packages) is importable, never the source tree
    imported = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r})\n"
                               + script, *modules], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert imported.returncode == 0 and imported.stdout.strip() == "ok", imported.stderr[-3000:]
