"""The tree's layout, as docs/architecture.md draws it: bench/ holds one folder per benchmark family,
each runnable as a module with no edit of ``sys.path``; tests/ mirrors the package, and no test file
imports another (what they share is a plain module or a conftest fixture)."""
import ast
import pathlib
import re

from tests import REPO

BENCH = REPO / "bench"
TESTS = REPO / "tests"
PACKAGE = REPO / "ciuicflow"


def sys_path_edits(root: pathlib.Path):
    """(file, line) of every ``sys.path`` mutation under ``root``: a call of one of its methods, an
    assignment to it or to one of its items."""
    out = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            target = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                target = node.func.value
            elif isinstance(node, (ast.Assign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets
                               if ast.unparse(t).startswith("sys.path")), None)
            if target is not None and ast.unparse(target) == "sys.path":
                out.append((str(path.relative_to(root.parent)), node.lineno))
    return out


def test_no_bench_file_edits_sys_path():
    assert sys_path_edits(BENCH) == []


def test_the_sys_path_check_sees_each_kind_of_edit(tmp_path):
    (tmp_path / "a.py").write_text("import sys\nsys.path.insert(0, 'x')\n")
    (tmp_path / "b.py").write_text("import sys\nsys.path += ['x']\nsys.path[0:0] = ['y']\n")
    (tmp_path / "c.py").write_text("import sys\nprint(sys.path)\nfor p in sys.path:\n    pass\n")
    assert {(p.rsplit("/", 1)[-1], line) for p, line in sys_path_edits(tmp_path)} == {
        ("a.py", 2), ("b.py", 2), ("b.py", 3)}


def test_bench_is_one_folder_per_family():
    loose = sorted(p.name for p in BENCH.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"benchmarks outside a family folder: {loose}"
    for family in (p for p in BENCH.iterdir()
                   if p.is_dir() and p.name not in ("__pycache__", "results")):
        assert (family / "__init__.py").exists(), family
    # bench/results holds the runs the docs quote (data, no code)
    assert not any((BENCH / "results").rglob("*.py"))


def test_scripts_name_existing_bench_modules():
    """Each ``bench....`` module that .ci/run, bench/gpu_check.sh or scripts/ run exists (a renamed
    bench fails CI here, instead of silently dropping out of the smoke runs or the GPU check)."""
    scripts = [REPO / ".ci" / "run", BENCH / "gpu_check.sh", *sorted((REPO / "scripts").glob("*.sh"))]
    text = "\n".join(path.read_text() for path in scripts)
    names = set(re.findall(r"(?<![\w/.$])bench(?:\.\w+)+", text))
    assert len(names) >= 10, names
    for name in sorted(names):
        path = REPO / pathlib.Path(*name.split("."))
        assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), name


def test_tests_mirror_the_package():
    """Each folder of tests/ is a folder of ciuicflow/ (or bench/, for the benches' tests)."""
    for folder in sorted(p for p in TESTS.rglob("*") if p.is_dir() and p.name not in ("__pycache__", "fixtures")
                         and "fixtures" not in p.relative_to(TESTS).parts):
        rel = folder.relative_to(TESTS)
        mirrored = REPO / rel if rel.parts[0] == "bench" else PACKAGE / rel
        assert mirrored.is_dir(), f"tests/{rel} mirrors nothing under ciuicflow/ or bench/"


def test_no_test_file_imports_another():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "tests" and any(p.startswith("test_") or p == "conftest" for p in parts[1:]):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {name}")
    assert found == []
