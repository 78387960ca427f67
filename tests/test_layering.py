"""Imports point down (docs/architecture.md): production never imports ``ciuicflow.testing``, which holds the
simulated cluster and fault injection for tests and benchmarks. Read from the source with ast, so an import
inside a function (the kind that only runs when a flag is given) counts as much as one at the top."""
from tests import REPO
import ast
import pathlib

PACKAGE = REPO / "ciuicflow"
TESTING = "ciuicflow.testing"

# Modules allowed to import testing for now, each with why; an entry that no longer imports it must go.
KNOWN: set = set()


def _module_name(path: pathlib.Path, package: pathlib.Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: pathlib.Path, root: pathlib.Path = PACKAGE):
    """Every module an import statement of ``path`` names (relative imports resolved; ``from X import Y``
    gives X and X.Y, since Y may be a submodule)."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"


def imports_of_testing(package: pathlib.Path = PACKAGE):
    """(path relative to the checkout, line, module) of each import of ciuicflow.testing outside it."""
    out = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package.parent)
        if rel.parts[:2] == ("ciuicflow", "testing"):
            continue
        for line, module in imported_modules(path, package):
            if module == TESTING or module.startswith(TESTING + "."):
                out.append((str(rel), line, module))
    return out


def test_production_never_imports_testing():
    found = imports_of_testing()
    offending = [f"{path}:{line} imports {module}" for path, line, module in found if path not in KNOWN]
    assert not offending, "production code imports ciuicflow.testing:\n" + "\n".join(offending)
    stale = KNOWN - {path for path, _, _ in found}
    assert not stale, f"no longer import ciuicflow.testing, drop them from KNOWN: {sorted(stale)}"


def test_the_check_sees_relative_and_late_imports(tmp_path):
    pkg = tmp_path / "ciuicflow"
    (pkg / "kvflow").mkdir(parents=True)
    (pkg / "testing").mkdir()
    (pkg / "kvflow" / "__init__.py").write_text("")
    (pkg / "kvflow" / "late.py").write_text("def main():\n    from ..testing.kvflow_faults import Faults\n")
    (pkg / "kvflow" / "whole.py").write_text("from ciuicflow import testing\n")
    (pkg / "kvflow" / "fine.py").write_text("from ..testing_helpers import x\nimport ciuicflow.kvflow\n")
    (pkg / "testing" / "own.py").write_text("from ciuicflow.testing import cluster\n")
    found = {(path, module) for path, _, module in imports_of_testing(pkg)}
    assert found == {("ciuicflow/kvflow/late.py", "ciuicflow.testing.kvflow_faults"),
                     ("ciuicflow/kvflow/late.py", "ciuicflow.testing.kvflow_faults.Faults"),
                     ("ciuicflow/kvflow/whole.py", "ciuicflow.testing")}
