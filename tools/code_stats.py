"""Structure figures of the source tree, the ones the restructuring reviews quote.

    python tools/code_stats.py                      # cua_jax/ tools/ launch/ envs/
    python tools/code_stats.py cua_jax tools --json
    python tools/code_stats.py --cycles             # module-level import cycles, whole repo

Per folder: lines, functions over 60 lines (and per 1k lines), the largest module and class,
function-local project imports (an ``import`` inside a function body that names one of this
repo's packages; per 1k lines) and the formatter's skip markers (``FMT_SKIP``). Lines are
physical lines of the ``.py`` files, as ``wc -l`` counts them. ``--cycles`` lists the import
cycles between modules (module-level imports only: the ones that run when a module loads).
Only the standard library's ``ast`` is used.
"""

from __future__ import annotations

import argparse
import ast
import json
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("cua_jax", "envs", "launch", "tools", "configs")
LONG_FUNCTION = 60
FMT_SKIP = "# fmt:" + " skip"  # split so that this file does not count itself


def _is_project(module: str | None) -> bool:
    return bool(module) and module.split(".")[0] in PROJECT_PACKAGES


def _local_project_imports(tree: ast.AST) -> list[int]:
    """Line numbers of project imports made inside a function body."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom) and (node.level or _is_project(node.module)):
                found.append(node.lineno)
            elif isinstance(node, ast.Import) and any(_is_project(a.name) for a in node.names):
                found.append(node.lineno)
    return sorted(set(found))  # a nested function is walked twice


def file_stats(path: pathlib.Path) -> dict:
    """Figures of one ``.py`` file: lines, long functions, classes, local imports, skips."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    functions = [
        (n.name, n.end_lineno - n.lineno + 1)
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
    ]
    classes = [
        (n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(tree) if isinstance(n, ast.ClassDef)
    ]
    return {
        "lines": len(text.splitlines()),
        "long_functions": [(name, n) for name, n in functions if n > LONG_FUNCTION],
        "classes": classes,
        "local_imports": _local_project_imports(tree),
        "fmt_skip": text.count(FMT_SKIP),
    }


def folder_stats(folder: pathlib.Path) -> dict:
    """Totals of every ``.py`` file under ``folder``, with the largest module and class."""
    lines = long_fns = local = skips = 0
    largest_module, largest_class = ("", 0), ("", 0)
    long_list = []
    for path in sorted(folder.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        s = file_stats(path)
        lines += s["lines"]
        long_fns += len(s["long_functions"])
        long_list += [f"{rel}:{name} ({n})" for name, n in s["long_functions"]]
        local += len(s["local_imports"])
        skips += s["fmt_skip"]
        if s["lines"] > largest_module[1]:
            largest_module = (rel, s["lines"])
        for name, n in s["classes"]:
            if n > largest_class[1]:
                largest_class = (f"{rel}:{name}", n)
    per_k = 1000 / max(lines, 1)
    return {
        "lines": lines,
        "functions_over_60": long_fns,
        "functions_over_60_per_1k": round(long_fns * per_k, 2),
        "local_project_imports": local,
        "local_project_imports_per_1k": round(local * per_k, 2),
        "fmt_skip": skips,
        "largest_module": list(largest_module),
        "largest_class": list(largest_class),
        "long_functions": long_list,
    }


def _module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(tree: ast.Module, modules: set[str] | dict) -> list[str]:
    """Modules named by the imports that run when the module loads (not inside a def or class;
    inside an `if` or `try` they count): `from p import m` names the module p.m when there is
    one, else p (a package's `__init__` running first is not counted as an edge to it)."""
    names: list[str] = []
    stack: list[ast.AST] = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names += [m for m in subs if m in modules]
            if any(m not in modules for m in subs):
                names.append(node.module)
        else:
            stack.extend(ast.iter_child_nodes(node))
    return names


def import_cycles(root: pathlib.Path = ROOT) -> list[list[str]]:
    """The import cycles between the project's modules under `root` (strongly connected
    components of more than one module in the graph of module-level imports), each sorted."""
    mods = {}
    for pkg in PROJECT_PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            mods[_module_name(path, root)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target in _top_level_imports(ast.parse(path.read_text(), filename=str(path)), mods):
            if target in mods and target != name:
                graph[name].add(target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    """Print the figures of each folder named (default: the four source folders)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="*", default=["cua_jax", "tools", "launch", "envs"])
    parser.add_argument("--json", action="store_true", help="one JSON object, folder -> figures")
    parser.add_argument("--long", action="store_true", help="list the functions over 60 lines")
    parser.add_argument(
        "--cycles", action="store_true", help="list the module-level import cycles (whole repo)"
    )
    args = parser.parse_args(argv)
    if args.cycles:
        cycles = import_cycles()
        for c in cycles:
            print(" <-> ".join(c))
        print(f"{len(cycles)} import cycles between modules")
        return 0
    out = {}
    for name in args.folders:
        folder = ROOT / name
        if not folder.is_dir():
            parser.error(f"{name}: not a folder under {ROOT}")
        out[name] = folder_stats(folder)
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for name, s in out.items():
        print(
            f"{name}: {s['lines']} lines; functions over 60 lines {s['functions_over_60']}"
            f" ({s['functions_over_60_per_1k']}/1k); local project imports"
            f" {s['local_project_imports']} ({s['local_project_imports_per_1k']}/1k);"
            f" fmt-skip markers {s['fmt_skip']}; largest module {s['largest_module'][0]}"
            f" ({s['largest_module'][1]}); largest class {s['largest_class'][0]}"
            f" ({s['largest_class'][1]})"
        )
        if args.long:
            print("  " + "\n  ".join(s["long_functions"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
