"""A connection attempt to the local sidecar (the vLLM connector's channels) or to a peer sidecar gets
the time a busy host or a slow link needs. Their options once set gRPC's ``min_reconnect_backoff_ms``
to 100 ms, which gRPC takes as the time a connection attempt may take: on a loaded CI machine the
handshake was cut off ("tcp handshaker shutdown") and a transfer's first call failed at once. Here the
handshake is slowed by a proxy on 127.0.0.1 that holds each connection for half a second."""
import asyncio
import socket
import threading
from concurrent import futures
from types import SimpleNamespace

import grpc
import pytest

DELAY_S = 0.5


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class SlowProxy:
    """Accepts on 127.0.0.1, waits DELAY_S, then relays to ``target`` both ways."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        threading.Event().wait(DELAY_S)
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:  # the server is gone (the test ended)
            client.close()
            return
        self.conns += [client, upstream]
        threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
        _pipe(upstream, client)

    def close(self) -> None:
        self.sock.close()
        for s in self.conns:
            s.close()


@pytest.fixture
def slow_address():
    server = grpc.server(futures.ThreadPoolExecutor(2))
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", {"Echo": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    proxy = SlowProxy(port)
    yield f"127.0.0.1:{proxy.port}"
    proxy.close()
    server.stop(0)


def test_the_connectors_channel_waits_for_a_slow_handshake(slow_address):
    from ciuicflow.integrations.vllm.worker import CHANNEL_OPTIONS

    with grpc.insecure_channel(slow_address, options=CHANNEL_OPTIONS) as channel:
        # a plain (fail-fast) call on a fresh channel, as a transfer's first call is
        assert channel.unary_unary("/t.T/Echo")(b"local", timeout=10) == b"local"


def test_a_peer_channel_waits_for_a_slow_handshake(slow_address):
    from ciuicflow.kvflow.sidecar.grpc_setup import peer_channel

    async def call():
        channel = peer_channel(SimpleNamespace(max_message_bytes=1 << 20, tls_cert=None), slow_address)
        try:
            return await channel.unary_unary("/t.T/Echo")(b"peer", timeout=10)
        finally:
            await channel.close()

    assert asyncio.run(call()) == b"peer"
