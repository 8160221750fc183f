"""The shape of the code, read from its source (spec/guides/architecture.md): no module reaches
into another's private names, and the core package's modules import one another without a
cycle (each concept has one home; both sides of a shared name import it from there)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("lean-image", "converters", "restore")  # leanimg, leanimg.converters, leanimg.restore
CORE = ROOT / "lean-image"

# _name attributes of objects other than self/cls that are public by convention, each with why
ALLOWED_ATTRIBUTES = {
    ("os", "_exit"): "the stdlib's exit without teardown (cli.run ends the process with it)",
    (None, "_asdict"): "namedtuple's public API, and format.Values' after it (the underscore only avoids field names)",
    (None, "_make"): "namedtuple's public API",
    (None, "_value2member_map_"): "enum's lookup of a member by value without raising (stdlib)",
}
# modules that may import a private name, each with why
ALLOWED_IMPORTS = {
    ("lean-image/native.py", "_native"): "the one importer of the C backend (native.py's docstring)",
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _product_modules() -> list[Path]:
    return sorted(p for folder in PRODUCT for p in (ROOT / folder).rglob("*.py"))


def _private_uses(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls") or (owner, node.attr) in ALLOWED_ATTRIBUTES:
                continue
            if (None, node.attr) in ALLOWED_ATTRIBUTES:
                continue
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if _private(alias.name) and (rel, alias.name) not in ALLOWED_IMPORTS:
                    found.append(f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                last = alias.name.rpartition(".")[2]
                if _private(last) and (rel, last) not in ALLOWED_IMPORTS:
                    found.append(f"{rel}:{node.lineno}: import {alias.name}")
    return found


def test_no_module_uses_another_modules_private_names():
    """A name with a leading underscore is its module's (or its class's) own: another module
    that needs it needs a public name, or the code belongs where the name is."""
    found = [use for path in _product_modules() for use in _private_uses(path)]
    assert not found, "private names used from outside their module:\n" + "\n".join(found)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(CORE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["leanimg", *parts])


def _runtime_nodes(tree: ast.AST):
    """Every node but those under ``if TYPE_CHECKING:``: imports that only type checkers run
    cannot make an import cycle at run time (mypy resolves them lazily)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def core_import_graph() -> dict[str, set[str]]:
    """Module -> the core modules it imports, at module level or inside functions (importing
    ``leanimg.a.b`` runs ``leanimg.a`` too; a module's own packages are not counted: Python
    runs them before it)."""
    paths = {_module_name(p): p for p in CORE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()

        def add(target: str) -> None:
            parts = target.split(".")
            edges.update(".".join(parts[:k]) for k in range(1, len(parts) + 1) if ".".join(parts[:k]) in paths)

        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                base = package[: len(package) - node.level + 1] if node.level else []
                target = ".".join(base + ([node.module] if node.module else []))
                if target.split(".")[0] != "leanimg":
                    continue
                add(target)
                for alias in node.names:
                    if f"{target}.{alias.name}" in paths:  # a submodule
                        add(f"{target}.{alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "leanimg":
                        add(alias.name)
        own = {".".join(name.split(".")[:k]) for k in range(1, len(name.split(".")) + 1)}
        graph[name] = edges - own
    return graph


def _a_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (its modules in order, the first repeated last), or None:
    a depth-first walk, each module left once all it imports is done."""
    done: set[str] = set()
    for start in sorted(graph):
        if start in done:
            continue
        path, todo = [start], [iter(sorted(graph[start]))]
        while todo:
            following = next(todo[-1], None)
            if following is None:
                done.add(path.pop())
                todo.pop()
            elif following in path:
                return path[path.index(following) :] + [following]
            elif following not in done and following in graph:
                path.append(following)
                todo.append(iter(sorted(graph[following])))
    return None


def test_the_core_imports_without_cycles():
    """No module of leanimg imports, directly or through others, a module that imports it:
    a name both need lives in one of them, or in a third they both import."""
    graph = core_import_graph()
    assert "leanimg.reader" in graph and "leanimg.chain" in graph  # the scan found the package
    cycle = _a_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    """The check above would see one (a module pair, and a longer loop beside a clean branch)."""
    assert _a_cycle({"a": {"b"}, "b": {"a"}}) == ["a", "b", "a"]
    assert _a_cycle({"a": {"b", "d"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
