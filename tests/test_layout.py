"""The package's import graph: lower layers never import higher ones, no cycle, light modules stay light.

Walks every module of ``patchkv_agent`` (``kernels/`` and ``calibration/`` mapped to
``patchkv_agent.kernels`` / ``patchkv_agent.calibration`` as in pyproject.toml) and of the benchmark
harness beside it (``benchmarks``, not installed) with :mod:`ast`: imports at
module level and inside functions alike; imports under ``if TYPE_CHECKING:`` are left out (they never
run). An ``from a import b`` counts as an import of ``a.b`` when that is a module, else of ``a``.

Layers, bottom to top (docs/DESIGN.md): kernels < core < results, loading < profiles < strategies <
resume, offload < engine < runtime < langgraph < eval, calibration, cli < benchmarks. No installed
module imports ``benchmarks``: the CLI names it as a string and loads it with importlib
(``patchkv_agent.cli_bench``) when a benchmark command runs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = "patchkv_agent"
# top-level folders mapped into the package (pyproject.toml [tool.setuptools.package-dir])
HARNESS = "benchmarks"  # the benchmark harness: a top-level package of the checkout, above every layer
SOURCES = {PKG: ROOT / "patchkv_agent", f"{PKG}.kernels": ROOT / "kernels", f"{PKG}.calibration": ROOT / "calibration",
           HARNESS: ROOT / "benchmarks"}
INSTALLED = (PKG,)  # what the wheel carries (pyproject.toml [tool.setuptools] packages)

# module-name prefix -> the prefixes it must never import (a module "is in" a prefix when it equals it or
# starts with it + ".")
FORBIDDEN: dict[str, tuple[str, ...]] = {
    f"{PKG}.kernels": ("core", "results", "loading", "profiles", "strategies", "resume", "offload", "engine",
                       "runtime", "langgraph", "eval", "calibration", "cli"),
    f"{PKG}.core": ("results", "loading", "profiles", "strategies", "resume", "offload", "engine", "runtime",
                    "langgraph", "eval", "calibration", "cli"),
    f"{PKG}.results": ("loading", "profiles", "strategies", "resume", "offload", "engine", "runtime", "langgraph",
                       "eval", "calibration", "cli"),
    f"{PKG}.loading": ("results", "profiles", "strategies", "resume", "offload", "engine", "runtime", "langgraph",
                       "eval", "calibration", "cli"),
    f"{PKG}.profiles": ("strategies", "resume", "offload", "engine", "runtime", "langgraph", "eval", "calibration",
                        "cli"),
    f"{PKG}.strategies": ("resume", "offload", "engine", "runtime", "langgraph", "eval", "calibration", "cli"),
    f"{PKG}.resume": ("engine", "runtime", "langgraph", "eval", "calibration", "cli"),
    f"{PKG}.offload": ("engine", "runtime", "langgraph", "eval", "calibration", "cli"),
    f"{PKG}.engine": ("runtime", "langgraph", "eval", "calibration", "cli"),
    f"{PKG}.runtime": ("langgraph", "eval", "calibration", "cli"),
    f"{PKG}.runtime.kvstore": ("strategies",),
    f"{PKG}.langgraph": ("eval", "calibration", "cli"),
    f"{PKG}.eval": ("cli",),
    f"{PKG}.calibration": ("cli",),
    f"{PKG}.serving": ("eval", "calibration", "cli"),
}
TORCH_FREE = (f"{PKG}.core.diff", f"{PKG}.core.plan", f"{PKG}.core.provenance", f"{PKG}.profiles", f"{PKG}.results")


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def _walked(module: str) -> bool:
    return _within(module, PKG) or _within(module, HARNESS)


def discover() -> dict[str, Path]:
    """Every module of the package: dotted name -> file."""
    mods = {}
    for base, folder in SOURCES.items():
        for f in sorted(folder.rglob("*.py")):
            rel = f.relative_to(folder).with_suffix("")
            parts = list(rel.parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            if any(p.startswith(".") or p in ("__pycache__",) for p in parts):
                continue
            mods[".".join([base, *parts])] = f
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of import nodes that sit under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            t = node.test
            name = t.id if isinstance(t, ast.Name) else t.attr if isinstance(t, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for sub in node.body:
                    out.update(id(n) for n in ast.walk(sub))
    return out


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports (module level and inside functions; TYPE_CHECKING excluded)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    here = module if is_pkg else module.rpartition(".")[0]
    out: set[str] = set()

    def add(target: str) -> None:
        # the longest known module that target is within (importing a.b.c means a.b.c, else a.b ...)
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != module:
            out.add(target)

    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for a in node.names:
                if _walked(a.name):
                    add(a.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                src = f"{base}.{node.module}" if node.module else base
            else:
                src = node.module or ""
            if not _walked(src):
                continue
            for a in node.names:
                sub = f"{src}.{a.name}"
                add(sub if sub in known else src)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = discover()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm (iterative); returns every component of more than one module, or with a self loop."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in graph:
                    continue
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    comps.append(sorted(comp))
    return comps


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every arrow from a module to one its layer must not import, as ``"a -> b (rule)"``."""
    out = []
    for src, targets in sorted(graph.items()):
        for layer, banned in FORBIDDEN.items():
            if not _within(src, layer):
                continue
            for t in sorted(targets):
                hit = [b for b in banned if _within(t, f"{PKG}.{b}")]
                if hit:
                    out.append(f"{src} -> {t} ({layer} must not import {PKG}.{hit[0]})")
    return out


@pytest.fixture(scope="module")
def graph():
    return import_graph()


def test_the_walk_sees_the_whole_package(graph):
    # a sanity check of the walker itself: known arrows are found, mapped folders are included
    assert f"{PKG}.core.recovery" in graph and f"{PKG}.calibration.drift" in graph and f"{PKG}.kernels.torch_restore" in graph
    assert f"{PKG}.strategies.base" in graph[f"{PKG}.engine"] or f"{PKG}.strategies" in graph[f"{PKG}.engine"]
    assert f"{PKG}.kernels.dispatch" in graph[f"{PKG}.kernels"]  # relative "from .dispatch import ..."
    assert f"{PKG}.core.diff" in graph[f"{PKG}.core.plan"] or f"{PKG}.core.diff" in str(graph)


def test_no_arrow_points_up(graph):
    bad = violations(graph)
    assert not bad, "imports from a lower layer to a higher one:\n  " + "\n  ".join(bad)


def test_no_installed_module_imports_the_benchmarks(graph):
    """The wheel carries the library: no module of ``patchkv_agent`` imports ``benchmarks`` (module level or
    lazily); the CLI's loader names it only as a string, and the wheel's package list leaves it out."""
    bad = [f"{src} -> {t}" for src, targets in sorted(graph.items()) if _within(src, PKG)
           for t in sorted(targets) if _within(t, HARNESS)]
    assert not bad, "installed modules importing the benchmark harness:\n  " + "\n  ".join(bad)
    assert f"{HARNESS}.bench" in graph and f"{PKG}.eval.episodes" in graph[f"{HARNESS}.bench"]
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"]
    assert not [p for p in packages if _within(p, HARNESS)], packages
    loaders = [m for m, p in discover().items() if _within(m, PKG) and f'"{HARNESS}"' in p.read_text(encoding="utf-8")]
    assert loaders == [f"{PKG}.cli_bench"], loaders


def test_the_benchmark_commands_load_the_harness_only_when_one_runs(tmp_path):
    """``patchkv-agent --help`` lists the benchmark commands without importing ``benchmarks``; a benchmark
    command from another directory finds it; a copy of the package without the checkout fails in one line."""
    code = ("import sys; from patchkv_agent.cli import build_parser; p = build_parser(); "
            "names = next(a for a in p._actions if a.dest == 'command').choices; "
            "print('bench-host' in names, any(m == 'benchmarks' or m.startswith('benchmarks.') for m in sys.modules))")
    import os

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "False"]
    out = subprocess.run([sys.executable, "-m", f"{PKG}.cli", "bench-host", "--help"], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=300)
    assert out.returncode == 0 and "--lengths" in out.stdout, out.stderr
    import shutil

    site = tmp_path / "site" / PKG  # the installed layout: kernels/ and calibration/ inside the package
    shutil.copytree(ROOT / PKG, site, ignore=shutil.ignore_patterns("__pycache__", "data"))
    for folder in ("kernels", "calibration"):
        shutil.copytree(ROOT / folder, site / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env["PYTHONPATH"] = str(tmp_path / "site")
    out = subprocess.run([sys.executable, "-m", f"{PKG}.cli", "bench-host", "--lengths", "2000"], capture_output=True,
                         text=True, cwd=tmp_path, env=env, timeout=300)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "benchmarks/" in lines[0] and "scripts/bootstrap.sh" in lines[0], lines[0]


def test_no_import_cycle(graph):
    comps = strongly_connected(graph)
    assert not comps, "import cycles:\n  " + "\n  ".join(" <-> ".join(c) for c in comps)


def test_checker_catches_a_wrong_arrow_and_a_cycle(graph):
    # the checks must be able to fail: add one upward arrow and one cycle to a copy of the graph
    g = {k: set(v) for k, v in graph.items()}
    g[f"{PKG}.core.diff"].add(f"{PKG}.eval.replay")
    assert any(v.startswith(f"{PKG}.core.diff -> {PKG}.eval.replay") for v in violations(g))
    g[f"{PKG}.core.recovery"].add(f"{PKG}.engine")  # engine -> ... -> recovery already exists
    assert any(f"{PKG}.core.recovery" in c and f"{PKG}.engine" in c for c in strongly_connected(g))


def test_tarjan_on_a_known_graph():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert sorted(strongly_connected(g)) == [["a", "b", "c"], ["e"]]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_light_modules_import_without_torch(module):
    code = f"import sys, {module}; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {module} pulled in torch"


def test_no_hidden_upward_dependency():
    """Dependencies the import walk cannot see: no module locates a package by name (``find_spec``,
    ``import_module`` of another layer), and importing the engine installs no process-wide torch hook."""
    import re

    locate = re.compile(r"find_spec\(|import_module\(\s*[\"']patchkv_agent")
    hidden = [str(p.relative_to(ROOT)) for p in discover().values() if locate.search(p.read_text(encoding="utf-8"))]
    assert not hidden, f"modules that locate a package by name: {hidden}"
    code = ("import torch.nn.modules.module as m; n = len(m._global_parameter_registration_hooks); "
            "import patchkv_agent.engine, patchkv_agent.runtime.threads, patchkv_agent.langgraph.chat_model; "
            "print(len(m._global_parameter_registration_hooks) - n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0", "importing the engine installed a torch hook"


def test_the_runtime_asks_a_strategy_what_it_declares_never_its_name():
    """``runtime/`` (kvstore included) never resolves a strategy by a literal name nor compares a name with one:
    it reads what the strategy declares (``uses_checkpoint``, ``exact``) and gets an exact one from
    ``ResumeRequest.as_full_prefill`` / ``as_exact_reuse``."""
    from patchkv_agent.strategies import STRATEGIES

    names = set(STRATEGIES)
    bad = []
    for mod, path in discover().items():
        if not _within(mod, f"{PKG}.runtime"):
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            literals: list[ast.expr] = []
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if called in ("strategy", "get_strategy"):
                    literals = list(node.args[:1])
            elif isinstance(node, ast.Compare):
                literals = [node.left, *node.comparators]
            if any(isinstance(x, ast.Constant) and x.value in names for x in literals):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"strategy names in the runtime: {bad}"


# --------------------------------------------------------------------------------------------- docs

_TEXT = (".py", ".md", ".sh", ".ipynb", ".toml", ".txt", ".c")
_SCANNED = ("patchkv_agent", "kernels", "calibration", "benchmarks", "tests", "scripts", "examples", "notebooks", "docs")


def _text_files():
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for d in _SCANNED:
        files += [f for f in (ROOT / d).rglob("*") if f.suffix in _TEXT and "__pycache__" not in f.parts]
    return [f for f in files if f.is_file()]


def test_every_spec_a_file_cites_is_in_the_repository():
    """Docstrings and docs point at docs/*.md files that a clone has, never at a folder outside it."""
    import re

    outside = re.compile("shared" + "/")  # split so this file does not match itself
    cited = re.compile(r"\b(?:docs/)?((?:DESIGN|TRACES|RESULTS|calibration)\.md)\b")
    bad, missing = [], []
    for f in _text_files():
        text = f.read_text(encoding="utf-8", errors="replace")
        if outside.search(text):
            bad.append(str(f.relative_to(ROOT)))
        for name in cited.findall(text):
            if not (ROOT / "docs" / name).is_file():
                missing.append(f"{f.relative_to(ROOT)} -> docs/{name}")
    assert not bad, f"files pointing outside the repository: {bad}"
    assert not missing, f"cited docs that do not exist: {missing}"
