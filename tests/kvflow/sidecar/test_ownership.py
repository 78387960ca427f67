"""One owner per piece of the sidecar's state (docs/architecture.md): no module of ciuicflow/kvflow/sidecar/
writes another's objects or reads their private names, and the outgoing side (Outbox, PeerSender, Peers)
is reached through methods only, their names aside. Counted by refs.py (ast; how, there)."""
from tests import REPO

from tests.kvflow.sidecar.refs import places

ROOT = REPO
NAMES = {"name", "address", "dest"}     # who a sender is: fixed at its birth


def test_no_module_writes_another_modules_state():
    found = places(ROOT)
    bad = [str(p) for p in found if p.kind in ("write", "private")]
    assert not bad, "\n".join(bad)
    outgoing = [str(p) for p in found if p.cls in ("Outbox", "PeerSender", "Peers") and p.attr not in NAMES]
    assert not outgoing, "\n".join(outgoing)


def test_the_count_sees_pokes(tmp_path):
    side = tmp_path / "ciuicflow/kvflow/sidecar"
    core = tmp_path / "ciuicflow/kvflow/core"
    side.mkdir(parents=True)
    core.mkdir(parents=True)
    (core / "transfer.py").write_text("class Transfer:\n    def __init__(self):\n        self.buffered = 0\n")
    (core / "budget.py").write_text("class MemoryBudget:\n    pass\n")
    (side / "outbox.py").write_text("class Outbox:\n    def __init__(self):\n        self.closed = False\n"
                                    "        self._fifo = []\n")
    (side / "peer_sender.py").write_text(
        "class PeerSender:\n    def __init__(self, s):\n        self.outbox = Outbox(s)\n"
        "    def close(self, t):\n        self.outbox.closed = True\n        t.buffered += 1\n"
        "        return self.outbox._fifo\n")
    got = sorted((p.kind, p.cls, p.attr) for p in places(tmp_path))
    assert got == [("private", "Outbox", "_fifo"), ("write", "Outbox", "closed"), ("write", "Transfer", "buffered")]
