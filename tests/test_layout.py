"""The package's shape: `ls minikv/` reads as the course, no module is too long to read in one sitting,
and the imports between minikv's modules and kernels/ form no circle (function-level imports included:
an import hidden inside a function is still a dependency, and hiding one is how circles creep in)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"minikv": "minikv", "kernels": "minikv_kernels"}  # folder: import name (pyproject's package-dir)
MAX_LINES = 600
TOO_LONG_FOR_NOW: set[str] = set()

# The stages' modules (README's stage table) and the subpackages named for their audience.
STAGE_MODULES = {"sizing", "contiguous", "blocks", "paged", "attention", "dispatch", "prefix", "sequence",
                 "sampling", "detokenizer", "scheduler", "runner", "engine", "metrics", "models", "demo",
                 "validation", "inputs", "outputs", "config", "step"}
SUBPACKAGES = {"bench", "grading", "sim", "viz", "server", "speed", "lessons"}


def module_files() -> dict[str, Path]:
    files = {}
    for package, name in PACKAGES.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = [name, *path.relative_to(ROOT / package).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ours that ``name`` imports anywhere in its file (dotted names)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        targets = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        for target in targets:
            # the longest prefix that is one of our modules: `from minikv.sim import memory` -> minikv.sim.memory
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_kernel_and_reference_do_not_import_each_other_both_ways():
    graph = import_graph()
    assert "minikv_kernels.paged_attention" not in graph["minikv.attention"]
    assert graph["minikv.attention"] <= {"minikv.blocks", "minikv.step"}, (
        "the reference is a leaf: it needs only stage 3's blocks and the step contract's types")


def test_listing_the_package_shows_the_course():
    entries = {p.stem if p.is_file() else p.name for p in (ROOT / "minikv").iterdir()
               if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or (p / "__init__.py").exists())}
    modules = {p.stem for p in (ROOT / "minikv").glob("*.py") if not p.name.startswith("_")}
    packages = entries - modules
    assert modules <= STAGE_MODULES, ("not a stage's module, move it into a subpackage: "
                                      f"{sorted(modules - STAGE_MODULES)}")
    assert packages <= SUBPACKAGES, f"unexpected subpackage: {sorted(packages - SUBPACKAGES)}"
    assert {"grading", "sim", "viz", "bench"} <= packages


def test_no_module_is_too_long_to_read_in_one_sitting():
    long = {name: n for name, path in module_files().items() if (n := len(path.read_text().splitlines())) > MAX_LINES
            and name not in TOO_LONG_FOR_NOW}
    assert not long, f"modules over {MAX_LINES} lines (split them where they hold more than one idea): {long}"


def test_every_module_says_what_it_is_for():
    missing = [name for name, path in module_files().items()
               if path.stat().st_size and not ast.get_docstring(ast.parse(path.read_text()))]
    assert not missing, f"modules without a docstring: {missing}"


# Data flows one way (input -> scheduler -> block manager -> runner -> attention -> kernel): the scheduler
# decides block operations and the engine applies them through the runner, so the scheduler never imports it.
def test_the_scheduler_does_not_import_the_runner():
    graph = import_graph()
    assert "minikv.runner" not in graph["minikv.scheduler"], "the scheduler decides; the engine calls the runner"
    assert not any(m.startswith("minikv.speed") for m in graph["minikv.scheduler"])


# Everyone outside the engine reads it through `LLMEngine.stats()`; only the engine (and the scheduler and
# block manager themselves) touch the queues and the prefix cache's internals.
INSIDE = {"minikv.engine", "minikv.scheduler", "minikv.prefix"}
REACHING_IN = (r"\bscheduler\.(running|waiting|swapped)\b", r"\bbm\.cache\b", r"\.cache\.(evictable|by_hash|key_of)\b")


def reaching_in(source: str) -> list[str]:
    import re

    return [m.group(0) for pattern in REACHING_IN for m in re.finditer(pattern, source)]


def test_no_module_outside_the_engine_reaches_into_its_queues_or_cache():
    found = {name: hits for name, path in module_files().items()
             if name not in INSIDE and (hits := reaching_in(path.read_text()))}
    assert not found, f"read the engine through LLMEngine.stats() (or the BlockManager's methods) instead: {found}"


def test_the_reach_finder_finds_one():
    assert reaching_in("n = len(engine.scheduler.waiting) + len(bm.cache.evictable)") == [
        "scheduler.waiting", "bm.cache", ".cache.evictable"]
    assert reaching_in("n = engine.stats().waiting; sched.running_total") == []


# One attention backend: minikv.dispatch is the one chooser of Triton / C++ / gather, so it is the one
# module of the package that imports a kernel (the kernel benchmark measures them directly); and the
# runner's speed levers read the step layout from it, never the runner.
def test_only_the_dispatcher_imports_a_kernel_and_speed_does_not_import_the_runner():
    graph = import_graph()
    importers = {name for name, deps in graph.items() if name.startswith("minikv.")
                 and any(d.startswith("minikv_kernels") for d in deps)}
    assert importers <= {"minikv.dispatch", "minikv.bench.kernel"}, f"choose attention in minikv.dispatch: {importers}"
    speed = {name: deps for name, deps in graph.items() if name.startswith("minikv.speed")}
    assert not any("minikv.runner" in deps for deps in speed.values()), speed


# ---- the engine's boundaries ---------------------------------------------------------------------------
# Nothing outside the engine reads its queues, pool or runner: the demo, the pictures, the grader and the
# server read `LLMEngine.stats()` (a frozen snapshot), `pool_view()` (the pool block by block) and the step
# record `step()` returns; a policy is plugged in through `scheduler_cls`, never by replacing
# `engine.scheduler`; a stalled scheduler is told by its type (`SchedulerStalled`), not by its message.
ENGINE_INSIDES = {"bm", "scheduler", "runner", "swap", "requests", "step_stats", "output_processor",
                  "k_pools", "v_pools", "k_stores", "v_stores"}
OUTSIDE_THE_ENGINE = ["minikv/demo.py", "minikv/viz", "minikv/grading", "minikv/server"]


def _is_an_engine(node: ast.AST) -> bool:
    """`engine`, `eng`, or anything `.engine` (llm.engine, loop.engine, state.engine)."""
    return (isinstance(node, ast.Name) and node.id in ("engine", "eng")) or (
        isinstance(node, ast.Attribute) and node.attr == "engine")


def test_nothing_outside_the_engine_reads_its_insides():
    crossings = []
    for where in OUTSIDE_THE_ENGINE:
        path = ROOT / where
        for file in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Attribute) and node.attr in ENGINE_INSIDES and _is_an_engine(node.value):
                    crossings.append(f"{file.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not crossings, "read the engine through stats(), pool_view() or step()'s record:\n" + "\n".join(crossings)


def _engine_messages() -> list[str]:
    """The string pieces of every exception the engine's modules raise."""
    pieces = []
    for name in ("engine", "scheduler", "inputs", "runner", "prefix", "blocks"):
        for node in ast.walk(ast.parse((ROOT / "minikv" / f"{name}.py").read_text())):
            if isinstance(node, ast.Raise) and node.exc is not None:
                pieces += [c.value for c in ast.walk(node.exc)
                           if isinstance(c, ast.Constant) and isinstance(c.value, str)]
    return pieces


def test_no_caller_matches_the_engines_error_text():
    """An engine error is told by its type: no module outside the engine looks for a piece of its message."""
    messages, matches = _engine_messages(), []
    for where in OUTSIDE_THE_ENGINE:
        path = ROOT / where
        for file in ([path] if path.is_file() else sorted(path.rglob("*.py"))):
            for node in ast.walk(ast.parse(file.read_text())):
                if (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                        and isinstance(node.left.value, str) and len(node.left.value) >= 12
                        and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
                        and any(node.left.value in m for m in messages)):
                    matches.append(f"{file.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not matches, "match the engine's exception by its type, not its text:\n" + "\n".join(matches)
