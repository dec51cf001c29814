"""The package's layer map (docs/CONTRACTS.md, "Layers"): every import of one Quartet module by another points down
the map or stays inside its own package, no two modules import each other (directly or round a loop), and an import
inside a function is there for a reason this file names.

Read from the source with `ast`, every import statement counted, at the top of a module or inside a function, so a
lazy import cannot hide a dependency that points the wrong way.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# rank of each unit: a package under quartet/ or a module at its root; an import must go to a lower rank (or stay
# in its unit). The same table, with what each layer holds, is in docs/CONTRACTS.md.
LAYERS: dict[str, int] = {
    "errors": 0,
    "algo": 1, "atomic": 1, "quiet": 1, "allocator": 1, "handles": 1, "batching": 1,
    "config": 2,
    "outputs": 3,
    "models": 4,
    "judges": 5,
    "tasks": 6,
    "data": 7,
    "rollout": 8,
    "preflight": 9,
    "monitor": 10, "eval": 10, "annotate": 10,
    "trainers": 11,
    "pipeline": 12,
    "api": 13, "config_doc": 13,
    "cli": 14,
    "__init__": 15,  # quartet/__init__.py: the package's front door
}

# imports of Quartet modules that stay inside a function, and why: each is a start-up cost a command that does not
# need it should not pay (the CLI's --help, `import quartet`)
LAZY_OK: dict[tuple[str, str], str] = {
    ("quartet.rollout.engine", "quartet.rollout.vllm_engine"):
        "vllm is an optional extra: the module that imports it is loaded only when generation.engine is vllm",
    ("quartet.judges.relevance", "quartet.models.names"):
        "quartet.models loads transformers (seconds); tasks, data and `quartet tasks` import the judges, and only "
        "the relevance judge's first call needs a model",
    ("quartet.annotate.command", "quartet.annotate.server"):
        "fastapi and uvicorn are the optional annotate extra: the command checks they are installed, and says how to "
        "install them, before it imports the module that needs them",
    ("quartet.annotate.export", "quartet.rollout.scoring"):
        "an export scores answers only when given --judge; the Scorer's module loads transformers (seconds), which "
        "the export of rankings alone does not need",
    ("quartet.annotate.command", "quartet.annotate.export"):
        "the export scores answers with a reward spec (quartet.rollout.scoring loads torch, seconds); serving the "
        "page does not need it",
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / "quartet").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _resolve(target: str) -> str | None:
    """The Quartet module an import names: `quartet.models.loading` or, for `from quartet.models import X`, the
    package (X may be a submodule: counted as the package, which imports it anyway)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _imports(module: str, path: Path) -> list[tuple[str, bool, int]]:
    """(imported Quartet module, inside a function, line) for every import statement of `module`."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nested.update(id(sub) for sub in ast.walk(node) if sub is not node)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join(base + ([node.module] if node.module else []))]
            else:
                names = [node.module or ""]
            # `from quartet.models import loading`: the submodule itself when it is one
            names = [f"{names[0]}.{a.name}" if f"{names[0]}.{a.name}" in MODULES else names[0] for a in node.names]
        else:
            continue
        for name in names:
            if name == "quartet" or name.startswith("quartet."):
                target = _resolve(name)
                if target is not None and target != module:
                    found.append((target, id(node) in nested, node.lineno))
    return found


IMPORTS = {m: _imports(m, p) for m, p in MODULES.items()}


def test_every_unit_is_on_the_map():
    units = {_unit(m) for m in MODULES}
    assert not units - LAYERS.keys(), f"add these to LAYERS and docs/CONTRACTS.md: {sorted(units - LAYERS.keys())}"


def test_imports_point_down_the_map():
    wrong = [f"{MODULES[m].relative_to(SRC)}:{line}: {m} ({_unit(m)}, layer {LAYERS[_unit(m)]}) imports {t} "
             f"({_unit(t)}, layer {LAYERS[_unit(t)]})"
             for m, found in IMPORTS.items() for t, _, line in found
             if _unit(t) != _unit(m) and LAYERS[_unit(t)] >= LAYERS[_unit(m)]]
    assert not wrong, "imports against the layer map:\n" + "\n".join(wrong)


def test_no_import_cycles():
    graph = {m: {t for t, _, _ in found} for m, found in IMPORTS.items()}
    # the package __init__ of a module is imported whenever the module is: an edge from a package to its own
    # submodule is how a package re-exports, not a dependency of the package on itself
    cycles, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if nxt.startswith(node + "."):
                continue
            if state.get(nxt) == "open":
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_lazy_imports_have_a_reason():
    lazy = sorted({(m, t) for m, found in IMPORTS.items() for t, inside, _ in found if inside})
    unexplained = [f"{m} -> {t}" for m, t in lazy if (m, t) not in LAZY_OK]
    assert not unexplained, ("imports inside functions with no reason in LAZY_OK (move them to the module top, or "
                             "say why they must wait):\n" + "\n".join(unexplained))
    stale = [f"{m} -> {t}" for m, t in LAZY_OK if (m, t) not in lazy]
    assert not stale, "LAZY_OK names imports that are no longer lazy:\n" + "\n".join(stale)


@pytest.mark.parametrize("unit", sorted(LAYERS))
def test_the_map_is_documented(unit):
    doc = (SRC.parent / "docs" / "CONTRACTS.md").read_text(encoding="utf-8")
    section = doc.split("## Layers", 1)[1].split("\n## ", 1)[0]
    name = "quartet/__init__.py" if unit == "__init__" else unit
    assert f"`{name}`" in section, f"docs/CONTRACTS.md's Layers section does not place `{name}`"
