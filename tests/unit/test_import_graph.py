"""The components' import graph points one way, with no cycle, no two files import each other (even
lazily), and no product module imports a benchmark or a test helper (ARCHITECTURE.md's layout rule,
checked on the source)."""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A component is a folder, or a subpackage / module with a boundary of its own. Each may import
# only the components listed for it (and itself).
SUBCOMPONENTS = {
    "tether.rollout.engine_api": "engine_api",  # how rollout and sync talk to engines
    "tether.rollout.cpu_engine": "cpu_engine",  # a server we run, reached only over HTTP
    "tether.rollout.sample": "contract",  # the Sample contract train and sync may use
    "tether.rollout.config": "contract",
    "tether.rollout.rewards.types": "contract",
    "tether.rollout.http_proxy": "contract",  # --http-proxy, checked with the rollout config
    # the eval datasets file --eval-config names, checked at parse
    "tether.rollout.data.eval_config": "contract",
    # The `import slime` finder (stdlib only): trainer ranks install it too, for slime-written loss hooks.
    "tether.rollout.slime_api.finder": "contract",
    "tether.rollout.hooks.loader": "contract",  # importing a hook a flag names (ranks load loss hooks)
    "tether.bench": "bench",
}
ALLOWED: dict[str, set[str]] = {
    "runtime": set(),
    "placement": {"runtime"},
    "contract": {"runtime"},
    "engine_api": {"runtime", "placement", "contract"},
    "cpu_engine": {"runtime", "engine_api"},
    "rollout": {"runtime", "placement", "contract", "engine_api"},
    "sync": {"runtime", "contract", "engine_api"},
    "train": {"runtime", "contract", "sync"},
    "head": {"runtime", "placement", "contract", "engine_api", "cpu_engine", "rollout", "sync", "train"},
    "bench": {
        "runtime",
        "placement",
        "contract",
        "engine_api",
        "cpu_engine",
        "rollout",
        "sync",
        "train",
        "head",
    },
}
TEST_HELPERS = ("tests", "conftest", "support", "e2e_support", "engine_fixtures", "rollout_fixtures")


def _package_dirs() -> dict[str, Path]:
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: ROOT / folder for package, folder in table.items()}


def component(module: str) -> str | None:
    """The component of a module of ours, None for anything else."""
    if module != "tether" and not module.startswith("tether."):
        return None
    for prefix, name in SUBCOMPONENTS.items():
        if module == prefix or module.startswith(prefix + "."):
            return name
    top = module.split(".")[1] if "." in module else ""
    return top if top in ("runtime", "placement", "rollout", "train", "sync") else "head"


def modules() -> Iterator[tuple[str, Path]]:
    """Every product module with its file."""
    for package, folder in _package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            parts = [p for p in path.relative_to(folder).with_suffix("").parts if p != "__init__"]
            yield ".".join([package, *parts]), path


def imports(module: str, path: Path) -> Iterator[tuple[str, int]]:
    """Every module the file imports, function-level imports included."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base, node.lineno
            for alias in node.names:  # `from tether.rollout import cpu_engine` imports a module
                yield f"{base}.{alias.name}", node.lineno


def test_every_module_has_a_component() -> None:
    found = {component(m) for m, _ in modules()}
    assert found == set(ALLOWED), found ^ set(ALLOWED)


def test_components_import_only_what_the_layout_allows() -> None:
    wrong = []
    for module, path in modules():
        here = component(module)
        assert here is not None
        for target, line in imports(module, path):
            there = component(target)
            if there is not None and there != here and there not in ALLOWED[here]:
                wrong.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {target} ({there})")
    assert not wrong, "imports against the layout:\n" + "\n".join(sorted(set(wrong)))


def test_the_allowed_graph_points_one_way() -> None:
    order: list[str] = []
    visiting: set[str] = set()

    def visit(node: str, trail: tuple[str, ...]) -> None:
        assert node not in visiting, f"cycle: {' -> '.join([*trail, node])}"
        if node in order:
            return
        visiting.add(node)
        for nxt in sorted(ALLOWED[node]):
            visit(nxt, (*trail, node))
        visiting.discard(node)
        order.append(node)

    for node in sorted(ALLOWED):
        visit(node, ())
    assert order.index("runtime") < order.index("rollout") < order.index("head") < order.index("bench")


def file_cycle(graph: dict[str, list[str]]) -> list[str] | None:
    """One cycle of the graph as the modules along it (first repeated at the end), None if none."""
    done: set[str] = set()
    trail: list[str] = []
    on_trail: set[str] = set()

    def visit(node: str) -> list[str] | None:
        if node in on_trail:
            return [*trail[trail.index(node) :], node]
        if node in done:
            return None
        trail.append(node)
        on_trail.add(node)
        for nxt in graph[node]:
            found = visit(nxt)
            if found:
                return found
        trail.pop()
        on_trail.discard(node)
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node)
        if found:
            return found
    return None


def test_file_cycle_finds_a_circle_and_only_a_circle() -> None:
    graph = {"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}
    assert file_cycle(graph) == ["a", "b", "c", "a"]
    assert file_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None


def test_no_two_files_import_each_other() -> None:
    """No cycle between product files, counting imports inside functions and under TYPE_CHECKING:
    a shared piece lives where both can import it (ARCHITECTURE.md's layout)."""
    files = dict(modules())
    graph = {
        module: sorted(
            {target for target, _ in imports(module, path) if target in files and target != module}
        )
        for module, path in files.items()
    }
    cycle = file_cycle(graph)
    assert cycle is None, "files importing each other: " + " -> ".join(cycle or [])


def test_no_product_module_imports_a_test_helper() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {target}"
        for module, path in modules()
        for target, line in imports(module, path)
        if target.split(".")[0] in TEST_HELPERS
    ]
    assert not found, found
