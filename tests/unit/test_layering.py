"""The package's layers point down, and the pure layers load without torch or deepspeed.

Every module of ``ds_resilience/`` is parsed with :mod:`ast`; every import of a ``ds_resilience``
module (module-level, function-local and ``if TYPE_CHECKING`` ones alike; relative imports
resolved) is an edge of the module graph. Each edge must point to the same or a lower layer of
:data:`LAYERS`, and the graph must have no cycle. The documentation's layer page (docs/reference/layers.md)
is generated from :data:`LAYERS` when the site is built (docs/hooks/reference.py), so it cannot drift.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = "ds_resilience"
PACKAGE_DIR = Path(__file__).resolve().parents[2] / ROOT

LAYERS: dict[str, int] = {
    # L0: pure values and the schedule IR (with its timeline replay, windows and Gantt chart)
    "ds_resilience.errors": 0,
    "ds_resilience.topology": 0,
    "ds_resilience.costs": 0,
    "ds_resilience.argtypes": 0,
    "ds_resilience.vocab": 0,
    "ds_resilience.config": 0,
    "ds_resilience.launch": 0,
    "ds_resilience.store_keys": 0,
    "ds_resilience.epochs": 0,
    "ds_resilience.logs": 0,
    "ds_resilience.durable": 0,
    "ds_resilience.polling": 0,
    "ds_resilience.job_secret": 0,  # the job's secret and sealed values: agents and workers alike
    "ds_resilience.ir": 0,
    # L1: schedule generators, the planner, the plan table, placement
    "ds_resilience.planning": 1,
    # L2: the failure-trace simulator
    "ds_resilience.sim": 2,
    # L3: copy kernels, and the device operations (DeepSpeed's accelerator) they and the layers above use
    "ds_resilience.kernels": 3,
    "ds_resilience.accelerator": 3,
    # L4: communication
    "ds_resilience.comm": 4,
    # L5: checkpoint tiers
    "ds_resilience.checkpoint": 5,
    # L6: the runtime, the workers' side (executor, recovery, coordinator, membership, a worker's boot)
    "ds_resilience.runtime": 6,
    # L7: the supervisor (the agent's process: agent, nodes, spawning, `run`'s CLI; worker code never
    # imports it), framework integrations, the command line, the demo, and the package root (its __init__)
    "ds_resilience.supervisor": 7,
    "ds_resilience.integrations": 7,
    "ds_resilience.megatron": 7,
    "ds_resilience.cli": 7,
    "ds_resilience.demo": 7,
    "ds_resilience": 7,
}
"""Layer of each module, by longest prefix (dotted components); the root matches only itself."""

SUPERVISOR = "ds_resilience.supervisor"
"""Runs in the agent process only: worker code never imports it, whatever its layer."""
IMPORT_SUPERVISOR = ("ds_resilience.supervisor", "ds_resilience.cli", "ds_resilience.demo")
"""The modules that may import the supervisor (itself, and the command line and demo that start it)."""




# --------------------------------------------------------------------------------- the checker
def layer_of(module: str) -> int | None:
    """Layer of ``module`` by longest-prefix match on :data:`LAYERS`; ``None`` if unmapped."""
    if module == ROOT:
        return LAYERS[ROOT]
    parts = module.split(".")
    for n in range(len(parts), 1, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    return None


def discover(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, is_package) for every ``.py`` file of the package."""
    out: dict[str, tuple[Path, bool]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir.parent).with_suffix("")
        parts = list(rel.parts)
        if "__pycache__" in parts:
            continue
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def _in_package(name: str) -> bool:
    return name == ROOT or name.startswith(ROOT + ".")


def _resolve(name: str, known: set[str]) -> str:
    """``name`` if it is a module, else its closest enclosing module (a name imported from it).

    A name under no module but the root (say a compiled extension, or a module not written yet)
    stays as it is: it is a leaf of the graph, laid out by its prefix.
    """
    if name in known:
        return name
    parts = name.split(".")
    for n in range(len(parts) - 1, 1, -1):
        parent = ".".join(parts[:n])
        if parent in known:
            return parent
    return name


def imports_in_source(module: str, source: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The ``ds_resilience`` modules that ``module`` (its ``source``) imports anywhere in its body."""
    package = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_package(alias.name):
                    found.add(_resolve(alias.name, known))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                if node.level - 1 >= len(parts):
                    continue  # beyond the top: not ours
                base = ".".join(parts[: len(parts) - (node.level - 1)])
                if node.module:
                    base = f"{base}.{node.module}"
            else:
                base = node.module or ""
            if not _in_package(base):
                continue
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                if candidate in known:
                    found.add(candidate)  # a submodule
                elif alias.name != "*" and (module == base or module.startswith(base + ".")):
                    # from an enclosing package, a name that is no .py module: a compiled or missing
                    # submodule (the enclosing package is already imported when this module runs)
                    found.add(candidate)
                else:
                    found.add(_resolve(base, known))
    found.discard(module)
    return found


def build_graph(package_dir: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    """Module -> the ``ds_resilience`` modules it imports."""
    modules = discover(package_dir)
    known = set(modules)
    return {
        name: imports_in_source(name, path.read_text(), known, is_package=is_package)
        for name, (path, is_package) in modules.items()
    }


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Edges that point to a higher layer (or to an unmapped module)."""
    out = set()
    for src, targets in graph.items():
        src_layer = layer_of(src)
        for dst in targets:
            dst_layer = layer_of(dst)
            if src_layer is None or dst_layer is None or dst_layer > src_layer:
                out.add((src, dst))
    return out


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def supervisor_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """Edges into the supervisor from a module that may run in a worker (any outside
    :data:`IMPORT_SUPERVISOR`: runtime, integrations, megatron, checkpoint, comm, the root, ...)."""
    return {(src, dst) for src, targets in graph.items() for dst in targets
            if _within(dst, SUPERVISOR) and not any(_within(src, p) for p in IMPORT_SUPERVISOR)}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None`` if the graph has none."""
    WHITE, GREY, BLACK = 0, 1, 2
    color = {n: WHITE for n in graph}
    for start in sorted(graph):
        if color[start] != WHITE:
            continue
        path = [start]
        stack = [iter(sorted(graph.get(start, ())))]
        color[start] = GREY
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                color[path.pop()] = BLACK
                continue
            state = color.get(nxt, WHITE)
            if state == GREY:
                return path[path.index(nxt):] + [nxt]
            if state == WHITE:
                color[nxt] = GREY
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def _layered(edges) -> str:
    return "\n".join(f"  {a} (L{layer_of(a)}) -> {b} (L{layer_of(b)})" for a, b in sorted(edges))


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return build_graph()


# --------------------------------------------------------------------------------- the rules
def test_every_module_has_a_layer(graph):
    unmapped = sorted(m for m in graph if layer_of(m) is None)
    assert not unmapped, f"modules with no layer (add them to LAYERS): {unmapped}"


def test_imports_point_down(graph):
    found = upward_imports(graph)
    assert not found, f"imports of a higher layer:\n{_layered(found)}"


def test_no_import_cycle(graph):
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_worker_code_never_imports_the_supervisor(graph):
    assert any(_within(m, SUPERVISOR) for m in graph), "no supervisor modules found"
    found = supervisor_imports(graph)
    assert not found, "worker code imports the supervisor (the agent's process):\n" + "\n".join(
        f"  {a} -> {b}" for a, b in sorted(found))


# ------------------------------------------------------------------------- the checker checked
def test_checker_reports_a_synthetic_upward_import(graph):
    edge = ("ds_resilience.ir.schedule", "ds_resilience.planning.planner")
    assert edge not in upward_imports(graph)
    bad = {k: set(v) for k, v in graph.items()}
    bad[edge[0]].add(edge[1])
    assert upward_imports(bad) - upward_imports(graph) == {edge}


def test_checker_reports_a_synthetic_supervisor_import(graph):
    edges = {("ds_resilience.runtime.membership", "ds_resilience.supervisor.agent"),
             ("ds_resilience.integrations.deepspeed", "ds_resilience.supervisor"),
             ("ds_resilience", "ds_resilience.supervisor.cli")}
    allowed = {("ds_resilience.cli", "ds_resilience.supervisor.cli"),
               ("ds_resilience.demo", "ds_resilience.supervisor.agent"),
               ("ds_resilience.supervisor.cli", "ds_resilience.supervisor.agent")}
    bad = {k: set(v) for k, v in graph.items()}
    for src, dst in edges | allowed:
        bad.setdefault(src, set()).add(dst)
    assert supervisor_imports(bad) - supervisor_imports(graph) == edges


def test_checker_reports_a_synthetic_cycle(graph):
    assert "ds_resilience.ir.action" in graph["ds_resilience.ir.schedule"]
    bad = {k: set(v) for k, v in graph.items()}
    bad["ds_resilience.ir.action"].add("ds_resilience.ir.schedule")
    cycle = find_cycle(bad)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"ds_resilience.ir.action", "ds_resilience.ir.schedule"} <= set(cycle)
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_parser_sees_every_kind_of_import():
    known = {"ds_resilience", "ds_resilience.kernels", "ds_resilience.kernels.copy", "ds_resilience.kernels.layout",
             "ds_resilience.ir", "ds_resilience.planning", "ds_resilience.planning.planner", "ds_resilience.runtime",
             "ds_resilience.runtime.groups", "ds_resilience.errors"}
    source = (
        "from typing import TYPE_CHECKING\n"
        "import os\n"
        "from ..errors import ResilienceError\n"
        "from .layout import ChunkLayout\n"
        "if TYPE_CHECKING:\n"
        "    from ..planning.planner import Plan\n"
        "def f():\n"
        "    import ds_resilience.runtime.groups\n"
        "    from ..ir import Action\n"
        "    from . import _copy_cuda\n"
    )
    found = imports_in_source("ds_resilience.kernels.copy", source, known)
    assert found == {"ds_resilience.errors", "ds_resilience.kernels.layout", "ds_resilience.planning.planner",
                     "ds_resilience.runtime.groups", "ds_resilience.ir", "ds_resilience.kernels._copy_cuda"}
    init = imports_in_source("ds_resilience.kernels", "from .copy import copy_chunk\nfrom . import layout\n", known,
                             is_package=True)
    assert init == {"ds_resilience.kernels.copy", "ds_resilience.kernels.layout"}
    assert upward_imports({"ds_resilience.kernels.copy": found}) == {
        ("ds_resilience.kernels.copy", "ds_resilience.runtime.groups")}


def test_layer_map_is_longest_prefix():
    assert layer_of("ds_resilience") == 7
    assert layer_of("ds_resilience.ir.timeline") == 0
    assert layer_of("ds_resilience.planning") == 1
    assert layer_of("ds_resilience.comm.groups") == 4
    assert layer_of("ds_resilience.integrations.ds_checkpoint_engine") == 7
    assert layer_of("ds_resilience.irregular") is None
    assert layer_of("ds_resilience.cli") == 7


# ------------------------------------------------------------------------ heavy imports stay out
PURE = [
    "ds_resilience",
    "ds_resilience.vocab",
    "ds_resilience.ir",
    "ds_resilience.ir.timeline",
    "ds_resilience.ir.windows",
    "ds_resilience.ir.gantt",
    "ds_resilience.planning",
    "ds_resilience.sim",
    "ds_resilience.topology",
    "ds_resilience.config",
    "ds_resilience.costs",
    "ds_resilience.errors",
    "ds_resilience.cli",
    "ds_resilience.supervisor.cli",  # `run`'s parser: the CLI reference is rendered from it
    "ds_resilience.megatron",  # the argument hooks run inside Megatron's parser, before anything is built
]
HEAVY = ["torch", "deepspeed", "megatron", "triton", "matplotlib"]
NO_DEEPSPEED = {
    "ds_resilience.checkpoint.persistent": ["deepspeed", "megatron"],  # torch is fine: it writes tensors
}


def _heavy_imported(module: str, heavy: list[str]) -> str:
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        f"bad = [m for m in {heavy!r} if m in sys.modules]\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_heavy_package(module):
    bad = _heavy_imported(module, HEAVY)
    assert bad == "", f"{module} imported {bad}"


@pytest.mark.parametrize("module", sorted(NO_DEEPSPEED))
def test_module_imports_no_deepspeed(module):
    bad = _heavy_imported(module, NO_DEEPSPEED[module])
    assert bad == "", f"{module} imported {bad}"


def test_plan_command_does_not_import_torch():
    code = (
        "import sys, io, contextlib\n"
        "from ds_resilience.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    main(['plan', '--dp', '2', '--pp', '3', '--microbatches', '4', '--json'])\n"
        "print('torch' in sys.modules, 'deepspeed' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False False"
