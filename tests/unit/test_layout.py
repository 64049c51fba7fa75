"""The package's shape (issues #28, #42, docs/design.md §0): no import cycles, the floors of
docs/design.md §0.2 read from that page, no two modules with one name, no file over 500 lines.

A static pass over every module's `import` statements (top level and inside functions;
`from . import x` resolved; `from pkg import name` counts `pkg.name` when it is a module). Importing
`a.b.c` runs `a/b/__init__.py` first, so it counts as importing the package `a.b` too (all but the
top package, whose `__init__` imports nothing when it runs: PEP 562, lazy). The one
import by name, `config/registry.py` `load_plugins` (`importlib.import_module` of `PLUGINS`), is not an
edge: it loads the registrations of every floor once, and `megatron_moe/plugins.py` sits on the top
floor, which no module imports statically.
"""
import ast
import os
from collections import defaultdict
from typing import Dict, List, Optional, Set, Tuple

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "megatron_moe")
PACKAGE = "megatron_moe"
MAX_LINES = 500

DESIGN = os.path.join(ROOT, "..", "docs", "design.md")


def read_floors(path: str = DESIGN) -> List[Tuple[str, ...]]:
    """docs/design.md §0.2's picture, bottom floor first: on each line, the names before the first
    two spaces (`moe/`, `inference.py`, `__init__.py`) are one floor's packages."""
    with open(path) as f:
        text = f.read()
    block = text.split("### 0.2 The floors", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    floors = []
    for line in block.splitlines():
        head = line.split("  ", 1)[0].strip()
        if head and not head.startswith("↓"):
            floors.append(tuple(name[:-1] if name.endswith("/") else name for name in head.split()))
    return floors[::-1]


FLOORS = read_floors()


def module_files(root: str = ROOT) -> Dict[str, str]:
    """{dotted module name: path} of every .py file under `root` (packages by their __init__)."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def import_edges(modules: Dict[str, str]) -> Dict[str, Set[str]]:
    """{module: modules it imports} over the package (every import statement, at any depth)."""
    def owner(name: str) -> Optional[str]:  # the module that defines `name` (a module or a name in one)
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: Dict[str, Set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.endswith("__init__.py")
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = module.split(".")
                    parts = parts if is_package else parts[:-1]
                    parts = parts[: len(parts) - (node.level - 1)]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for target in targets:
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    found = owner(target)
                    while found is not None and found != PACKAGE:  # the module, then its packages
                        if found != module and not module.startswith(found + "."):
                            edges[module].add(found)
                        found = found.rpartition(".")[0]
    return edges


def find_cycle(edges: Dict[str, Set[str]]) -> Optional[List[str]]:
    """One import cycle [a, b, ..., a], or None (depth-first search, modules in sorted order)."""
    state: Dict[str, int] = defaultdict(int)  # 0 new, 1 on the stack, 2 done
    stack: List[str] = []

    def visit(m: str) -> Optional[List[str]]:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state[n] == 1:
                return stack[stack.index(n):] + [n]
            if state[n] == 0:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if state[m] == 0:
            found = visit(m)
            if found:
                return found
    return None


def package_of(module: str) -> str:
    """The map's name for a module's package: its top folder (`moe`), or the root module itself
    (`inference.py`; the package's own `__init__` is `__init__.py`)."""
    if module == PACKAGE:
        return "__init__.py"
    top = module.split(".")[1]
    return top if os.path.isdir(os.path.join(ROOT, top)) else top + ".py"


def floor_of(module: str, floors: List[Tuple[str, ...]] = FLOORS) -> int:
    """Index in `floors` (bottom first) of the floor that lists the module's package."""
    package = package_of(module)
    return next(i for i, names in enumerate(floors) if package in names)


def imports_not_below(edges: Dict[str, Set[str]], floors: List[Tuple[str, ...]] = FLOORS) -> List[str]:
    """Every import of a package on the importer's own floor or above it, as 'a (pkg) imports b (pkg)'."""
    return [f"{short(a)} ({package_of(a)}) imports {short(b)} ({package_of(b)})"
            for a in sorted(edges) for b in sorted(edges[a])
            if package_of(a) != package_of(b) and floor_of(b, floors) >= floor_of(a, floors)]


def short(module: str) -> str:
    return module[len(PACKAGE) + 1:] or PACKAGE


@pytest.fixture(scope="module")
def graph():
    modules = module_files()
    return modules, import_edges(modules)


def test_no_import_cycles(graph):
    _, edges = graph
    cycle = find_cycle(edges)
    assert cycle is None, "import cycle: " + " -> ".join(short(m) for m in cycle)


def test_the_map_names_every_package(graph):
    modules, _ = graph
    mapped = {name for names in FLOORS for name in names}
    present = {package_of(m) for m in modules}
    assert not present - mapped, f"packages missing from docs/design.md §0.2: {sorted(present - mapped)}"
    assert not mapped - present, f"docs/design.md §0.2 names packages that do not exist: {sorted(mapped - present)}"


def test_floors(graph):
    """A package imports only packages on lower floors: not its floor's neighbours, not above."""
    _, edges = graph
    wrong = imports_not_below(edges)
    assert not wrong, "imports of a package not below (docs/design.md §0.2):\n" + "\n".join(wrong)


def test_floor_checks_catch_a_same_floor_and_an_upward_import(tmp_path):
    """The checker itself: the picture parses bottom first; an import across one line or upwards
    is a violation, downwards and inside a package are not. The edges are the 2026-11 layout's:
    perf/calibrate.py imported techniques/, tensor_parallel/ imported model/param_meta.py."""
    page = tmp_path / "design.md"
    page.write_text("### 0.2 The floors\n\n```text\ninference.py  a root module\n   ↓\ntechniques/  t\n   ↓\n"
                    "model/ tensor_parallel/  one line\n   ↓\nperf/  p\n```\n")
    floors = read_floors(str(page))
    assert floors == [("perf",), ("model", "tensor_parallel"), ("techniques",), ("inference.py",)]
    m = PACKAGE + "."
    edges = {m + "perf.calibrate": {m + "techniques.parm.parm", m + "perf.timing"},
             m + "tensor_parallel.layers": {m + "model.param_meta"},
             m + "inference": {m + "techniques", m + "perf.timing"}, m + "perf.timing": set()}
    assert imports_not_below(edges, floors) == [
        "perf.calibrate (perf) imports techniques.parm.parm (techniques)",
        "tensor_parallel.layers (tensor_parallel) imports model.param_meta (model)"]


def test_plugins_are_loaded_by_name_only(graph):
    """The registrations load through `registry.PLUGINS` by name; nothing imports them statically."""
    from megatron_moe.config import registry

    modules, edges = graph
    for name in registry.PLUGINS:
        assert name in modules, f"registry.PLUGINS names {name}, which does not exist"
        assert floor_of(name) == len(FLOORS) - 1, f"{short(name)} is not on the top floor"
        importers = [short(m) for m in edges if name in edges[m]]
        assert not importers, f"{short(name)} is imported statically by {importers}"


def test_no_two_modules_share_a_name(graph):
    modules, _ = graph
    by_name = defaultdict(list)
    for module, path in modules.items():
        base = os.path.basename(path)
        if base not in ("__init__.py", "base.py"):
            by_name[base].append(short(module))
    shared = {name: where for name, where in by_name.items() if len(where) > 1}
    assert not shared, f"modules that share a name: {shared}"


def test_no_file_over_500_lines(graph):
    modules, _ = graph
    long = {short(m): n for m, path in modules.items() if (n := sum(1 for _ in open(path))) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_find_cycle_names_the_cycle():
    """The checker itself: a cycle through three modules is found and named in order."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_config_alone_runs_every_section_check():
    """A process that imports only `megatron_moe.config` still runs the techniques' rules (the
    plugins load by name on first use), and its registries know every entry."""
    import subprocess
    import sys

    code = ("from megatron_moe.config import ConfigError, load_config, validate_config\n"
            "from megatron_moe.config.validate import SECTION_CHECKS\n"
            "assert [name for name, _ in SECTION_CHECKS.items()] == list(SECTION_CHECKS.order)\n"
            "try:\n"
            "    validate_config(load_config(None, ['moe.saa=true']), 1)\n"
            "except ConfigError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.join(ROOT, ".."))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "moe.saa=true needs moe.schedule s2 or auto, not 'baseline'"


def test_a_hook_nobody_registered_is_an_error():
    from megatron_moe.config.registry import Hooks

    hooks = Hooks("test hook", ("registered", "forgotten"))
    hooks.register("registered")(lambda: None)
    with pytest.raises(RuntimeError, match="nothing registered 'forgotten'"):
        list(hooks.items())
    with pytest.raises(ValueError, match="'unknown' is not one of"):
        hooks.register("unknown")
