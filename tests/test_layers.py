"""The package's import direction: every import of a ds_autoplan module, also the
lazy ones inside functions, goes down the layer order below or stays inside its own
subpackage, and no two modules import each other, directly or around a circle."""
from __future__ import annotations

import ast
import pathlib

import ds_autoplan

ROOT = pathlib.Path(ds_autoplan.__file__).resolve().parent

# Lowest first.  Data runs spec -> cost -> search -> Plan -> emit / schedule -> runtime; the
# schedule IR (actions, builders, simulator: it imports nothing of ours) is the vocabulary the
# search evaluates and the runtimes execute, so it sits at the bottom with the specs, and the
# Plan, the search's product, under the search.  Packages in one layer are independent.
LAYERS = [
    {"errors"},                          # user-facing error types
    {"env"},                             # DS_AUTOPLAN_* variables, parsed and named
    {"spec", "schedule", "outputs"},     # what is trained on what; the schedule vocabulary;
                                         # atomic output files (every writing command)
    {"cost", "plan", "profile"},         # cost model; the Plan contract; measured profiles
    {"search", "dynamic"},               # static search (-> Plan); per-step planning
    {"emit", "report"},                  # Plan -> engine configs; reports
    {"runtime.common"},                  # engine-neutral execution (runtime/*.py)
    {"runtime.deepspeed", "runtime.megatron"},   # the two engine adapters
    {"models"},                          # tiny models for examples, tests, benchmarks
    {"cli", "clients"},                  # the ds-autoplan command; hooks in users' scripts
    {"ds_autoplan", "__main__"},         # the package's own __init__ / __main__
]
RANK = {name: i for i, layer in enumerate(LAYERS) for name in layer}


def module_name(path: pathlib.Path) -> str:
    parts = ["ds_autoplan", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in ROOT.rglob("*.py")}


def unit(module: str) -> str:
    """The layer unit of a module: its subpackage (runtime: common or the adapter)."""
    parts = module.split(".")[1:]
    if not parts:
        return "ds_autoplan"
    if parts[0] == "runtime":     # an adapter is a subpackage; runtime/*.py are common
        sub = parts[1] if len(parts) > 1 else ""
        return f"runtime.{sub}" if (ROOT / "runtime" / sub).is_dir() and sub else "runtime.common"
    return parts[0]


def imports(module: str) -> set[str]:
    """The ds_autoplan modules ``module`` imports (a ``from pkg import name`` counts as the
    submodule when ``name`` is one, else as ``pkg``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ds_autoplan"}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level \
                else []
            target = ".".join(base + ([node.module] if node.module else []))
            if target.split(".")[0] != "ds_autoplan":
                continue
            subs = {f"{target}.{a.name}" for a in node.names} & MODULES.keys()
            out |= subs or {target}
    return {m for m in out if m in MODULES and m != module}


GRAPH = {m: imports(m) for m in MODULES}


def test_every_subpackage_has_a_layer():
    assert {unit(m) for m in MODULES} <= RANK.keys(), {unit(m) for m in MODULES} - RANK.keys()


def test_imports_go_down_the_layers():
    against = sorted(f"{m} -> {t}" for m, ts in GRAPH.items() for t in ts
                     if unit(m) != unit(t) and RANK[unit(t)] >= RANK[unit(m)])
    assert not against, "imports against the layer order:\n" + "\n".join(against)


def test_no_import_circles():
    """A package's ``__init__`` may import its own submodules (re-exports); every other
    circle is reported."""
    def edges(m):
        own = MODULES[m].name == "__init__.py"
        return {t for t in GRAPH[m] if not (own and t.startswith(m + "."))}

    circles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        stack.append(m)
        for t in sorted(edges(m)):
            if state.get(t) == "open":
                circles.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack)
        stack.pop()
        state[m] = "done"

    for m in sorted(MODULES):
        if m not in state:
            visit(m, [])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_checks_can_fail():
    """The walk sees lazy imports inside functions and relative imports (what it checks)."""
    assert "ds_autoplan.schedule.builders" in GRAPH["ds_autoplan.plan"] or \
        "ds_autoplan.schedule" in GRAPH["ds_autoplan.plan"]          # lazy, inside a method
    assert unit("ds_autoplan.runtime.deepspeed.engine") == "runtime.deepspeed"
    assert unit("ds_autoplan.runtime.memtrack") == "runtime.common"
    assert unit("ds_autoplan.runtime") == "runtime.common"
