"""The package's layers, read from its source: imports only go down, there is no import cycle,
and the library never imports the tooling (function-level imports included)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = {"attnperf": ROOT / "attnperf", "attnperf.kernels": ROOT / "kernels"}

# Bottom to top; a module may import its own layer's modules and those below. A pattern
# ending in ".*" covers a package's modules.
LAYERS = (
    ("machine and layouts", ("attnperf.version", "attnperf.machine", "attnperf.layouts")),
    ("inputs",
     ("attnperf.inputs", "attnperf.serving", "attnperf.linear_inputs", "attnperf.cpu_table")),
    ("backend contract", ("attnperf.backend",)),
    ("kernels", ("attnperf.kernels", "attnperf.kernels.*")),
    ("dispatch", ("attnperf.dispatch", "attnperf.plans")),
    ("ops and api", ("attnperf.ops", "attnperf.api", "attnperf.testing")),
    ("nn, distributed, integrations",
     ("attnperf.nn", "attnperf.distributed", "attnperf.integrations", "attnperf.integrations.*",
      "attnperf")),
    ("tooling", ("attnperf.bench", "attnperf.bench.*", "attnperf.warmup", "attnperf.cli",
                 "attnperf.__main__")),
)  # fmt: skip
TOOLING = LAYERS[-1][0]


def module_files() -> dict[str, Path]:
    """Every module of the package by its installed name."""
    modules = {}
    for package, folder in SOURCES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join([package, *parts])] = path
    return modules


MODULES = module_files()


def imported_modules(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports anywhere in its source (functions too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # A name that is no module is the module's (or the package's __init__'s) own.
            targets = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def layer_of(module: str) -> int:
    for index, (_, patterns) in enumerate(LAYERS):
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and module.startswith(pattern[:-1])):
                return index
    raise LookupError(module)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as [a, b, ..., a], or None."""
    state = dict.fromkeys(graph, "new")
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for target in sorted(graph[node]):
            if state[target] == "open":
                return [*stack[stack.index(target) :], target]
            if state[target] == "new" and (cycle := visit(target)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if state[node] == "new" and (cycle := visit(node)):
            return cycle
    return None


def test_the_source_is_read():
    """The walk sees the modules and the imports it guards (so the checks below can fail)."""
    assert {"attnperf.dispatch", "attnperf.kernels.numba.attention", "attnperf.cli"} <= set(MODULES)
    assert "attnperf.cpu_table" in GRAPH["attnperf.dispatch"]
    assert "attnperf.kernels.numba.tiles" in GRAPH["attnperf.kernels.numba.attention"]


def test_every_module_has_a_layer():
    unplaced = []
    for module in MODULES:
        try:
            layer_of(module)
        except LookupError:
            unplaced.append(module)
    assert not unplaced, f"place these modules in a layer of {__name__}.LAYERS: {unplaced}"


def test_no_import_cycle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_only_go_down():
    upward = [
        f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
        for module, targets in GRAPH.items()
        for target in sorted(targets)
        if layer_of(target) > layer_of(module)
    ]
    assert not upward, "\n".join(upward)


def test_the_library_never_imports_the_tooling():
    tooling = {m for m in MODULES if LAYERS[layer_of(m)][0] == TOOLING}
    offending = [
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if module not in tooling
        for target in sorted(targets & tooling)
    ]
    assert not offending, "\n".join(offending)


@pytest.mark.parametrize(
    "graph, expected",
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, None),
        ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, ["a", "b", "c", "a"]),
        ({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}, ["b", "b2", "b"]),
    ],
)
def test_cycle_finder(graph, expected):
    assert find_cycle(graph) == expected
