"""The import layers of `src/zerotrain`, read from the source (AST), not from a running import.

Every import counts: module level, inside functions, and under `if TYPE_CHECKING:`. Imports
point down the layers only; no zerotrain module imports itself through a circle; and the
library below the application layer imports no argparse, matplotlib or tqdm (the application,
`zerotrain.cli` and `zerotrain.run`, owns all of that).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

# Higher layers may import lower ones and their own layer, never a higher one. The package
# root holds only the entry points and the engine; everything else lives in a package, and
# a package's name covers every module in it (so a new module needs no entry here).
APP = 6
LAYERS = {
    "zerotrain": APP,  # the package __init__ (zerotrain.initialize); this name alone
    "zerotrain.__main__": APP,
    "zerotrain.cli": APP,  # the commands: one module each, and what they share
    "zerotrain.run": APP,  # a training run: setup, loop, report, run folder, lr-find
    "zerotrain.deepspeed": APP,  # DeepSpeed's script surface over the engine (a user's script)
    "zerotrain.hf": APP,  # `import deepspeed` -> zerotrain.deepspeed for HF Trainer / TRL
    "zerotrain.engine": 5,
    "zerotrain.engine_api": 5,  # the DeepSpeed-style methods beside the engine
    "zerotrain.checkpoint": 4,
    "zerotrain.zero": 3,
    "zerotrain.comm": 2,
    "zerotrain.optim": 2,
    "zerotrain.models": 2,
    "zerotrain.data": 2,
    "zerotrain.numerics": 1,
    "zerotrain.memory": 1,
    "zerotrain.config": 1,
    "zerotrain.deepspeed_config": 1,  # a DeepSpeed JSON read into zerotrain's config
}
# Only the application layer may use these (command lines, plots, progress bars).
APP_ONLY = ("argparse", "matplotlib", "tqdm")

# PENDING: known upward imports still to remove (none today). Keep the mechanism: an
# entry here must name a real upward import, or test_pending_is_current fails.
PENDING: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a zerotrain module, or the top-level name of an outside package
    file: str  # as shown in messages: src/zerotrain/...
    line: int

    def where(self) -> str:
        return f"{self.file}:{self.line}"


def module_name(path: Path, root: Path = SRC) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int | None:
    """The layer of a zerotrain module, or None if the table does not place it: the entry
    that names it, or the package it is in ("zerotrain" itself covers only its __init__)."""
    for prefix, rank in LAYERS.items():
        if module == prefix or (prefix != "zerotrain" and module.startswith(prefix + ".")):
            return rank
    return None


def imports_of(path: Path, module: str, known: set[str], root: Path = SRC) -> list[Import]:
    """Every import statement in the file, resolved to the module it loads."""
    shown = str(path.relative_to(root.parent))
    is_package = path.name == "__init__.py"
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package this module is in
                pkg = module.split(".")
                pkg = pkg[: len(pkg) - node.level + (1 if is_package else 0)]
                base = ".".join(pkg + ([base] if base else []))
            # `from pkg import sub` loads the submodule when there is one
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        else:
            continue
        for t in targets:
            target = t if t.startswith("zerotrain") else t.split(".")[0]
            out.append(Import(module, target, shown, node.lineno))
    return out


def scan(root: Path = SRC) -> list[Import]:
    files = {module_name(p, root): p for p in sorted((root / "zerotrain").rglob("*.py"))}
    return [imp for m, p in files.items() for imp in imports_of(p, m, set(files), root)]


def layer_problems(imports: list[Import], pending: set[tuple[str, str]]) -> list[str]:
    problems = []
    for imp in imports:
        own = layer(imp.importer)
        if own is None:
            problems.append(f"{imp.where()}: module {imp.importer} is in no layer; add it "
                            "to the layer table in tests/test_layers.py")
            continue
        if not imp.target.startswith("zerotrain"):
            if own < APP and imp.target in APP_ONLY:
                problems.append(f"{imp.where()}: {imp.importer} imports {imp.target}, which "
                                "belongs in the application layer (zerotrain.cli, zerotrain.run)")
            continue
        theirs = layer(imp.target)
        if theirs is None:
            problems.append(f"{imp.where()}: {imp.target} is in no layer; add it to the "
                            "layer table in tests/test_layers.py")
        elif theirs > own and (imp.importer, imp.target) not in pending:
            problems.append(f"{imp.where()}: {imp.importer} (layer {own}) imports "
                            f"{imp.target} (layer {theirs}): imports must point down")
    return problems


def cycles(imports: list[Import]) -> list[list[Import]]:
    """One import circle per strongly connected group of zerotrain modules (Tarjan)."""
    edges: dict[str, dict[str, Import]] = {}
    for imp in imports:
        if imp.target.startswith("zerotrain") and imp.target != imp.importer:
            edges.setdefault(imp.importer, {}).setdefault(imp.target, imp)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_circle(sorted(g)[0], g, edges) for g in groups]


def _circle(start: str, group: set[str], edges: dict[str, dict[str, Import]]) -> list[Import]:
    """A shortest path start -> ... -> start inside the group, as the imports that make it."""
    paths: dict[str, list[Import]] = {start: []}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, imp in edges.get(v, {}).items():
                if w == start:
                    return [*paths[v], imp]
                if w in group and w not in paths:
                    paths[w] = [*paths[v], imp]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")


def describe(circle: list[Import]) -> str:
    return " -> ".join(f"{imp.importer} ({imp.where()})" for imp in circle) + \
        f" -> {circle[0].importer}"


# ---------------------------------------------------------------------- the real tree
def test_imports_point_down_the_layers():
    problems = layer_problems(scan(), PENDING)
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    found = cycles(scan())
    assert not found, "import cycles:\n" + "\n".join(describe(c) for c in found)


def test_pending_is_current():
    """Each PENDING entry is still an upward import; remove it once it is fixed."""
    real = {(i.importer, i.target) for i in scan()}
    stale = {p for p in PENDING if p not in real or layer(p[1]) <= layer(p[0])}
    assert not stale, f"fixed, remove from PENDING in tests/test_layers.py: {sorted(stale)}"


# ---------------------------------------------------------------------- the checker itself
def _tree(tmp_path: Path, files: dict[str, str]) -> list[Import]:
    for name, text in files.items():
        f = tmp_path / name
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return scan(tmp_path)


def test_checker_finds_upward_hidden_and_app_only_imports(tmp_path):
    imports = _tree(tmp_path, {
        "zerotrain/__init__.py": "",
        "zerotrain/engine.py": "",
        "zerotrain/numerics/__init__.py": "",
        "zerotrain/numerics/a.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n    from zerotrain.engine import Engine\n"
            "def f():\n    import argparse\n    from ..zero import base\n"),
        "zerotrain/zero/__init__.py": "",
        "zerotrain/zero/base.py": "",
        "zerotrain/extra.py": "import zerotrain.config\n",
    })
    text = "\n".join(layer_problems(imports, set()))
    assert "a.py:3: zerotrain.numerics.a (layer 1) imports zerotrain.engine (layer 5)" in text
    assert "a.py:5: zerotrain.numerics.a imports argparse" in text
    assert "a.py:6: zerotrain.numerics.a (layer 1) imports zerotrain.zero.base (layer 3)" in text
    assert "module zerotrain.extra is in no layer; add it to the layer table" in text
    allowed = {("zerotrain.numerics.a", "zerotrain.engine")}
    assert "zerotrain.engine (layer 5)" not in "\n".join(layer_problems(imports, allowed))


def test_checker_finds_a_lazy_cycle(tmp_path):
    imports = _tree(tmp_path, {
        "zerotrain/numerics/__init__.py": "",
        "zerotrain/numerics/formats.py": "def f():\n    from zerotrain.numerics import codec\n",
        "zerotrain/numerics/codec.py": "from zerotrain.numerics.formats import f\n",
        "zerotrain/numerics/notation.py": "from zerotrain.numerics.formats import f\n",
    })
    (circle,) = cycles(imports)
    assert [i.importer for i in circle] == ["zerotrain.numerics.codec",
                                             "zerotrain.numerics.formats"]
    assert "formats.py:2" in describe(circle)


@pytest.mark.parametrize("module", ["zerotrain.cli.args", "zerotrain.run.loop",
                                    "zerotrain.run.lr_find", "zerotrain"])
def test_app_layer(module):
    assert layer(module) == APP


# ----------------------------------------------------------------------------- sizes
#: the project's size rule: a module fits one reading, a function one screen
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 60


def test_no_file_over_400_lines_and_no_function_over_60():
    long_files, long_functions = [], []
    for path in sorted((SRC / "zerotrain").rglob("*.py")):
        text = path.read_text()
        shown = path.relative_to(SRC.parent)
        if text.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{shown}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long_functions.append(f"{shown}:{node.lineno} {node.name}: {n} lines")
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"


# Inside `zerotrain.zero`: tiers (byte movers that know nothing of ZeRO) < the layout of
# units < the homes (ZeRO-3's parameter store, the home of gradients, masters and moments)
# < the stages and their updaters < the builder (`zerotrain.zero` itself). A stage never
# imports a tier: it asks its home or its store.
ZERO_LAYERS = {
    "zerotrain.zero.tiers": 0,
    "zerotrain.zero.partition": 1, "zerotrain.zero.flat": 1, "zerotrain.zero.unit": 1,
    "zerotrain.zero.audit": 1, "zerotrain.zero.init": 1,
    "zerotrain.zero.params": 2, "zerotrain.zero.states": 2, "zerotrain.zero.experts": 2,
    "zerotrain.zero.base": 3, "zerotrain.zero.ddp": 3, "zerotrain.zero.zero1": 3,
    "zerotrain.zero.zero2": 3, "zerotrain.zero.zero3": 3, "zerotrain.zero.update": 3,
    "zerotrain.zero.muon": 3, "zerotrain.zero.state": 3, "zerotrain.zero.cut": 3,
    "zerotrain.zero.build": 3,
    "zerotrain.zero": 4,
}
ZERO_TIERS, ZERO_STAGES = 0, 3
# Outside `zero`, these import only its public face (`zerotrain.zero`).
FACE_ONLY = ("zerotrain.engine", "zerotrain.engine_api")


def zero_layer(module: str) -> int | None:
    best = None
    for prefix, rank in ZERO_LAYERS.items():
        inside = module == prefix or module.startswith(prefix + ".")
        if inside and (best is None or len(prefix) > len(best[0])):
            best = (prefix, rank)
    return None if best is None else best[1]


def zero_problems(imports: list[Import]) -> list[str]:
    problems = []
    for imp in imports:
        if imp.importer in FACE_ONLY and imp.target.startswith("zerotrain.zero."):
            problems.append(f"{imp.where()}: {imp.importer} imports {imp.target}; it may "
                            "import only zerotrain.zero's public face")
        if not (imp.importer.startswith("zerotrain.zero")
                and imp.target.startswith("zerotrain.zero")):
            continue
        own, theirs = zero_layer(imp.importer), zero_layer(imp.target)
        if own is None or theirs is None:
            name = imp.importer if own is None else imp.target
            problems.append(f"{imp.where()}: {name} is in no layer of ZERO_LAYERS")
        elif theirs > own:
            problems.append(f"{imp.where()}: {imp.importer} (zero layer {own}) imports "
                            f"{imp.target} (zero layer {theirs}): imports must point down")
        elif own == ZERO_STAGES and theirs == ZERO_TIERS:
            problems.append(f"{imp.where()}: stage module {imp.importer} imports the tier "
                            f"{imp.target}; ask the home or the store instead")
    return problems


def test_zero_layers_inside():
    assert zero_problems(scan()) == []


def test_zero_checker_finds_a_stage_importing_a_tier(tmp_path):
    imports = _tree(tmp_path, {
        "zerotrain/zero/__init__.py": "",
        "zerotrain/zero/zero3.py": "from zerotrain.zero.tiers import tier\n",
        "zerotrain/zero/tiers/__init__.py": "",
        "zerotrain/zero/tiers/tier.py": "from zerotrain.zero.states import home\n",
        "zerotrain/zero/states/__init__.py": "",
        "zerotrain/zero/states/home.py": "",
        "zerotrain/engine.py": "from zerotrain.zero.states import home\n",
    })
    found = zero_problems(imports)
    assert any("stage module zerotrain.zero.zero3 imports the tier" in p for p in found)
    assert any("zerotrain.zero.tiers.tier (zero layer 0) imports" in p for p in found)
    assert any("zerotrain.engine imports zerotrain.zero.states.home" in p for p in found)
