"""No import cycle among the product packages (lora/, workers/, deployments/). A module importing one that imports
it back works only by the order in which things happen to load; the last one hid in a function (lora/ops.py's
by-name dispatch imported lora.backends, whose kernels import lora.ops; issue 40). So the graph is read from the
sources and every import statement counts, those inside functions too; only `if TYPE_CHECKING:` blocks, which never
run, do not. `from package import name` is an edge to package.name where that is a module, else to the package.
"""
from __future__ import annotations

import ast
from pathlib import Path

from processes import REPO

PACKAGES = ("lora", "workers", "deployments")


def module_names(root: Path) -> dict[str, Path]:
    names = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _statements(node: ast.AST):
    """The import statements under node, skipping `if TYPE_CHECKING:` bodies."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and ast.unparse(child.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            yield from (s for orelse in child.orelse for s in _statements(orelse))
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield child
        yield from _statements(child)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """module -> {product module it imports: the line of the first such import}."""
    modules = module_names(root)
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = graph[name] = {}
        for statement in _statements(ast.parse(path.read_text(), str(path))):
            if isinstance(statement, ast.Import):
                targets = [alias.name for alias in statement.names]
            else:
                base = statement.module or ""
                if statement.level:   # relative: from the importing module's package upwards
                    parent = package.split(".")[:len(package.split(".")) - statement.level + 1]
                    base = ".".join([*parent, *([statement.module] if statement.module else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in statement.names]
            for target in targets:
                while target and target not in modules:   # `import lora.ops.x` style: the module part
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, statement.lineno)
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """A cycle as the modules along it (the first repeated at the end), or None."""
    state: dict[str, str] = {}   # "open" while on the current path, "done" once all it reaches is cycle-free
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in graph.get(module, {}):
            if state.get(target) == "open":
                return path[path.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        state[module] = "done"
        path.pop()
        return None

    for module in graph:
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_the_reading_finds_imports_at_the_top_in_functions_and_not_under_type_checking():
    graph = import_graph(REPO)
    assert {"lora.ops", "lora.batch"} <= graph["lora.backends.base"].keys()        # at the top
    assert "lora.backends.torch_native" in graph["lora.backends"]                   # inside get_backend
    assert "lora.backends.cpu_sgmv" in graph["workers.models.moe_fused"]            # from package import module
    assert not {"workers.engine", "workers.core"} & graph["workers.async_engine"].keys()   # TYPE_CHECKING only
    assert find_cycle({"a": {"b": 1}, "b": {"c": 2}, "c": {"a": 3}, "d": {}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b": 1}, "b": {}, "c": {"a": 1, "b": 2}}) is None


def test_no_import_cycle_among_the_product_modules():
    graph = import_graph(REPO)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(
        f"{module} (line {graph[module][target]})" for module, target in zip(cycle, cycle[1:])) + f" -> {cycle[-1]}"
