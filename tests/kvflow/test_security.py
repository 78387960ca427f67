"""Peer links refuse senders without credentials: shared token, mutual TLS, data plane tickets."""
import json
import os
import shutil

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.testing.crafted import wire_session as _wire_session
from tests.kvflow.certs import make_ca as _make_ca, make_leaf as _make_leaf
from tests.kvflow.raw import ticket as _ticket

LINK = "/ciuicflow.kvflow.v1.KVFlowPeer/Link"


def test_kvflow_token_required_on_peer_links(sidecars):
    b = sidecars.make("b", args=["--token", "s3cret"])
    good = sidecars.make("a", args=["--token", "s3cret"])
    bad = sidecars.make("intruder")                      # no token
    good.peers = {"b": b.listen}
    bad.peers = {"b": b.listen}
    b.peers = {"a": good.listen, "intruder": bad.listen}
    sidecars.start_all(b, good, bad)
    with pytest.raises(KVFlowError) as e:
        bad.client().send("b", "t-1", b"let me in").wait(20)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    # raw calls: no token, wrong token
    with grpc.insecure_channel(b.listen) as ch:
        link = ch.stream_stream(LINK, request_serializer=pb.PeerFrame.SerializeToString,
                                response_deserializer=pb.PeerReply.FromString)
        for md in ((("x-ciuic-peer", "a"),), (("x-ciuic-peer", "a"), ("authorization", "Bearer guess"))):
            with pytest.raises(grpc.RpcError) as err:
                list(link(iter([]), metadata=md, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # the right token works, and b never stored the intruder's data
    good.client().send("b", "t-2", b"hello").wait(20)
    cb = b.client()
    assert cb.recv("t-2", timeout_s=10) == b"hello"
    assert "t-1" not in cb.stats()["store"]["keys"]


def test_kvflow_local_api_token(sidecars, tmp_path):
    token = tmp_path / "api-token"
    token.write_text("local\n")
    a, b = sidecars.pair(a_args=["--api-token-file", str(token)])
    for wrong in ("wrong", "loca", "locall"):
        with pytest.raises(KVFlowError) as e:
            a.client(token=wrong).send("b", "x", b"x").wait(10)
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    a.client(token="local").send("b", "x", b"x").wait(10)
    assert b.client().recv("x", timeout_s=10) == b"x"
    a.client().send("b", "y", b"y").wait(10)        # this user's clients find the token by themselves
    assert b.client().recv("y", timeout_s=10) == b"y"


# ---------------------------------------------------------------------- mutual TLS
def test_kvflow_mutual_tls(sidecars, tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    ca = _make_ca(tmp_path, "ca")
    ca_path = tmp_path / "ca.pem"
    tls = {name: _make_leaf(tmp_path, ca, name) for name in ("a", "b")}
    rogue_cert, rogue_key = _make_leaf(tmp_path, _make_ca(tmp_path, "rogue-ca"), "rogue")

    def args(name):
        cert, key = tls[name]
        return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", str(ca_path)]

    a, b = sidecars.pair(a_args=args("a"), b_args=args("b"))
    payload = os.urandom(1 << 20)
    a.client().send("b", "tls-1", payload, priority="high").wait(30)
    assert b.client().recv("tls-1", timeout_s=10) == payload
    # the TCP data plane has no TLS: with TLS, chunks go on the gRPC stream and no data port is open
    assert a.stats()["peers"]["b"]["transport"] == "grpc"
    assert b.stats()["data_port"] is None

    frames = [pb.PeerFrame(open=pb.TransferOpen(tid=1, key="x", uuid="u"))]
    md = (("x-ciuic-peer", "a"),)

    def attempt(channel):
        link = channel.stream_stream(LINK, request_serializer=pb.PeerFrame.SerializeToString,
                                     response_deserializer=pb.PeerReply.FromString)
        with pytest.raises(grpc.RpcError) as err:
            list(link(iter(frames), metadata=md, timeout=5))
        return err.value.code()

    ca_pem = ca_path.read_bytes()
    # plaintext against the TLS port
    with grpc.insecure_channel(b.listen) as ch:
        assert attempt(ch) == grpc.StatusCode.UNAVAILABLE
    # TLS without a client certificate
    with grpc.secure_channel(b.listen, grpc.ssl_channel_credentials(root_certificates=ca_pem)) as ch:
        assert attempt(ch) == grpc.StatusCode.UNAVAILABLE
    # a client certificate from another CA
    creds = grpc.ssl_channel_credentials(root_certificates=ca_pem, private_key=open(rogue_key, "rb").read(),
                                         certificate_chain=open(rogue_cert, "rb").read())
    with grpc.secure_channel(b.listen, creds) as ch:
        assert attempt(ch) == grpc.StatusCode.UNAVAILABLE
    # a sidecar with the rogue certificate cannot deliver either
    rogue = sidecars.make("a", args=["--tls-cert", rogue_cert, "--tls-key", rogue_key, "--tls-ca", str(ca_path),
                                     "--resume-timeout-s", "2"])
    rogue.peers = {"b": b.listen}
    sidecars.start_all(rogue)
    with pytest.raises(KVFlowError) as e:
        rogue.client().send("b", "tls-2", b"spoofed").wait(30)
    assert e.value.code == grpc.StatusCode.UNAVAILABLE
    assert "tls-2" not in b.client().stats()["store"]["keys"]


# ---------------------------------------------------------------------- the TCP data plane
def test_kvflow_data_plane_needs_a_ticket_from_an_authenticated_sender(sidecars):
    from ciuicflow.kvflow.transports.tcp import HELLO, MSG, STATUS
    b = sidecars.make("b", args=["--token", "s3cret"])
    a = sidecars.make("a", args=["--token", "s3cret"])
    a.peers, b.peers = {"b": b.listen}, {"a": a.listen}
    sidecars.start_all(a, b)
    payload = os.urandom(3 << 20)
    a.client().send("b", "dp-1", payload).wait(30)
    assert b.client().recv("dp-1", timeout_s=10) == payload
    assert a.stats()["peers"]["b"]["transport"] == "tcp"
    port = b.stats()["data_port"]
    # no token, no ticket
    with pytest.raises(grpc.RpcError) as err:
        _ticket(b.listen, (("x-ciuic-peer", "a"),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    unauthenticated = [(STATUS, grpc.StatusCode.UNAUTHENTICATED.value[0])]
    open_frame = pb.PeerFrame(open=pb.TransferOpen(tid=1, key="dp-forged", uuid="u")).SerializeToString()
    # a made-up ticket, or frames with no hello at all
    assert _wire_session(port, [(HELLO, os.urandom(24)), (MSG, open_frame)]) == unauthenticated
    assert _wire_session(port, [(MSG, open_frame)]) == unauthenticated
    # a real ticket works once
    ticket = _ticket(b.listen, (("x-ciuic-peer", "a"), ("authorization", "Bearer s3cret"))).ticket
    legit_open = pb.PeerFrame(open=pb.TransferOpen(tid=1, key="dp-open", uuid="u")).SerializeToString()
    replies = _wire_session(port, [(HELLO, ticket), (MSG, legit_open)])
    assert replies[-1] == (STATUS, 0) and pb.PeerReply.FromString(replies[0][1]).state.tid == 1
    assert _wire_session(port, [(HELLO, ticket), (MSG, open_frame)]) == unauthenticated
    # malformed and oversized frames end that stream with a clear status; the sidecar keeps serving
    ticket = _ticket(b.listen, (("x-ciuic-peer", "a"), ("authorization", "Bearer s3cret"))).ticket
    assert _wire_session(port, [(HELLO, ticket), (MSG, b"\xff\xff\xff")])[-1] == \
        (STATUS, grpc.StatusCode.INVALID_ARGUMENT.value[0])
    ticket = _ticket(b.listen, (("x-ciuic-peer", "a"), ("authorization", "Bearer s3cret"))).ticket
    import socket

    from ciuicflow.kvflow.transports.tcp import HEAD
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(HEAD.pack(HELLO, len(ticket)) + ticket + HEAD.pack(MSG, 1 << 30))     # a 1 GiB frame
        reply = s.recv(4096)
    kind, n = HEAD.unpack_from(reply)
    assert kind == STATUS and json.loads(reply[HEAD.size:HEAD.size + n])["code"] == \
        grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
    a.client().send("b", "dp-2", b"still fine").wait(30)
    assert b.client().recv("dp-2", timeout_s=10) == b"still fine"
    assert "dp-forged" not in b.client().stats()["store"]["keys"]
    assert "lost" not in a.log()        # other connections' trouble never touched a's link



def test_kvflow_malformed_packed_chunk_fails_its_transfer(sidecars):
    """A packed chunk whose parts do not add up to its bytes fails its transfer (never a wrong split)."""
    import crc32c

    from ciuicflow.kvflow.transports.tcp import HELLO, MSG, STATUS
    b = sidecars.make("b", args=["--allow-unknown-peers"])
    sidecars.start_all(b)
    port = b.stats()["data_port"]
    data = os.urandom(21)
    frames = [pb.PeerFrame(open=pb.TransferOpen(tid=1, key="packed-bad", uuid="u")),
              pb.PeerFrame(chunk=pb.Chunk(tid=1, seq=0, sn=1, part=0, offset=0, data=data, crc32c=crc32c.crc32c(data),
                                          info=pb.PartInfo(index=0, nbytes=10),
                                          more=[pb.PartInfo(index=1, nbytes=10)]))]
    ticket = _ticket(b.listen, (("x-ciuic-peer", "a"),)).ticket
    replies = _wire_session(port, [(HELLO, ticket)] + [(MSG, f.SerializeToString()) for f in frames])
    assert replies[-1] == (STATUS, 0)
    ack = pb.PeerReply.FromString(replies[1][1]).ack
    assert ack.code == pb.ACK_FAILED and ack.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "has 21 bytes" in ack.message
    with pytest.raises(KVFlowError) as err:
        b.client().recv("packed-bad", timeout_s=5)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT

def test_kvflow_grpc_transport_on_request(sidecars):
    a, b = sidecars.pair(a_args=["--peer-transport", "grpc"], b_args=["--data-port", "-1", "--allow-unknown-peers"])
    payload = os.urandom(2 << 20)
    a.client().send("b", "g-1", payload).wait(30)
    assert b.client().recv("g-1", timeout_s=10) == payload
    assert a.stats()["peers"]["b"]["transport"] == "grpc"
    # b offers no data plane: a sender that would use it falls back to gRPC
    assert b.stats()["data_port"] is None
    c = sidecars.make("c", peers={"b": b.listen})
    sidecars.start_all(c)
    c.client().send("b", "g-2", payload).wait(30)
    assert b.client().recv("g-2", timeout_s=10) == payload
    assert c.stats()["peers"]["b"]["transport"] == "grpc"


def test_kvflow_unreachable_data_port_falls_back_to_grpc(sidecars):
    """A receiver whose gRPC port answers but whose data port does not (a firewall, a port mapping that
    left it out): the sender delivers over the gRPC stream instead of retrying the data plane forever."""
    from concurrent import futures

    from tests.kvflow.sidecars import free_port
    closed_port = free_port()               # nothing listens there
    seen = []

    def data_plane(request, context):
        return pb.DataPlaneReply(port=closed_port, ticket=b"t")

    def link(frames, context):              # a minimal receiver: holds nothing, acknowledges everything
        for frame in frames:
            kind = frame.WhichOneof("msg")
            seen.append(kind)
            if kind == "open":
                yield pb.PeerReply(state=pb.TransferState(tid=frame.open.tid))
            elif kind == "chunk":
                c = frame.chunk
                yield pb.PeerReply(ack=pb.Ack(tid=c.tid, seq=c.seq, sn=c.sn, code=pb.ACK_OK))
            elif kind == "commit":
                yield pb.PeerReply(commit=pb.CommitAck(tid=frame.commit.tid))

    server = grpc.server(futures.ThreadPoolExecutor(4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("ciuicflow.kvflow.v1.KVFlowPeer", {
        "DataPlane": grpc.unary_unary_rpc_method_handler(
            data_plane, request_deserializer=pb.DataPlaneRequest.FromString,
            response_serializer=pb.DataPlaneReply.SerializeToString),
        "Link": grpc.stream_stream_rpc_method_handler(
            link, request_deserializer=pb.PeerFrame.FromString,
            response_serializer=pb.PeerReply.SerializeToString)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        a = sidecars.make("a", peers={"b": f"127.0.0.1:{port}"})
        sidecars.start_all(a)
        reply = a.client().send("b", "fallback-1", os.urandom(600 << 10)).wait(30)
        assert reply.bytes == 600 << 10
        assert a.stats()["peers"]["b"]["transport"] == "grpc"
        assert "open" in seen and "chunk" in seen and "commit" in seen
        assert f"data plane 127.0.0.1:{closed_port} unreachable" in a.log()
    finally:
        server.stop(None)
