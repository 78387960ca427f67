"""Identity and authorization: peer names bound to credentials (per-peer secrets, certificate names), transfer
keys scoped by the authenticated source, tokens compared in constant time and read from files or the
environment (empty ones refused), and a local API closed to other local users by default."""
import hmac
import os
import shutil
import subprocess
import sys

import grpc
import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.core.identity import AuthError, PeerPolicy, tokens_equal
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.kvflow.proto import runtime
from tests.kvflow.certs import make_ca, make_leaf
from tests import REPO
from tests.kvflow.raw import RawLink, chunk as _chunk, open_frame as _open

DATA_PLANE = "/ciuicflow.kvflow.v1.KVFlowPeer/DataPlane"


def _refused(listen, metadata, credentials=None) -> grpc.StatusCode:
    with RawLink(listen, metadata, credentials) as link:
        link.send(_open("claimed"))
        with pytest.raises(grpc.RpcError) as err:
            link.recv()
        return err.value.code()


def _write(path, text, mode=0o600):
    path.write_text(text)
    path.chmod(mode)
    return str(path)


# ---------------------------------------------------------------------- peer names bound to credentials
def test_peer_secrets_bind_names_to_credentials(sidecars, tmp_path):
    """A peer with its own secret, the shared token or a guess cannot use another peer's name."""
    b = sidecars.make("b", args=["--peer-secrets-file", _write(tmp_path / "b.toml", 'a = "sec-a"\nx = "sec-x"\n'),
                                 "--token-file", _write(tmp_path / "token", "shared-token\n")])
    a = sidecars.make("a", args=["--peer-secrets-file", _write(tmp_path / "a.toml", 'b = "sec-a"\n')])
    x = sidecars.make("x", args=["--peer-secrets-file", _write(tmp_path / "x.toml", 'b = "sec-x"\n')])
    a.peers, x.peers, b.peers = {"b": b.listen}, {"b": b.listen}, {"a": a.listen, "x": x.listen}
    sidecars.start_all(b, a, x)
    a.client().send("b", "from-a", b"a's bytes").wait(20)
    x.client().send("b", "from-x", b"x's bytes").wait(20)
    cb = b.client()
    assert cb.recv("from-a", timeout_s=10, source="a") == b"a's bytes"
    assert cb.recv("from-x", timeout_s=10, source="x") == b"x's bytes"
    for credential in ("sec-x", "shared-token", "guess"):
        assert _refused(b.listen, (("x-ciuic-peer", "a"), ("authorization", f"Bearer {credential}"))) == \
            grpc.StatusCode.UNAUTHENTICATED, credential
    # a name without a secret, even with the shared token
    assert _refused(b.listen, (("x-ciuic-peer", "nobody"), ("authorization", "Bearer shared-token"))) == \
        grpc.StatusCode.UNAUTHENTICATED
    # no data plane ticket for the claimed name either
    with grpc.insecure_channel(b.listen) as ch:
        call = ch.unary_unary(DATA_PLANE, request_serializer=pb.DataPlaneRequest.SerializeToString,
                              response_deserializer=pb.DataPlaneReply.FromString)
        with pytest.raises(grpc.RpcError) as err:
            call(pb.DataPlaneRequest(), metadata=(("x-ciuic-peer", "a"), ("authorization", "Bearer sec-x")),
                 timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "claimed" not in cb.stats()["store"]["keys"]


def test_mutual_tls_binds_peer_names_to_certificates(sidecars, tmp_path):
    """A certificate signed by the right CA proves its own name only."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    ca = make_ca(tmp_path, "ca")
    tls = {name: make_leaf(tmp_path, ca, name) for name in ("a", "b", "c")}

    def args(name):
        cert, key = tls[name]
        return ["--tls-cert", cert, "--tls-key", key, "--tls-ca", str(tmp_path / "ca.pem")]

    a, b = sidecars.pair(a_args=args("a"), b_args=args("b") + ["--allow-unknown-peers"])
    a.client().send("b", "tls-ok", b"over mutual TLS").wait(30)
    assert b.client().recv("tls-ok", timeout_s=10) == b"over mutual TLS"
    cert, key = tls["c"]
    creds = grpc.ssl_channel_credentials(root_certificates=(tmp_path / "ca.pem").read_bytes(),
                                         private_key=open(key, "rb").read(), certificate_chain=open(cert, "rb").read())
    assert _refused(b.listen, (("x-ciuic-peer", "a"),), creds) == grpc.StatusCode.PERMISSION_DENIED
    with RawLink(b.listen, (("x-ciuic-peer", "c"),), creds) as link:      # its own name: accepted
        link.send(_open("as-c"))
        assert link.recv().state.tid == 1


def test_peer_policy_checks_unit(monkeypatch):
    """The rules on their own, and every comparison through hmac.compare_digest (constant time)."""
    compared = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda x, y: compared.append(1) or real(x, y))
    policy = PeerPolicy(token="t0ken", known_peers=("a",))
    assert policy.authenticate("a", "Bearer t0ken", None) == "a" and compared
    for name, auth, code in (("a", "Bearer t0keN", grpc.StatusCode.UNAUTHENTICATED),
                             ("a", "t0ken", grpc.StatusCode.UNAUTHENTICATED),
                             ("", "Bearer t0ken", grpc.StatusCode.INVALID_ARGUMENT),
                             ("a b", "Bearer t0ken", grpc.StatusCode.INVALID_ARGUMENT),
                             ("z" * 200, "Bearer t0ken", grpc.StatusCode.INVALID_ARGUMENT),
                             ("b", "Bearer t0ken", grpc.StatusCode.PERMISSION_DENIED)):
        with pytest.raises(AuthError) as err:
            policy.authenticate(name, auth, None)
        assert err.value.code == code, (name, auth)
    tls = PeerPolicy(mutual_tls=True, allow_unknown_peers=True)
    assert tls.authenticate("c", None, ["c", "localhost"]) == "c"
    with pytest.raises(AuthError):
        tls.authenticate("a", None, ["c"])
    secrets = PeerPolicy(token="shared", peer_secrets={"a": "sa"}, known_peers=("a", "b"))
    assert secrets.credential_for("a") == "sa" and secrets.credential_for("b") == "shared"
    with pytest.raises(AuthError):
        secrets.authenticate("b", "Bearer shared", None)         # no secret for b: the token does not do
    assert not tokens_equal("", "") and not tokens_equal(None, "x") and tokens_equal("x", "x")


# ---------------------------------------------------------------------- keys scoped by source
def test_keys_are_scoped_by_the_authenticated_source(sidecars):
    """Another peer can neither take a key first nor resume (and replace) a transfer in progress."""
    b = sidecars.make("b")
    a, x = sidecars.make("a"), sidecars.make("x")
    a.peers, x.peers, b.peers = {"b": b.listen}, {"b": b.listen}, {"a": a.listen, "x": x.listen}
    sidecars.start_all(b, a, x)
    x.client().send("b", "req-1", b"squatter's bytes").wait(20)
    a.client().send("b", "req-1", b"the real cache").wait(20)      # not ALREADY_EXISTS
    cb = b.client()
    with pytest.raises(KVFlowError) as err:
        cb.recv("req-1", timeout_s=5)                              # two peers sent it: say which
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert cb.recv("req-1", timeout_s=5, source="a") == b"the real cache"
    assert cb.recv("req-1", timeout_s=5) == b"squatter's bytes"   # the only one left
    # x resumes a's transfer in progress (same key, same uuid): it gets a transfer of its own
    with RawLink(b.listen, (("x-ciuic-peer", "a"),)) as link_a, RawLink(b.listen, (("x-ciuic-peer", "x"),)) as link_x:
        link_a.send(_open("req-2", uuid="u-2"))
        assert link_a.recv().state.held_chunks == 0
        link_a.send(_chunk(b"AAAA"))
        assert link_a.recv().ack.code == pb.ACK_OK
        link_x.send(_open("req-2", uuid="u-2", resume=True))
        assert link_x.recv().state.held_chunks == 0                # not a's chunk
        link_x.send(_chunk(b"XXXX"))
        assert link_x.recv().ack.code == pb.ACK_OK
        link_x.send(pb.PeerFrame(commit=pb.Commit(tid=1, total_chunks=1, num_parts=1)))
        assert link_x.recv().commit.error_code == 0
        link_a.send(pb.PeerFrame(commit=pb.Commit(tid=1, total_chunks=1, num_parts=1)))
        assert link_a.recv().commit.error_code == 0
    assert cb.recv("req-2", timeout_s=5, source="a") == b"AAAA"
    got = cb.recv_stream("req-2", timeout_s=5)
    assert b"".join(p.value for p in got) == b"XXXX" and got.header.source == "x"


# ---------------------------------------------------------------------- tokens
def _sidecar_exit(args, env=None, timeout=30):
    cmd = [sys.executable, "-m", "ciuicflow.kvflow.server", "--name", "t", "--api", "127.0.0.1:0",
           "--listen", "127.0.0.1:0", *args]
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)


def test_empty_tokens_are_refused(tmp_path):
    """An empty token (flag, file or environment) stops the sidecar at start-up, never disables auth."""
    empty = _write(tmp_path / "empty", "\n  \n")
    secrets = _write(tmp_path / "secrets.toml", 'a = ""\n')
    for args, env in ((["--token-file", empty], None), (["--token", ""], None),
                      ([], {"CIUICFLOW_KVFLOW_TOKEN": ""}), (["--api-token-file", empty], None),
                      (["--api-token", " "], None), ([], {"CIUICFLOW_KVFLOW_API_TOKEN": ""}),
                      (["--peer-secrets-file", secrets], None)):
        proc = _sidecar_exit(args, env)
        assert proc.returncode == 2 and "empty" in proc.stderr, (args, env, proc.stderr)


def test_tokens_from_files_and_the_environment(sidecars, tmp_path):
    token_file = _write(tmp_path / "token", "from-a-file\n")
    b = sidecars.make("b", env={"CIUICFLOW_KVFLOW_TOKEN": "from-a-file"})
    a = sidecars.make("a", args=["--token-file", token_file])
    flagged = sidecars.make("c", args=["--token", "from-a-file"])
    a.peers, flagged.peers, b.peers = {"b": b.listen}, {"b": b.listen}, {"a": a.listen, "c": flagged.listen}
    sidecars.start_all(b, a, flagged)
    a.client().send("b", "tok-1", b"hello").wait(20)
    assert b.client().recv("tok-1", timeout_s=10) == b"hello"
    assert _refused(b.listen, (("x-ciuic-peer", "a"), ("authorization", "Bearer from-a-fil"))) == \
        grpc.StatusCode.UNAUTHENTICATED
    assert "visible to every local user" in flagged.log()      # a token given as a flag works, with a warning
    flagged.client().send("b", "tok-2", b"x").wait(20)


# ---------------------------------------------------------------------- the local API and other local users
def test_local_api_refuses_other_local_users(sidecars, unprivileged):
    """By default the local API needs a token, published for the sidecar's own user only: another local
    user can neither send, nor receive, nor read the counters; the sidecar's user needs no setup."""
    a, b = sidecars.pair()
    a.client().send("b", "private", b"a user's prompt").wait(20)
    code = f"""
from ciuicflow.kvflow import Client, KVFlowError
out = []
for name, call in (("stats", lambda: Client({a.api!r}).stats()),
                   ("send", lambda: Client({a.api!r}).send("b", "evil", b"x").wait(10)),
                   ("recv", lambda: Client({b.api!r}, shm=False).recv("private", timeout_s=3))):
    try:
        call()
        out.append(name + ":OK")
    except KVFlowError as exc:
        out.append(name + ":" + exc.code.name)
print(" ".join(out))
"""
    r = unprivileged.run(code)
    assert r.stdout.split() == ["stats:UNAUTHENTICATED", "send:UNAUTHENTICATED", "recv:UNAUTHENTICATED"], r.stderr
    path = runtime.api_file(int(b.api.rpartition(":")[2]), "token")
    r = unprivileged.run(f"open({path!r}).read()")
    assert r.returncode != 0 and "PermissionError" in r.stderr
    assert b.client().recv("private", timeout_s=5) == b"a user's prompt"


def test_clients_keep_their_token_across_a_sidecar_restart(sidecars):
    """The token a sidecar made for its port stays the same when it restarts: its clients keep working
    (a new random token each time would lock every running client out)."""
    a, b = sidecars.pair()
    ca, cb = a.client(), b.client()
    ca.send("b", "before", b"1").wait(20)
    assert cb.recv("before", timeout_s=10) == b"1"
    b.restart()
    a.restart()
    ca.send("b", "after", b"2").wait(30)
    assert cb.recv("after", timeout_s=10) == b"2"


LOOPBACK = ["--listen", "127.0.0.1:1"]      # no peer credential needed (the default 0.0.0.0 needs one)


def test_local_api_token_options(sidecars, tmp_path):
    """--no-api-token is loopback only; --allow-remote-api keeps the token."""
    from ciuicflow.kvflow.sidecar.config import load_config
    with pytest.raises(ValueError):
        load_config(["--api", "0.0.0.0:1", "--allow-remote-api", "--no-api-token", *LOOPBACK])
    with pytest.raises(ValueError):
        load_config(["--no-api-token", "--api-token-file", _write(tmp_path / "t", "x"), *LOOPBACK])
    assert load_config(["--api", "0.0.0.0:1", "--allow-remote-api", *LOOPBACK]).no_api_token is False
