"""A removed peer's teardown never holds up its caller: the registry's watch hands membership events
over one at a time, so a removal that waited on a slow link's close would hide every later join and
leave (bench/soak/chaos.py saw a node miss two peers' return after an etcd restart)."""
import asyncio
import logging

import grpc

from ciuicflow.kvflow.sidecar import peers as peers_module


class _StuckSender:
    def __init__(self):
        self.failed = None
        self.close_started = asyncio.Event()

    def fail_all(self, code, message):
        self.failed = (code, message)

    async def close(self, flush_s: float = 0.0):
        self.close_started.set()
        await asyncio.Event().wait()    # a link that never finishes stopping


def _peers(sender) -> peers_module.Peers:
    peers = peers_module.Peers.__new__(peers_module.Peers)   # only the state remove() owns
    peers._static, peers._senders, peers._channels = set(), {"n1": sender}, {}
    peers.known = {"n1"}
    peers._vanished = peers_module.collections.OrderedDict()
    peers._closing = set()
    return peers


def test_removal_returns_at_once_and_the_stuck_close_is_bounded(monkeypatch, caplog):
    monkeypatch.setattr(peers_module, "CLOSE_S", 0.2)

    async def run():
        sender = _StuckSender()
        peers = _peers(sender)
        await asyncio.wait_for(peers.remove("n1", "its registration ended"), 1.0)
        # gone at once: transfers failed, refused as vanished, no sender
        assert peers.sender("n1") is None and "n1" not in peers.known
        assert sender.failed[0] == grpc.StatusCode.UNAVAILABLE
        assert peers.refusal("n1")[0] == grpc.StatusCode.UNAVAILABLE
        await asyncio.wait_for(sender.close_started.wait(), 1.0)
        # the teardown gives up after CLOSE_S, says so, and is forgotten
        await asyncio.sleep(0.5)
        assert not peers._closing

    with caplog.at_level(logging.WARNING, logger="ciuicflow.kvflow"):
        asyncio.run(run())
    assert any("did not stop within" in r.getMessage() for r in caplog.records)
