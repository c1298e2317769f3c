"""The package's shape, read from its sources (no import of the modules):
no import cycle, no oversized module, named-barrier ids in one place."""

import ast
import os
import re

import pytest

PACKAGE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "flashgemm")
ROOT = "flashgemm"
MAX_LINES = 500


def _sources():
    """{module name: path} of every .py under flashgemm/ (a package's
    ``__init__.py`` is the package's module)."""
    modules = {}
    for root, dirs, names in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, name), PACKAGE_DIR)[: -len(".py")].split(os.sep)
            if rel[-1] == "__init__":
                rel = rel[:-1]
            modules[".".join([ROOT, *rel])] = os.path.join(root, name)
    return modules


MODULES = _sources()


def _package_of(module: str, path: str) -> str:
    return module if os.path.basename(path) == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: str):
    """(target module, imported names or None) of every import of a flashgemm
    module anywhere in ``module`` (top level, functions, methods)."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = _package_of(module, path)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == ROOT or alias.name.startswith(ROOT + "."):
                    found.append((alias.name, None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level > 1:
                    base = base[: -(node.level - 1)]
                assert base and base[0] == ROOT, f"{module}: relative import past the package"
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
                if not (source == ROOT or source.startswith(ROOT + ".")):
                    continue
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                if sub in MODULES:  # `from . import trace`: the module flashgemm.trace
                    found.append((sub, None))
                else:  # a name defined in (the __init__ of) `source`
                    found.append((source, alias.name))
    return found


def _graph():
    graph, version_imports = {}, []
    for module, path in MODULES.items():
        edges = set()
        for target, name in _imports(module, path):
            assert target in MODULES, f"{module} imports {target}, which is not a module of the package"
            if target == ROOT and name == "__version__":
                version_imports.append(module)  # the one allowed edge into the root
                continue
            if target != module:
                edges.add(target)
        graph[module] = edges
    return graph, version_imports


def _find_cycle(graph):
    """A list of modules m0 -> m1 -> ... -> m0, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == "open":
                return stack[stack.index(t):] + [t]
            if t not in state:
                cycle = visit(t)
                if cycle:
                    return cycle
        stack.pop()
        state[m] = "done"
        return None

    for m in sorted(graph):
        if m not in state:
            cycle = visit(m)
            if cycle:
                return cycle
    return None


def test_the_walk_finds_the_package():
    for module in ("flashgemm", "flashgemm.api", "flashgemm.config", "flashgemm.version",
                   "flashgemm.workspace", "flashgemm.jit", "flashgemm.jit.key", "flashgemm.schedule.walker",
                   "flashgemm.sm90", "flashgemm.sm90.build", "flashgemm.sm90.barriers"):
        assert module in MODULES, module
    graph, _ = _graph()
    # imports inside functions count: the backends build kernels lazily
    assert "flashgemm.sm90.build" in graph["flashgemm.sm90.backend"]
    assert "flashgemm.sm90.heuristic" in graph["flashgemm.sm90.backend"]
    # `from . import x` is the module x, `from .x import name` is x too
    assert "flashgemm.workspace" in graph["flashgemm.api"]
    assert "flashgemm.jit.cache" in graph["flashgemm.sm90.build"]


def test_no_import_cycle():
    graph, version_imports = _graph()
    # the version lives in flashgemm/version.py: nothing imports the root for it
    assert version_imports == []
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("module", sorted(MODULES))
def test_module_length(module):
    with open(MODULES[module]) as f:
        lines = len(f.read().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module]} has {lines} lines (at most {MAX_LINES})"


# each arch package keeps its named-barrier ids in its own barriers.py
BARRIERS = ("flashgemm.sm90.barriers", "flashgemm.sm100.barriers")


def _names_from_barriers(module: str, path: str, barriers_module: str):
    """Names bound in ``module`` to barriers.py or to things defined in it:
    ({aliases of the module}, {names imported from it})."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    package = _package_of(module, path)
    aliases, names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                if f"{source}.{alias.name}" == barriers_module:
                    aliases.add(alias.asname or alias.name)
                elif source == barriers_module:
                    names.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == barriers_module and alias.asname:
                    aliases.add(alias.asname)
    return aliases, names


def _from_barriers(expr: ast.AST, aliases, names) -> bool:
    """``expr`` is built from barriers' names only (no integer literal)."""
    used = False
    for node in ast.walk(expr):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return False
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used = True
        elif isinstance(node, ast.Name) and node.id in names:
            used = True
    return used


def test_named_barrier_ids_come_from_barriers_py():
    barriers_paths = {MODULES[b] for b in BARRIERS}
    occurrences = 0
    for module, path in MODULES.items():
        with open(path) as f:
            source = f.read()
        code_lines = [line.split("#", 1)[0] for line in source.splitlines()]
        textual = sum(len(re.findall(r"\bbarrier_id\s*=", line)) for line in code_lines)
        tree = ast.parse(source, path)
        calls = [kw.value for node in ast.walk(tree) if isinstance(node, ast.Call)
                 for kw in node.keywords if kw.arg == "barrier_id"]
        # every textual `barrier_id=` outside comments is a keyword the AST sees
        assert len(calls) == textual, f"{path}: {textual} `barrier_id=` in code, {len(calls)} as keywords"
        # and no barrier is made with a positional id
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if func in ("NamedBarrier", "barrier", "barrier_arrive"):
                    assert not node.args, f"{path}:{node.lineno}: {func} with a positional argument"
        if path in barriers_paths or not calls:
            continue
        own = module.rpartition(".")[0] + ".barriers"  # the barriers.py of the module's arch package
        assert own in BARRIERS, f"{path}: named barriers outside an arch package with a barriers.py"
        aliases, names = _names_from_barriers(module, path, own)
        for value in calls:
            occurrences += 1
            assert _from_barriers(value, aliases, names), (
                f"{path}:{value.lineno}: barrier_id={ast.unparse(value)} is not a name from barriers.py"
            )
    assert occurrences > 0  # the combine's team barriers at least


def test_barrier_check_catches_a_literal_id():
    def check(src, aliases=frozenset(), names=frozenset({"EPILOGUE"})):
        call = ast.parse(src).body[0].value
        return _from_barriers(call.keywords[0].value, aliases, names)

    assert check("NamedBarrier(barrier_id=EPILOGUE, num_threads=160)")
    assert check("barrier(barrier_id=barriers.FIRST + w)", aliases={"barriers"}, names=set())
    assert not check("NamedBarrier(barrier_id=3, num_threads=160)")
    assert not check("barrier(barrier_id=EPILOGUE + 1)")
    assert not check("barrier(barrier_id=w)")


ARCH_PACKAGES = ("flashgemm.sm90", "flashgemm.sm100")


def _collapsed(module: str) -> str:
    """``flashgemm.X``: the subpackage or top-level module a module belongs to."""
    return ".".join(module.split(".")[:2])


def _collapsed_graph():
    graph, _ = _graph()
    collapsed = {}
    for module, targets in graph.items():
        edges = collapsed.setdefault(_collapsed(module), set())
        edges.update(_collapsed(t) for t in targets if _collapsed(t) != _collapsed(module))
    return collapsed


def test_no_cycle_among_subpackages():
    """Collapsed to flashgemm.X (function-level imports included), the import
    graph has no cycle: the arch packages sit below the layer packages and
    above the shared ones, and nothing reaches back."""
    cycle = _find_cycle(_collapsed_graph())
    assert cycle is None, "cycle between subpackages: " + " -> ".join(cycle)


def test_arch_neutral_code_names_no_arch_package():
    """Only an arch package imports an arch package; the rest reaches one
    through ``flashgemm.backend``'s registry."""
    offenders = [f"{module} -> {target}" for module, targets in _graph()[0].items()
                 if _collapsed(module) not in ARCH_PACKAGES
                 for target in targets if _collapsed(target) in ARCH_PACKAGES]
    assert not offenders, offenders


def test_device_helpers_import_only_themselves():
    """flashgemm.device sits below the arch and layer packages."""
    graph, _ = _graph()
    outside = [f"{m} -> {t}" for m, ts in graph.items() if _collapsed(m) == "flashgemm.device"
               for t in ts if _collapsed(t) != "flashgemm.device"]
    assert not outside, outside


def test_the_collapsed_checks_catch_a_cycle_and_an_arch_import():
    assert _find_cycle({"flashgemm.moe": {"flashgemm.sm90"}, "flashgemm.sm90": {"flashgemm.moe"}})
    assert _collapsed("flashgemm.sm90.kernel") == "flashgemm.sm90" and _collapsed("flashgemm.api") == "flashgemm.api"
    graph = _collapsed_graph()
    assert "flashgemm.backend" in graph["flashgemm.sm90"] and "flashgemm.sm90" not in graph["flashgemm.api"]
