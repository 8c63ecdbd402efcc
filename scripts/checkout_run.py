"""Run a module or script of this checkout without installing it (scripts/gpu_check.sh on a bare machine).

    python3 scripts/checkout_run.py -m patchkv_agent.cli bench-host ...
    python3 scripts/checkout_run.py scripts/gpu_kernel_check.py --out DIR

The installed package maps two folders of the repository into it (pyproject.toml's
``[tool.setuptools.package-dir]``: ``kernels/`` is ``patchkv_agent.kernels``, ``calibration/`` is
``patchkv_agent.calibration``); an editable install does that with a finder, a bare checkout cannot. This
launcher puts the repository root first on ``sys.path``, installs a finder with the same mapping (read from
pyproject.toml), then runs the module or script as ``python -m`` / ``python`` would. Needs no network, no
setuptools and writes nothing.

``PATCHKV_SIM_MISSING=name,name``: these top-level packages fail to import (ModuleNotFoundError) as if they
were not installed (``importlib.util.find_spec`` says None): a machine without them simulated on this one (e.g. ``langgraph,langchain_core,gguf``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DEFAULT_DIRS = {"patchkv_agent.kernels": "kernels", "patchkv_agent.calibration": "calibration"}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Package name -> folder, from pyproject.toml (the two defaults when it cannot be read)."""
    dirs = dict(_DEFAULT_DIRS)
    try:
        import tomllib

        with open(root / "pyproject.toml", "rb") as f:
            dirs = dict(tomllib.load(f)["tool"]["setuptools"]["package-dir"])
    except Exception:  # noqa: BLE001 - no pyproject or no tomllib: the known mapping
        pass
    return {name: root / d for name, d in dirs.items() if name}


class _PackageDirFinder(importlib.abc.MetaPathFinder):
    def __init__(self, dirs: dict[str, Path]):
        self.dirs = dirs

    def find_spec(self, fullname, path=None, target=None):
        d = self.dirs.get(fullname)
        if d is None or not (d / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(fullname, d / "__init__.py", submodule_search_locations=[str(d)])


def install(root: Path = ROOT) -> None:
    """Make ``import patchkv_agent`` (and its mapped subpackages) load from ``root``."""
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    for name in os.environ.get("PATCHKV_SIM_MISSING", "").split(","):
        if name.strip() and name.strip() not in sys.modules:  # import fails, importlib.util.find_spec says None
            sys.modules[name.strip()] = None  # type: ignore[assignment]
    sys.meta_path.insert(0, _PackageDirFinder(package_dirs(root)))


def main(argv: list[str]) -> None:
    if not argv or argv[0] in ("-h", "--help") or (argv[0] == "-m" and len(argv) < 2):
        print(__doc__.strip())
        raise SystemExit(0 if argv and argv[0] in ("-h", "--help") else 2)
    install()
    if argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        script = Path(argv[0]).resolve()
        sys.argv = [str(script), *argv[1:]]
        sys.path.insert(0, str(script.parent))
        runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
