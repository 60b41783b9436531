"""The package's shape: one namespace, layered imports, no cycles, no TensorFlow in the planner.

DESIGN.md: everything installs under ``tfplan``; the layers are core < compat <
profiler < planner < apply < reports < cli, and a module imports only what stands
below it (imports inside functions included), never a private name of another
module, with no import cycles. The import-linter contracts in ``pyproject.toml``
state the layers; these tests run them on the repository's sources (staged as the
``tfplan`` package the wheel installs, by ``pyproject.toml``'s package-dir map),
show that a wrong import breaks them, and check what import-linter does not:
the module graph is acyclic and no private name crosses a module boundary.
"""
from __future__ import annotations

import ast
import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap

import networkx as nx
import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
    PYPROJECT = tomllib.load(f)
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
OLD_TOP_LEVEL = ("apply", "planner", "profiler", "reports")


def source_modules() -> dict[str, str]:
    """{dotted module name: source file} for every module the wheel installs."""
    modules: dict[str, str] = {}
    for package, folder in PACKAGE_DIRS.items():
        folder = os.path.join(ROOT, folder)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py"):
                module = package if name == "__init__.py" else f"{package}.{name[:-3]}"
                modules[module] = os.path.join(folder, name)
    return modules


def stage_package(dest: str) -> str:
    """Copy the sources into ``dest/tfplan/...`` as the wheel lays them out."""
    for module, path in source_modules().items():
        parts = module.split(".")
        if path.endswith("__init__.py"):
            target = os.path.join(dest, *parts, "__init__.py")
        else:
            target = os.path.join(dest, *parts) + ".py"
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(path, target)
    config = os.path.join(dest, "importlinter.toml")
    contracts = {"tool": {"importlinter": PYPROJECT["tool"]["importlinter"]}}
    with open(config, "w", encoding="utf-8") as f:
        f.write(_toml(contracts))
    return config


def _toml(doc: dict) -> str:
    """The two tables import-linter reads, written back as TOML (no writer in stdlib)."""
    linter = doc["tool"]["importlinter"]
    lines = ["[tool.importlinter]", f'root_package = "{linter["root_package"]}"']
    for contract in linter["contracts"]:
        lines.append("\n[[tool.importlinter.contracts]]")
        for key, value in contract.items():
            if isinstance(value, list):
                items = ", ".join(f'"{v}"' for v in value)
                lines.append(f"{key} = [{items}]")
            else:
                lines.append(f'{key} = "{value}"')
    return "\n".join(lines) + "\n"


def lint_imports(staged: str, config: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": staged}
    # import-linter's own command (``lint-imports``), run by this interpreter
    command = "from importlinter.cli import lint_imports_command as c; c()"
    return subprocess.run([sys.executable, "-c", command, "--no-cache", config], cwd=staged,
                          env=env, capture_output=True, text=True, timeout=300)


def test_import_linter_contracts_hold(tmp_path):
    config = stage_package(str(tmp_path))
    result = lint_imports(str(tmp_path), config)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 1 kept, 0 broken." in result.stdout


@pytest.mark.parametrize("module, line", [
    # the planner reaching up into apply, hidden inside a function
    ("planner/graph.py", "def _upward():\n    from tfplan.apply import wrap\n"),
    # the profiler importing the planner
    ("profiler/comm.py", "from tfplan.planner.plan import Plan\n"),
])
def test_a_wrong_import_breaks_the_contracts(tmp_path, module, line):
    config = stage_package(str(tmp_path))
    package, name = module.split("/")
    with open(tmp_path / "tfplan" / package / name, "a", encoding="utf-8") as f:
        f.write("\n\n" + line)
    result = lint_imports(str(tmp_path), config)
    assert result.returncode != 0
    assert "BROKEN" in result.stdout and f"tfplan.{package}" in result.stdout


def module_imports(module: str, path: str, modules: dict[str, str]
                   ) -> list[tuple[str, str | None]]:
    """(imported module, imported name or None) for every import in ``path``, any depth."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    is_package = path.endswith("__init__.py")
    found: list[tuple[str, str | None]] = []

    def owner(dotted: str) -> str | None:
        while dotted and dotted not in modules:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = owner(alias.name)
                if target:
                    found.append((target, None))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: None if is_package else -1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules:
                    found.append((full, None))
                elif owner(source):
                    found.append((owner(source), alias.name))
    return found


def private_attribute_uses(path: str, modules: dict[str, str]) -> list[str]:
    """``mod._name`` where ``mod`` is bound to one of our modules by an import in ``path``."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    bound: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in modules:
                    bound[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return [f"{bound[n.value.id]}.{n.attr}" for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in bound and n.attr.startswith("_") and not n.attr.startswith("__")]


def import_graph() -> tuple[nx.DiGraph, list[str]]:
    modules = source_modules()
    graph = nx.DiGraph()
    private: list[str] = []
    for module, path in modules.items():
        graph.add_node(module)
        for target, name in module_imports(module, path, modules):
            if target != module:
                graph.add_edge(module, target)
                if name and name.startswith("_") and not name.startswith("__"):
                    private.append(f"{module} imports {name} from {target}")
        private += [f"{module} uses {used}" for used in private_attribute_uses(path, modules)]
    return graph, private


def test_the_module_import_graph_is_acyclic():
    graph, _ = import_graph()
    assert graph.number_of_nodes() > 50 and graph.number_of_edges() > 100
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    assert not cycles, f"import cycles (imports inside functions included): {cycles}"


def test_no_module_imports_a_private_name_from_another():
    _, private = import_graph()
    assert not private, "\n".join(private)


def test_the_cycle_check_sees_imports_inside_functions(tmp_path):
    """The graph counts a function-level import: a cycle made that way is found."""
    modules = {"tfplan.a": str(tmp_path / "a.py"), "tfplan.b": str(tmp_path / "b.py")}
    (tmp_path / "a.py").write_text("from tfplan.b import x\n")
    (tmp_path / "b.py").write_text(textwrap.dedent("""\
        def f():
            from tfplan.a import _y
        """))
    assert module_imports("tfplan.b", modules["tfplan.b"], modules) == [("tfplan.a", "_y")]
    assert module_imports("tfplan.a", modules["tfplan.a"], modules) == [("tfplan.b", "x")]


def test_planner_and_core_import_no_tensorflow():
    planner = [m for m in source_modules() if m.startswith(("tfplan.planner", "tfplan.core"))]
    code = ("import importlib, sys\n"
            "for m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(len(sys.argv) - 1, [m for m in ('tensorflow', 'keras') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code, *planner], capture_output=True,
                            text=True, timeout=120, cwd=os.path.dirname(ROOT))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(len(planner)), "[]"]


def test_the_distribution_installs_only_the_tfplan_package():
    dist = importlib.metadata.distribution("tf-parallel-planner")
    assert (dist.read_text("top_level.txt") or "").split() == ["tfplan"]
    installed = [str(f) for f in dist.files or () if str(f).endswith(".py")]
    if "tfplan/__init__.py" in installed:
        # a regular install (what the README's commands do): every module under tfplan/
        assert all(f.startswith("tfplan/") for f in installed), installed
        assert not any(f.split("/")[0] in OLD_TOP_LEVEL for f in installed)
    # (an editable install maps tfplan.* onto the repository's folders instead)
    entry = {e.name: e.value for e in dist.entry_points}
    assert entry["plan"] == "tfplan.cli:main"
    assert entry["parallel_plan"] == "tfplan.reports.plugin:ParallelPlanPlugin"
