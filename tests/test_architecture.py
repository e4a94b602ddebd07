"""The import graph of attnmask: no cycles between modules or between packages, not even through
imports hidden in functions or under ``TYPE_CHECKING``, and the packages stay on their layers.

A use of a PyTorch operator by name (``torch.ops.attnmask.NAME`` or ``"attnmask::NAME"``, in Python or
in the native sources) counts as an import of the module that defines the operator: a dependency
through the dispatcher is a dependency all the same."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import attnmask

SRC = Path(attnmask.__file__).resolve().parent

# Each package may import only packages on lower layers (and itself). A newcomer reads the tree
# bottom-up: masks, data (text, tokens, batches), viz, ops (native kernels as PyTorch operators),
# linear (float32 CPU products), allocator, errors ->
# attention -> model -> decode -> pretrained, engine (serving's packed step and scheduler) ->
# train, serve (the HTTP layer over the engine) -> audit -> cli.
LAYERS = {
    "masks": 0,
    "data": 0,
    "viz": 0,
    "ops": 0,
    "linear": 0,
    "allocator": 0,
    "errors": 0,
    "attention": 1,
    "model": 2,
    "decode": 3,
    "pretrained": 4,
    "engine": 4,
    "train": 5,
    "serve": 5,
    "audit": 6,
    "cli": 7,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in SRC.rglob("*.py")}


def resolve(name: str) -> str | None:
    """The attnmask module that ``import name`` loads (a package's ``__init__`` for a package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """Every attnmask module ``module`` imports, wherever the import statement stands."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        else:
            continue
        for target in targets:
            if target.startswith("attnmask") and (hit := resolve(target)) is not None and hit != module:
                found.add(hit)
    return found


# Operators by name: where each is defined, and who names it. Native sources (ops/csrc/*) count as
# modules of their package.
_DEFINES = [
    r"""\.define\(\s*["'](\w+)\(""",  # torch.library.Library(...).define("name(...) -> ...")
    r"""custom_op\(\s*["']attnmask::(\w+)["']""",  # @torch.library.custom_op("attnmask::name")
    r"""\bm?lib\.def\(\s*"(\w+)\(""",  # TORCH_LIBRARY_FRAGMENT(attnmask, lib) { lib.def("name(...") }
]
_USES = [r"torch\.ops\.attnmask\.(\w+)", r"""["']attnmask::(\w+)["']"""]
NATIVE = {
    module_name(p.parent / p.name.replace(".", "_")): p
    for p in SRC.rglob("*")
    if p.suffix in (".c", ".cpp", ".h") and p.is_file()
}


def operator_homes(sources: dict[str, str]) -> dict[str, str]:
    """Operator name -> the module whose source defines it."""
    return {
        name: module for module, text in sources.items() for pattern in _DEFINES for name in re.findall(pattern, text)
    }


def operator_uses(text: str) -> set[str]:
    """The attnmask operators a source names (through the dispatcher)."""
    return {name for pattern in _USES for name in re.findall(pattern, text)}


def operator_edges(sources: dict[str, str]) -> dict[str, set[str]]:
    """Module -> the modules defining the operators it names (its own excepted)."""
    homes = operator_homes(sources)
    edges = {}
    for module, text in sources.items():
        found = {homes[name] for name in operator_uses(text) if name in homes and homes[name] != module}
        if found:
            edges[module] = found
    return edges


SOURCES = {m: p.read_text() for m, p in {**MODULES, **NATIVE}.items()}
GRAPH = {m: imports_of(m) for m in MODULES}
for _module, _homes in operator_edges(SOURCES).items():
    GRAPH.setdefault(_module, set()).update(_homes)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_graph_is_read():
    assert len(MODULES) > 40
    assert "attnmask.masks.core" in GRAPH["attnmask.masks.structured"]
    assert "attnmask.decode.beam" in GRAPH["attnmask.decode.text"]  # a function-level import is seen


def test_no_cycle_between_modules():
    # A package's __init__ imports its modules; a module importing its own package's __init__
    # (rather than a sibling module) is a cycle too.
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_cycle_between_packages():
    packages: dict[str, set[str]] = {}
    for module, targets in GRAPH.items():
        src = package_of(module)
        packages.setdefault(src, set()).update(package_of(t) for t in targets if package_of(t) not in ("", src))
    cycle = find_cycle(packages)
    assert cycle is None, "package cycle: " + " -> ".join(cycle)


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_packages_import_only_lower_layers(package):
    upward = sorted(
        f"{module} imports {target}"
        for module, targets in GRAPH.items()
        if package_of(module) == package
        for target in targets
        if package_of(target) in LAYERS and LAYERS[package_of(target)] > LAYERS[package]
    )
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_operators_are_found_where_they_are_defined_and_used():
    homes = operator_homes(SOURCES)
    assert homes["block_matmul"] == "attnmask.ops.blocks"
    assert homes["packed_step"] == "attnmask.ops.decoding"
    assert homes["kernel_simd"] == "attnmask.ops.csrc.blocks_cpp"  # defined in C++ only
    assert "attnmask.ops.blocks" in GRAPH["attnmask.ops.native"]  # an import
    assert "attnmask.ops.csrc.blocks_cpp" in GRAPH["attnmask.ops.native"]  # torch.ops.attnmask.kernel_simd


def test_an_upward_dependency_through_the_dispatcher_is_caught():
    """A low module that calls an operator defined higher up, by name, in Python or in C++."""
    sources = {
        "attnmask.pretrained.quantized": 'LIB.define("block_matmul(Tensor x) -> Tensor")',
        "attnmask.model.layers": "y = torch.ops.attnmask.block_matmul(x)",
        "attnmask.ops.csrc.decoding_cpp": 'findSchemaOrThrow("attnmask::block_matmul", "")',
    }
    edges = operator_edges(sources)
    assert edges == {
        "attnmask.model.layers": {"attnmask.pretrained.quantized"},
        "attnmask.ops.csrc.decoding_cpp": {"attnmask.pretrained.quantized"},
    }
    upward = [(m, t) for m, ts in edges.items() for t in ts if LAYERS[package_of(t)] > LAYERS[package_of(m)]]
    assert len(upward) == 2


def test_the_detector_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
