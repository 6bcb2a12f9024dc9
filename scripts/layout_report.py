"""How readable the tree is, in numbers: the figures the layout step is judged by.

Prints modules over 600 lines (generated stubs aside), ``vqserve`` imports made inside
functions rather than at module top, import circles between modules (strongly connected
components of the module import graph, counting in-function imports too), and rings between
folders: the same graph with each folder inside a room (``serve/api/``, ``serve/engine/``,
``model/families/``, ...) taken as one node and each module directly in a room as its own
(``serve/grpc_server.py``), so ``serve/api/`` <-> ``serve/engine/`` is a ring even where no
two modules import each other. Reads the source tree with ``ast`` through the package-dir
mapping in pyproject.toml; imports nothing of it.

    python scripts/layout_report.py          # the figures
    python scripts/layout_report.py --list   # and what they count
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 600


def module_files() -> dict[str, Path]:
    """Every project module by its installed name (``vqserve.serve.engine.engine``)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping = config.get("package-dir", {})
    modules = {}
    for package in config["packages"]:
        top = max((p for p in mapping if package == p or package.startswith(p + ".")),
                  key=len, default=None)
        rel = mapping[top] + package[len(top):].replace(".", "/") if top else package.replace(".", "/")
        folder = ROOT / rel
        for path in sorted(folder.glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


def imports_of(tree: ast.Module, name: str, is_package: bool):
    """(imported module, inside a function?) for every import in one module."""
    package = name if is_package else name.rpartition(".")[0]

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield alias.name, in_function
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    base = ".".join(parts[: len(parts) - child.level + 1] + ([base] if base else []))
                for alias in child.names:
                    yield f"{base}.{alias.name}", in_function
                    yield base, in_function
            else:
                yield from visit(child, nested)

    yield from visit(tree, False)


def count_in_function_statements(tree: ast.Module) -> int:
    """Import statements of ``vqserve`` modules inside a function body."""
    count = 0
    for function in ast.walk(tree):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(function):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("vqserve"):
                count += 1
            elif isinstance(node, ast.Import) and any(a.name.startswith("vqserve") for a in node.names):
                count += 1
    return count


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]
    sys.setrecursionlimit(10000)

    def connect(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def import_graph(modules: dict[str, Path]) -> tuple[dict[str, set[str]], list[tuple[str, str]], int]:
    """The module import graph (every import, in functions too), the (module, target) pairs
    imported inside a function, and the count of in-function import statements."""
    graph, in_function, statements = {}, [], 0
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        statements += count_in_function_statements(tree)
        edges = set()
        for target, nested in imports_of(tree, name, path.stem == "__init__"):
            if target in modules and target != name:
                edges.add(target)
                if nested:
                    in_function.append((name, target))
        graph[name] = edges
    return graph, in_function, statements


def folder_of(name: str, packages: set[str]) -> str:
    """The node a module counts as among folders: its folder inside a room
    (``vqserve.serve.api.codec`` -> ``vqserve.serve.api``), or itself where it lies directly
    in a room (``vqserve.serve.grpc_server``) or is one (``vqserve.serve``)."""
    parts = name.split(".")
    folder = ".".join(parts[:3])
    return folder if len(parts) >= 3 and folder in packages else name


def folder_rings(graph: dict[str, set[str]], modules: dict[str, Path]) -> list[list[str]]:
    """Import rings between folders (see the module docstring), each sorted."""
    packages = {name for name, path in modules.items() if path.stem == "__init__"}
    folders: dict[str, set[str]] = {}
    for name, targets in graph.items():
        node = folder_of(name, packages)
        edges = folders.setdefault(node, set())
        edges.update(folder_of(target, packages) for target in targets)
        edges.discard(node)
    return strongly_connected(folders)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--list", action="store_true", help="also list what each figure counts")
    args = parser.parse_args(argv)
    modules = module_files()
    long_modules = []
    for name, path in modules.items():
        lines = path.read_text().count("\n")
        if lines > LIMIT and "_proto" not in name:
            long_modules.append((lines, name))
    # statements: in-function import statements naming a project module
    graph, in_function, statements = import_graph(modules)
    # an import of a package is an import of its __init__ only; a circle through one is real
    circles = strongly_connected(graph)
    rings = folder_rings(graph, modules)
    unique_in_function = sorted(set(in_function))
    print(f"modules: {len(modules)}")
    print(f"modules over {LIMIT} lines: {len(long_modules)}")
    print(f"in-function vqserve import statements: {statements} "
          f"({len(unique_in_function)} distinct module -> module pairs)")
    print(f"import circles: {len(circles)}")
    print(f"folder rings: {len(rings)}")
    if args.list:
        for lines, name in sorted(long_modules, reverse=True):
            print(f"  long  {lines:5d} {name}")
        for circle in circles:
            print("  circle " + " <-> ".join(circle))
        for ring in rings:
            print("  ring   " + " <-> ".join(ring))
        for name, target in unique_in_function:
            print(f"  lazy  {name} -> {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
