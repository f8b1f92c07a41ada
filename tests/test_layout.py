"""The package's shape: `ls minikv/` reads as the course, no module is too long to read in one sitting,
and the imports between minikv's modules and kernels/ form no circle (function-level imports included:
an import hidden inside a function is still a dependency, and hiding one is how circles creep in)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("minikv", "kernels")
MAX_LINES = 600
TOO_LONG_FOR_NOW: set[str] = set()

# The stages' modules (README's stage table) and the subpackages named for their audience.
STAGE_MODULES = {"sizing", "contiguous", "blocks", "paged", "attention", "dispatch", "prefix", "sequence",
                 "sampling", "detokenizer", "scheduler", "runner", "engine", "metrics", "models", "demo",
                 "validation", "inputs", "outputs", "config"}
SUBPACKAGES = {"bench", "grading", "sim", "viz", "server", "speed"}


def module_files() -> dict[str, Path]:
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
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
    assert "kernels.paged_attention" not in graph["minikv.attention"]
    assert graph["minikv.attention"] <= {"minikv.blocks"}, "the reference is a leaf: it needs only stage 3's blocks"


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
