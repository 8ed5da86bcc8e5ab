"""The package's layout, read from the source: no import cycle between modules, the low layers
(kernels/, models/) import nothing from the packages built on them, and no source file or function
longer than a reader can hold (600 lines a Python file, 800 a C++ one, 80 a function). Every import counts, at module
level or inside a function (parsed with ast, nothing is imported), except those under
`if TYPE_CHECKING:` for the cycle check (they never run). The helpers (python_modules,
import_graph) walk every module, for any check of the tree's shape."""

import ast
from pathlib import Path

PACKAGE = "specdec"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

# The packages and modules built on the runtime's low layers (the bare package is the public API,
# which loads everything), and what each low layer must not import.
UPPER = (
    "specdec",
    "specdec.api",
    "specdec.bench",
    "specdec.cli",
    "specdec.drafters",
    "specdec.heads",
    "specdec.loop",
    "specdec.server",
    "specdec.train",
)
NOT_IMPORTED_BY = {
    "specdec.kernels": ("specdec.models", *UPPER),  # models run on the kernels
    "specdec.models": UPPER,
}


def python_modules() -> dict[str, Path]:
    """Every module of the package: dotted name -> file (a package is its __init__.py)."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _import_nodes(tree: ast.AST, skip_type_checking: bool):
    """Import / ImportFrom nodes anywhere in `tree` (function bodies included)."""

    def is_type_checking(test: ast.expr) -> bool:
        return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )

    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        if skip_type_checking and isinstance(node, ast.If) and is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def imports_of(name: str, path: Path, modules: dict[str, Path], skip_type_checking: bool = False) -> set[str]:
    """The package's modules that module `name` imports: `from X import y` is X.y when that is a
    module, else X; relative imports are resolved; other packages are left out."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path)), skip_type_checking):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = package.rsplit(".", node.level - 1)[0] if node.level else ""
        source = ".".join(part for part in (base, node.module) if part)
        found.update(f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source for alias in node.names)
    return {module for module in found if module in modules}


def import_graph(skip_type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    modules = python_modules()
    return {name: imports_of(name, path, modules, skip_type_checking) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (or a module importing itself)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node: str) -> None:  # Tarjan
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while not component or component[-1] != node:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or node in graph[node]:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def test_the_helpers_see_imports_inside_functions_and_resolve_relative_ones(tmp_path):
    module = tmp_path / "x.py"
    module.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\n"
                      "def f():\n    from . import b\n    import p.c\n")
    modules = {name: tmp_path / f"{name}.py" for name in ("p.x", "p.a", "p.b", "p.c")}
    assert imports_of("p.x", module, modules) == {"p.a", "p.b", "p.c"}
    assert imports_of("p.x", module, modules, skip_type_checking=True) == {"p.b", "p.c"}
    graph = import_graph()
    assert "specdec.kernels.backends" in graph["specdec.kernels"]  # `from .backends import ...`
    assert "specdec.models.gguf" in graph["specdec.models.llama"]  # imported inside load_native
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}, "b": set()}) == [["a"]]


def test_no_import_cycle():
    found = cycles(import_graph(skip_type_checking=True))
    assert not found, "modules that import each other (directly or around a loop): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def within(module: str, package: str) -> bool:
    """Whether `module` is `package` or one of its submodules (the bare package has no submodules here)."""
    return module == package or (package != PACKAGE and module.startswith(package + "."))


def test_kernels_and_models_import_nothing_above_them():
    upward = sorted(
        f"{name} imports {module}"
        for name, imported in import_graph().items()
        for layer, above in NOT_IMPORTED_BY.items()
        if within(name, layer)
        for module in imported
        if any(within(module, package) for package in above)
    )
    assert not upward, "\n".join(upward)


# ---------------------------------------------------------------------------- sizes a reader can hold
MAX_FILE_LINES = {".py": 600, ".cpp": 800, ".h": 800}
MAX_FUNCTION_LINES = 80
SOURCE_DIRS = (PACKAGE_DIR, PACKAGE_DIR.parent / "tests", PACKAGE_DIR.parent / "scripts")


def source_files() -> list[Path]:
    return sorted(path for root in SOURCE_DIRS for path in root.rglob("*") if path.suffix in MAX_FILE_LINES)


def long_functions(path: Path, limit: int) -> list[str]:
    """'file:line name (N lines)' for every function or method of `path` longer than `limit` lines."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > limit:
                found.append(f"{path.name}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_the_size_checks_see_a_long_function(tmp_path):
    source = tmp_path / "long.py"
    source.write_text("def short():\n    return 1\n\n\ndef long():\n" + "    x = 1\n" * 5 + "    return x\n")
    assert long_functions(source, 6) == ["long.py:5 long (7 lines)"] and long_functions(source, 7) == []


def test_no_file_or_function_too_long_to_read():
    files = source_files()
    assert len(files) > 50  # the walk found the tree
    too_long = [f"{path.relative_to(PACKAGE_DIR.parent)} ({lines} lines)" for path in files
                if (lines := len(path.read_text().splitlines())) > MAX_FILE_LINES[path.suffix]]
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"
    functions = [entry for path in files if path.suffix == ".py" for entry in long_functions(path, MAX_FUNCTION_LINES)]
    assert not functions, f"functions over {MAX_FUNCTION_LINES} lines: {functions}"
