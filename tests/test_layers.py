"""The layers and their dependencies, read off the import statements of every module.

core (sdiloco/*.py, compression/, distributed/): jax, equinox, optax, jaxtyping, numpy
and the standard library; never the harnesses. sim/: NumPy only. lab/: the core plus
grain, orbax, tqdm, and sim/ (the training loop replays the chaos simulator's failure
traces), and matplotlib only where its absence is caught (`OPTIONAL`: the CLI's
`loss.png`). paper/: anything; nothing imports it.
"""

import ast
import pathlib
import subprocess
import sys

import pytest


ROOT = pathlib.Path(__file__).resolve().parents[1] / "sdiloco"
STDLIB = set(sys.stdlib_module_names)
THIRD_PARTY = {
    "core": {"jax", "equinox", "optax", "jaxtyping", "numpy"},
    "sim": {"numpy"},
    # etils (epath) comes with orbax-checkpoint: its path type.
    "lab": {
        "jax",
        "equinox",
        "optax",
        "jaxtyping",
        "numpy",
        "grain",
        "orbax",
        "etils",
        "tqdm",
    },
    "paper": None,  # anything
}
OPTIONAL = {"lab": {"matplotlib"}}
ELASTIC = {
    "sdiloco.distributed.ray_transport",
    "sdiloco.lab.elastic",
    "sdiloco.lab.ray_job",
}
"""The elastic job's modules: they may import Ray, which the `elastic` extra installs
(nothing else in the package imports them, so the core runs without Ray)."""
STEP_PLUGINS = {"sdiloco.sim.faults"}
"""The chaos simulator's fault injection into the real step: a plug-in, so it uses the
core (`plugins.Plugin`), the one module of sim/ that does."""
"""Packages a layer's extra does not install, imported only inside a `try` whose
`except` catches `ImportError` (the feature is skipped without them)."""
MAY_IMPORT = {  # which layers of sdiloco each layer may import
    "core": {"core"},
    "sim": {"sim"},
    "lab": {"core", "sim", "lab"},
    "paper": {"core", "sim", "lab", "paper"},
}


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) > 1 and parts[1] in ("sim", "lab", "paper"):
        return parts[1]
    return "core"


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imports(path: pathlib.Path) -> list[str]:
    """Absolute names of every module `path` imports (relative imports resolved)."""
    name = _module_name(path)
    return imports_in(path.read_text(), name, path.name == "__init__.py")


def guarded_imports(source: str) -> set[str]:
    """Top-level names imported inside a `try` that catches `ImportError`."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Try):
            continue
        caught = {
            n.id
            for h in node.handlers
            for n in ast.walk(h.type)
            if h.type is not None and isinstance(n, ast.Name)
        }
        if not caught & {"ImportError", "ModuleNotFoundError"}:
            continue
        for stmt in node.body:
            for sub in ast.walk(stmt):
                if isinstance(sub, ast.Import):
                    out |= {a.name.split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.ImportFrom) and not sub.level:
                    out.add((sub.module or "").split(".")[0])
    return out


def imports_in(source: str, name: str, is_package: bool = False) -> list[str]:
    """Absolute names of every module that the source of module `name` imports."""
    package = name if is_package else name.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                prefix = ".".join(base + ([node.module] if node.module else []))
                if node.module:
                    out.append(prefix)
                else:
                    out += [f"{prefix}.{a.name}" for a in node.names]
            else:
                out.append(node.module)
    return out


MODULES = sorted(p for p in ROOT.rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=lambda p: _module_name(p))
def test_module_imports_only_what_its_layer_allows(path):
    layer = _layer(_module_name(path))
    if _module_name(path) == "sdiloco.__main__":  # the thin `python -m sdiloco` entry
        layer = "lab"
    bad = []
    optional = OPTIONAL.get(layer, set()) & guarded_imports(path.read_text())
    module = _module_name(path)
    if module in ELASTIC:
        optional = optional | {"ray"}
    may = MAY_IMPORT[layer] | ({"core"} if module in STEP_PLUGINS else set())
    if module in STEP_PLUGINS:  # and the core's own packages
        optional = optional | THIRD_PARTY["core"]
    for name in imports(path):
        top = name.split(".")[0]
        if top == "sdiloco":
            if _layer(name) not in may:
                bad.append(name)
        elif top not in STDLIB and THIRD_PARTY[layer] is not None:
            if top not in THIRD_PARTY[layer] and top not in optional:
                bad.append(name)
    assert not bad, f"{_module_name(path)} ({layer}) imports {bad}"


def test_checker_sees_a_violation():
    # The same parsing on a made-up core module that imports the harness.
    got = imports_in("from .lab import train\nimport grain\n", "sdiloco._fake")
    assert got == ["sdiloco.lab", "grain"]
    assert _layer("sdiloco.lab") == "lab"


def _graph() -> dict[str, set[str]]:
    """Module -> the sdiloco modules it imports (a package import: its __init__)."""
    names = {_module_name(p) for p in MODULES}
    graph = {}
    for path in MODULES:
        out = set()
        for name in imports(path):
            while name and name not in names:  # `from .x import y`: module x
                name = name.rpartition(".")[0]
            if name and name != _module_name(path):
                out.add(name)
        graph[_module_name(path)] = out
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph`, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node, [node])):
            return found
    return None


def test_no_import_cycle():
    """Modules import one another without a cycle (a package's `__init__` counts as
    the package: it re-exports its modules, which must not import it back)."""
    graph = _graph()
    for package in [n for n in graph if (ROOT.parent / n.replace(".", "/")).is_dir()]:
        # A module importing its own package's names imports the package's modules.
        for module in graph:
            graph[module] = {
                m
                for m in graph[module]
                if not (m == package and module.startswith(package + "."))
            }
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_core_import_loads_no_harness():
    code = (
        "import sys, sdiloco, sdiloco.distributed, sdiloco.sim.utilization, "
        "sdiloco.sim.memory\n"
        "bad = sorted({m.split('.')[0] for m in sys.modules} & "
        "{'grain', 'orbax', 'tqdm', 'matplotlib', 'nbclient', 'jupytext'})\n"
        "bad += sorted(m for m in sys.modules if m.startswith(('sdiloco.lab', "
        "'sdiloco.paper')))\n"
        "print(bad)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_an_optional_import_counts_only_where_its_absence_is_caught():
    guarded = "try:\n    import matplotlib\nexcept ImportError:\n    pass\n"
    assert guarded_imports(guarded) == {"matplotlib"}
    assert guarded_imports("import matplotlib\n") == set()
    other = "try:\n    import matplotlib\nexcept ValueError:\n    pass\n"
    assert guarded_imports(other) == set()
