"""Does a submission write its own answer, or hand the work to minikv's? A static look at its cells.

Each exercise's check module names the functions and classes it grades (``GRADED``) and minikv's
implementations of them (``FORBIDDEN``, dotted names such as ``minikv.sizing.kv_bytes_per_token``).
`find_delegation` reads the notebook's code cells with `ast` and flags a graded name when

* it *is* minikv's object (``from minikv.sizing import kv_bytes_per_token``, or ``f = sizing.f``);
* its code, or the code of any helper of the notebook that it uses, names a forbidden object
  (``minikv.sizing.kv_bytes_per_token(...)``, ``class MyBlockAllocator(BlockAllocator)``, ...),
  spells a forbidden name in a string (``getattr(sizing, "kv_bytes_per_token")``), or imports or
  evaluates code dynamically (``__import__``, ``importlib``, ``exec``, ``eval``, ``compile``).

Everything else of minikv stays usable (an exercise's docstring says what it allows). The sandbox
adds a runtime tripwire on the same forbidden names, for what a static look cannot see.
"""

from __future__ import annotations

import ast

DYNAMIC = {"__import__", "importlib", "exec", "eval", "compile", "globals", "vars", "__builtins__"}


def _parse(cells: list[str]) -> list[ast.Module]:
    trees = []
    for source in cells:
        source = "\n".join("" if ln.lstrip().startswith(("%", "!")) else ln for ln in source.splitlines())
        try:
            trees.append(ast.parse(source))
        except SyntaxError:
            continue  # the child reports it when the cell runs
    return trees


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


def find_delegation(cells: list[str], graded: list[str], forbidden: list[str]) -> dict[str, str]:
    """{graded name: why it is minikv's work, not the learner's}; empty when nothing is flagged."""
    if not graded or not forbidden:
        return {}
    trees = _parse(cells)
    aliases: dict[str, str] = {}   # local name -> dotted module path it stands for
    defs: dict[str, list[ast.AST]] = {}  # top-level name -> the nodes that bind it
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    aliases[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                defs.setdefault(node.name, []).append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                for t in targets:
                    for n in ast.walk(t):
                        if isinstance(n, ast.Name):
                            defs.setdefault(n.id, []).append(node)

    def resolve(dotted: str) -> str:
        head, _, rest = dotted.partition(".")
        base = aliases.get(head, head)
        return f"{base}.{rest}" if rest else base

    def is_forbidden(path: str) -> str | None:
        for f in forbidden:
            if path == f or path.startswith(f + "."):
                return f
        return None

    leaves = {f.rsplit(".", 1)[-1]: f for f in forbidden}

    def problem_in(node: ast.AST) -> str | None:
        for n in ast.walk(node):
            if isinstance(n, (ast.Name, ast.Attribute)):
                dotted = _dotted(n)
                if dotted:
                    hit = is_forbidden(resolve(dotted))
                    if hit:
                        return f"uses {hit}"
                    if dotted.split(".")[0] in DYNAMIC and dotted.split(".")[0] not in defs:
                        return f"uses {dotted.split('.')[0]} (graded code may not import or evaluate code dynamically)"
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in n.names]
                module = n.module if isinstance(n, ast.ImportFrom) else None
                for name in names:
                    path = f"{module}.{name}" if module else name
                    hit = is_forbidden(path)
                    if hit:
                        return f"imports {hit}"
            elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value in leaves:
                return f"names {leaves[n.value]} in a string"
        return None

    flagged: dict[str, str] = {}
    for name in graded:
        if name in aliases and is_forbidden(aliases[name]) and name not in defs:
            flagged[name] = f"`{name}` is minikv's {is_forbidden(aliases[name])}, imported: write your own"
            continue
        seen, todo = set(), [name]
        while todo and name not in flagged:
            current = todo.pop()
            if current in seen:
                continue
            seen.add(current)
            for node in defs.get(current, []):
                why = problem_in(node)
                if why:
                    via = "" if current == name else f" (through `{current}`)"
                    flagged[name] = f"`{name}`{via} {why}: write your own"
                    break
                # helpers of the notebook that this code uses are graded code too
                todo.extend(n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in defs)
    return flagged
