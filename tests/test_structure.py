"""The package's shape, kept from regressing (docs/architecture.md): files a reader can take in, modules that import
one way, the text core reached only through the `kvcmas_cpp.model` package, no module reading another's private
names. Static checks of the source (ast and tokenize): no model, no build."""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "kvcmas_cpp"
MAX_LINES = 500
GENERATED: frozenset[str] = frozenset()  # generated tables (package-relative paths) the line limit leaves out
# Where `_core` may appear: the text core's door (the model package), the module that loads the extension, and the
# vision towers' own doors to their cores
CORE_DOORS = ("model/", "_native.py", "vision/encoder.py", "vision/qwen.py")
EXTENSION_MODULES = frozenset({"_core", "_testing"})  # compiled modules: private by name, imported by _native only


def modules() -> Iterator[tuple[str, Path]]:
    """(dotted name, path) of every module of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        yield ".".join(parts[:-1] if parts[-1] == "__init__" else parts), path


def relative(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (imports for annotations only: never run)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports(name: str, path: Path, known: set[str]) -> Iterator[tuple[ast.ImportFrom | ast.Import, str, list[str]]]:
    """(node, imported module, names taken from it) of each import that runs (function-local ones included), the
    module resolved against the package; a name that is itself a module counts as importing it."""
    tree = ast.parse(path.read_text(), str(path))
    skip = type_checking_nodes(tree)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [a.name for a in node.names]
            if f"{target}.{names[0]}" in known or names[0] in EXTENSION_MODULES:  # `from . import x`: modules
                for n in names:
                    yield node, f"{target}.{n}" if f"{target}.{n}" in known else f"{target}.{n} (extension)", []
            else:
                yield node, target, names


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports."""
    known = {name for name, _ in modules()}
    out: dict[str, set[str]] = {}
    for name, path in modules():
        out[name] = {target for _, target, _ in imports(name, path, known) if target in known and target != name}
    return out


def test_no_file_is_over_the_line_limit() -> None:
    long = {
        relative(p): n
        for _, p in modules()
        if relative(p) not in GENERATED and (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"files over {MAX_LINES} lines (split them by concept): {long}"


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    """Tarjan's strongly connected components over every import that runs: a component of more than one module is a
    cycle (a package's __init__ re-exporting its own modules is none: they do not import it back)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_the_text_core_is_reached_through_the_model_package_only() -> None:
    outside = []
    for _, path in modules():
        rel = relative(path)
        if rel.startswith(CORE_DOORS):
            continue
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        outside += [f"{rel}:{t.start[0]}" for t in tokens if t.type == tokenize.NAME and t.string == "_core"]
    assert not outside, f"`_core` outside the model package (use Model's public doors): {outside}"


def test_tests_reach_the_core_through_public_doors() -> None:
    """Tests read the engine through Model, KVSequence and the encoders (and test-only bindings through _testing)."""
    reached = []
    for path in sorted(PACKAGE.parent.parent.joinpath("tests").rglob("*.py")):
        tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        reached += [f"{path.name}:{t.start[0]}" for t in tokens if t.type == tokenize.NAME and t.string == "_core"]
    assert not reached, f"tests reading `_core` (use the public doors): {reached}"


def test_no_module_imports_another_modules_private_names() -> None:
    known = {name for name, _ in modules()}
    private = []
    for name, path in modules():
        for node, target, names in imports(name, path, known):
            if not target.startswith("kvcmas_cpp") or target.endswith("(extension)"):
                continue
            taken = names or [target.rpartition(".")[2]]
            private += [
                f"{relative(path)}:{node.lineno}: {target}.{n}"
                for n in taken
                if n.startswith("_") and not n.startswith("__") and n not in EXTENSION_MODULES
            ]
    assert not private, f"imports of another module's private names: {private}"
