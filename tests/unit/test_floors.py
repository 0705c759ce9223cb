"""The package's floors (docs/architecture.md): every import, lazy ones inside functions included, runs down.

A module imports modules of its own room (top-level folder or file of ``hf_dist``) or of rooms on lower floors, and
no files import each other in a circle. Read from the source with ``ast``: nothing is imported to check it.
"""

import ast
from pathlib import Path

import hf_dist

PACKAGE = Path(hf_dist.__file__).parent
FLOORS = {
    **dict.fromkeys(("validation", "atomic_io", "data", "embedded"), 1),
    "planning": 2,
    **dict.fromkeys(("configs", "runtime"), 3),
    **dict.fromkeys(("checkpoint", "tracing", "bench", "demo", "testing"), 4),
    **dict.fromkeys(("auto", "callbacks", "cli"), 5),
    **dict.fromkeys(("recipe_utils", "__main__"), 6),
}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The ``hf_dist`` modules ``path`` imports (``from hf_dist import x`` is the lazy public face: left out)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out |= {n for n in names if _is_module(n)} or {node.module}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
    return {m for m in out if m.startswith("hf_dist.")}


def _is_module(name: str) -> bool:
    path = PACKAGE.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def _room(module: str) -> str:
    return module.split(".")[1]


GRAPH = {_module(p): _imports(p) for p in sorted(PACKAGE.rglob("*.py"))}


def test_every_room_has_a_floor():
    rooms = {_room(m) for m in GRAPH if m != "hf_dist"}
    assert rooms == set(FLOORS), f"rooms without a floor: {rooms - set(FLOORS)}; gone: {set(FLOORS) - rooms}"


def test_imports_run_down_the_floors():
    up = [
        f"{source} -> {target} (floor {FLOORS[_room(source)]} -> {FLOORS[_room(target)]})"
        for source, targets in GRAPH.items()
        if source != "hf_dist"
        for target in targets
        if _room(target) != _room(source) and FLOORS[_room(target)] >= FLOORS[_room(source)]
    ]
    assert not up, "imports that do not run down:\n" + "\n".join(up)


def test_no_import_circles():
    modules = {m: {t for t in ts if t in GRAPH and t != m} for m, ts in GRAPH.items() if m != "hf_dist"}
    done, stack, circles = set(), [], []

    def visit(module):
        if module in stack:
            circles.append(stack[stack.index(module) :] + [module])
            return
        if module in done:
            return
        stack.append(module)
        for target in sorted(modules.get(module, ())):
            if not module.startswith(target + "."):  # a submodule reading its own package's face: no loop of code
                visit(target)
        stack.pop()
        done.add(module)

    for module in sorted(modules):
        visit(module)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)
