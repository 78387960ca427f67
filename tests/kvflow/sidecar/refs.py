"""Count the places where one module of the KV-flow sidecar reads or writes another's state.

``python -m tests.kvflow.sidecar.refs [ROOT] [-v]`` prints the counts (``-v``: every place); ROOT is a
checkout (default: this one). test_ownership.py holds the sidecar to the counts it allows.

How a place is found (ast, no imports):
* the state of a class is the names its methods assign as ``self.NAME`` (and its ``__slots__``); methods and
  properties are its interface, not its state;
* the classes are those of ciuicflow/kvflow/sidecar/ and the two of kvflow/core it hands around
  (``Transfer``, ``MemoryBudget``); for those two and for RECORDS only writes and ``_private`` names count:
  their public attributes are what they publish;
* what class an expression holds is known from a parameter's annotation, from ``self.x = Class(...)`` or
  ``self.x = param`` in ``__init__``, and otherwise from the name the code always gives it (NAMES below:
  ``sender`` is a PeerSender, ``entry`` an InTransfer, ...). This is the fragile part: a name not in NAMES is
  not looked at, which is why NAMES is written out;
* a place is ``expr.NAME`` with expr not ``self``, holding a class of another module, NAME in that class's
  state: a *write* when it is assigned, augmented or deleted, a *private* read when NAME starts with ``_``,
  else a *read*.
"""
from __future__ import annotations

from tests import REPO

import ast
import pathlib
import sys
from collections import Counter
from typing import Dict, List, NamedTuple, Optional, Set

SIDECAR = "ciuicflow/kvflow/sidecar"
CORE = {"ciuicflow/kvflow/core/transfer.py": {"Transfer"}, "ciuicflow/kvflow/core/budget.py": {"MemoryBudget"}}

# The name the sidecar's code gives an object of each class, wherever it holds one.
NAMES = {
    "outbox": "Outbox", "box": "Outbox",
    "sender": "PeerSender", "s": "PeerSender",
    "entry": "InTransfer", "other": "InTransfer", "e": "InTransfer",
    "store": "Store",
    "t": "Transfer",
    "budget": "MemoryBudget",
    "ring": "RecvRing",
    "peers": "Peers",
    "ingest": "Ingest",
    "local_api": "LocalApi",
    "peer_service": "PeerService",
    "spool": "Spool",
}
# Records: their fields are their interface (settings, an immutable received chunk, the metric families), so
# only writes to them count.
RECORDS = {"SidecarConfig", "SenderSettings", "InChunk", "Metrics", "ServerLimits"}


class Place(NamedTuple):
    path: str
    line: int
    kind: str           # "write", "private" or "read"
    cls: str
    attr: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.cls}.{self.attr}"


class ClassInfo(NamedTuple):
    module: str
    state: Set[str]
    attr_types: Dict[str, str]      # self.x -> class name, from __init__
    core: bool


def _annotation_name(node: Optional[ast.AST]) -> Optional[str]:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value.strip("'\"").split("[")[0]
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _classes(path: pathlib.Path, rel: str, only: Optional[Set[str]], core: bool) -> Dict[str, ClassInfo]:
    tree = ast.parse(path.read_text(), str(path))
    out = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef) or (only is not None and node.name not in only):
            continue
        state: Set[str] = set()
        attr_types: Dict[str, str] = {}
        for item in node.body:
            if isinstance(item, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__"
                                                    for t in item.targets):
                state |= {e.value for e in ast.walk(item.value) if isinstance(e, ast.Constant)}
            if not isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            params = {a.arg: _annotation_name(a.annotation) for a in item.args.args + item.args.kwonlyargs}
            for sub in ast.walk(item):
                targets = []
                if isinstance(sub, ast.Assign):
                    targets = sub.targets
                elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                    targets = [sub.target]
                for target in targets:
                    for t in ast.walk(target):
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self" \
                                and isinstance(t.ctx, ast.Store):
                            state.add(t.attr)
                            if item.name == "__init__" and isinstance(sub, ast.Assign):
                                v = sub.value
                                if isinstance(v, ast.Call):
                                    name = _annotation_name(v.func)
                                    if name:
                                        attr_types[t.attr] = name
                                elif isinstance(v, ast.Name) and params.get(v.id):
                                    attr_types[t.attr] = params[v.id]
        out[node.name] = ClassInfo(rel, state, attr_types, core or node.name in RECORDS)
    return out


def collect(root: pathlib.Path) -> Dict[str, ClassInfo]:
    classes: Dict[str, ClassInfo] = {}
    for path in sorted((root / SIDECAR).glob("*.py")):
        classes.update(_classes(path, str(path.relative_to(root)), None, False))
    for rel, only in CORE.items():
        classes.update(_classes(root / rel, rel, only, True))
    return classes


class _Visitor(ast.NodeVisitor):
    def __init__(self, rel: str, classes: Dict[str, ClassInfo]):
        self.rel = rel
        self.classes = classes
        self.places: List[Place] = []
        self.scopes: List[Dict[str, str]] = [{}]     # variable -> class, from annotations
        self.owner: List[Optional[str]] = [None]      # the class whose methods we are in

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.owner.append(node.name)
        self.generic_visit(node)
        self.owner.pop()

    def _function(self, node) -> None:
        types = dict(self.scopes[-1])
        for a in node.args.args + node.args.kwonlyargs:
            name = _annotation_name(a.annotation)
            if name in self.classes:
                types[a.arg] = name
        self.scopes.append(types)
        self.generic_visit(node)
        self.scopes.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _class_of(self, expr: ast.AST) -> Optional[str]:
        if isinstance(expr, ast.Name):
            if expr.id == "self":
                return self.owner[-1]
            return self.scopes[-1].get(expr.id) or NAMES.get(expr.id)
        if isinstance(expr, ast.Attribute):
            base = self._class_of(expr.value)
            info = self.classes.get(base) if base else None
            if info is not None and expr.attr in info.attr_types:
                return info.attr_types[expr.attr]
            return NAMES.get(expr.attr)
        return None

    def _check(self, node: ast.Attribute, write: bool) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            return
        cls = self._class_of(node.value)
        info = self.classes.get(cls) if cls else None
        if info is None or info.module == self.rel or node.attr not in info.state:
            return
        private = node.attr.startswith("_")
        if info.core and not (write or private):
            return
        kind = "write" if write else ("private" if private else "read")
        self.places.append(Place(self.rel, node.lineno, kind, cls, node.attr))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._check(node, isinstance(node.ctx, (ast.Store, ast.Del)))
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        if isinstance(node.target, ast.Attribute):
            self._check(node.target, True)
            self.generic_visit(node.target.value)
            self.visit(node.value)
        else:
            self.generic_visit(node)


def places(root: pathlib.Path) -> List[Place]:
    classes = collect(root)
    out: List[Place] = []
    for path in sorted((root / SIDECAR).glob("*.py")):
        rel = str(path.relative_to(root))
        v = _Visitor(rel, classes)
        v.visit(ast.parse(path.read_text(), str(path)))
        out += v.places
    return out


def main(argv: List[str]) -> int:
    verbose = "-v" in argv
    args = [a for a in argv if a != "-v"]
    root = pathlib.Path(args[0]) if args else REPO
    found = places(root)
    if verbose:
        for p in found:
            print(p)
    kinds = Counter(p.kind for p in found)
    pairs = Counter((p.path.rsplit("/", 1)[-1], p.cls) for p in found)
    for (module, cls), n in sorted(pairs.items()):
        print(f"  {module:<18} -> {cls:<14} {n}")
    print(f"total {len(found)}: write {kinds['write']}, private {kinds['private']}, read {kinds['read']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
