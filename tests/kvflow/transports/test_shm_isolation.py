"""Shared-memory isolation: a local caller can make the sidecar open only its own rings (descriptors handed
over the sidecar's Unix socket, or named files with their secret), never another process's (by
/proc/PID/fd/N or by name), and the sidecar's answers say nothing about what was named; named files are
opened from the directory taken at start, so a directory swapped for a symlink redirects nothing."""
import json
import os
import subprocess
import sys

import pytest

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
from ciuicflow.kvflow.proto import shm as shmlib
from tests import REPO

pytestmark = pytest.mark.skipif(not shmlib.available(), reason="no writable /dev/shm")

TOKEN = "clients-of-two-users"
RING = 1 << 20
SECRET_DATA = b"the victim's KV cache, 32 bytes"

VICTIM = r"""
import json, os, sys, time
from ciuicflow.kvflow.proto import shm
fd, path = shm.create_ring("victim", %(ring)d)
shm.write_all(fd, %(data)r, shm.HEADER)
shm.new_secret(fd)
hidden, hidden_path = shm.create_ring("hidden", %(ring)d)
shm.write_all(hidden, %(data)r, shm.HEADER)
shm.unlink(hidden_path)
private_path = "/tmp/victim-private-%%d.txt" %% os.getpid()
private = os.open(private_path, os.O_RDWR | os.O_CREAT, 0o600)
print(json.dumps({"pid": os.getpid(), "named": path, "hidden_fd": hidden, "private_fd": private,
                  "private_path": private_path}), flush=True)
sys.stdin.read()
os.unlink(private_path)
shm.unlink(path)
"""

ATTACKER = r"""
import json, sys
import grpc
from ciuicflow.kvflow import Client
from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.proto import kvflow_pb2 as pb
v = json.loads(sys.argv[1])
ca, cb = Client(v["api_a"], shm=False), Client(v["api_b"], shm=False)
out = {}
probe = ca._stub.ShmProbe(pb.ShmProbeRequest(path="/proc/%d/fd/%d" % (v["pid"], v["private_fd"]), nonce=b"0" * 16),
                          metadata=ca._metadata(False), timeout=10)
out["probe"] = [probe.ok, probe.message]
for name, path in (("proc", "/proc/%d/fd/%d" % (v["pid"], v["hidden_fd"])), ("named", v["named"]),
                   ("guess", v["named"] + "#" + "00" * 32)):
    req = [pb.SendRequest(header=pb.SendHeader(dest="b", key=v["tag"] + "-steal-" + name, payload_kind="bytes")),
           pb.SendRequest(data=pb.SendData(part=0, offset=0, info=pb.PartInfo(index=0, nbytes=32),
                                           shm=pb.ShmRef(path=path, offset=0, length=32, ring_bytes=v["ring"]))),
           pb.SendRequest(end=pb.SendEnd(num_parts=1))]
    try:
        ca._stub.Send(iter(req), metadata=ca._metadata(True), timeout=20)
        out[name] = "SENT"
    except grpc.RpcError as exc:
        out[name] = [exc.code().name, exc.details()]
# a Recv whose ring is the victim's: the sidecar would write the chunk into it
ca.send("b", v["tag"] + "-own", b"x" * 100).wait(20)
replies = list(cb._stub.Recv(pb.RecvRequest(key=v["tag"] + "-own", timeout_s=10, shm_ring_bytes=v["ring"],
                                            shm_path="/proc/%d/fd/%d" % (v["pid"], v["hidden_fd"])),
                             metadata=cb._metadata(False), timeout=20))
out["recv_in_band"] = all(r.WhichOneof("msg") != "batch" and not (r.HasField("data") and r.data.HasField("shm"))
                          for r in replies)
print(json.dumps(out))
"""


@pytest.fixture
def victim():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", VICTIM % {"ring": RING, "data": SECRET_DATA}], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    info = json.loads(proc.stdout.readline())
    yield info
    proc.stdin.close()
    proc.wait(10)


def _victim_ring_untouched(info) -> bool:
    with open(f"/proc/{info['pid']}/fd/{info['hidden_fd']}", "rb") as fh:
        head = fh.read(shmlib.HEADER + len(SECRET_DATA))
    with open(info["named"], "rb") as fh:
        named = fh.read(shmlib.HEADER + len(SECRET_DATA))
    return (head[:8] == named[:8] == bytes(8) and head[shmlib.HEADER:] == named[shmlib.HEADER:] == SECRET_DATA)


def test_callers_cannot_open_other_processes_rings(sidecars, tmp_path, victim, unprivileged):
    """Another local user holding the API token, and another process of the sidecar's own user, try to read
    (by descriptor path and by name), overwrite and probe a victim's rings through the sidecar: refused,
    and the answers reveal nothing of the victim's descriptors."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    args = ["--api-token-file", str(token)]
    a, b = sidecars.pair(a_args=args, b_args=args)
    for tag, run in (("user", lambda argv: unprivileged.run(ATTACKER.replace("sys.argv[1]", repr(argv)),
                                                            env={"CIUICFLOW_KVFLOW_API_TOKEN": TOKEN})),
                     ("same-user", lambda argv: subprocess.run([sys.executable, "-c", ATTACKER, argv],
                                                               env={**os.environ, "PYTHONPATH": str(REPO)},
                                                               capture_output=True, text=True, timeout=60))):
        argv = json.dumps({**victim, "api_a": a.api, "api_b": b.api, "ring": RING, "tag": tag})
        r = run(argv)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        assert not out["probe"][0] and victim["private_path"] not in out["probe"][1], out
        assert "/proc" not in out["probe"][1] and "victim" not in out["probe"][1]
        for name in ("proc", "named", "guess"):
            assert out[name][0] == "FAILED_PRECONDITION", (tag, name, out[name])
            assert victim["named"] not in out[name][1] and "/proc/" not in out[name][1]
        assert out["recv_in_band"], tag
        for name in ("proc", "named", "guess"):     # nothing of the victim's arrived (at most a failed transfer)
            with pytest.raises(KVFlowError):
                b.client().recv(f"{tag}-steal-{name}", timeout_s=1)
        assert _victim_ring_untouched(victim)


def test_another_users_client_uses_its_own_named_files(sidecars, tmp_path, unprivileged):
    """A client of another user (given the token) cannot reach the descriptor socket, and uses named files
    with their secret: the sidecar opens its files, and only those."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    args = ["--api-token-file", str(token), "--chunk-size", "64KiB"]
    a, b = sidecars.pair(a_args=args, b_args=args)
    code = f"""
import os
from ciuicflow.kvflow import Client
c = Client({a.api!r}, shm=True)
payload = os.urandom(300_000)
c.send("b", "other-user", payload).wait(30)
print(c._rings.by_fd, payload.hex())
"""
    r = unprivileged.run(code, env={"CIUICFLOW_KVFLOW_API_TOKEN": TOKEN})
    assert r.returncode == 0, r.stderr
    by_fd, payload = r.stdout.split()
    assert by_fd == "False"
    assert b.client().recv("other-user", timeout_s=10).hex() == payload


def test_named_files_are_opened_from_the_directory_taken_at_start(sidecars, tmp_path):
    """A path through a symlinked directory is refused, and swapping the shared-memory directory for a
    symlink after start redirects nothing: the sidecar opens names in the directory it opened."""
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    env = {"CIUICFLOW_KVFLOW_SHM_DIR": str(shm_dir)}
    a = sidecars.make("a", env=env)
    sidecars.start_all(a)
    os.environ["CIUICFLOW_KVFLOW_SHM_DIR"] = str(shm_dir)
    try:
        ca = a.client(shm=False)

        def probe(path, secret, nonce=b"0123456789abcdef"):
            return ca._stub.ShmProbe(pb.ShmProbeRequest(path=shmlib.named_ref(path, secret), nonce=nonce),
                                     metadata=ca._metadata(False), timeout=10).ok

        fd, path = shmlib.create("t")
        os.write(fd, b"0123456789abcdef" + bytes(2 * shmlib.PAGE))
        secret = shmlib.new_secret(fd)
        assert probe(path, secret)
        alias = tmp_path / "alias"
        alias.symlink_to(shm_dir)
        assert not probe(str(alias / os.path.basename(path)), secret)      # the same file, through a link
        # swap the directory for a symlink to a decoy holding a file of the same name (other content)
        decoy = tmp_path / "decoy"
        decoy.mkdir()
        name = os.path.basename(path)
        (decoy / name).write_bytes(b"decoy-decoy-deco" + bytes(48) + secret + bytes(2 * shmlib.PAGE))
        os.rename(shm_dir, tmp_path / "shm-moved")
        shm_dir.symlink_to(decoy)
        assert not probe(str(shm_dir / name), secret, nonce=b"decoy-decoy-deco")    # the decoy was not opened
        assert probe(str(shm_dir / name), secret)           # the file in the directory opened at start was
        os.close(fd)
    finally:
        del os.environ["CIUICFLOW_KVFLOW_SHM_DIR"]
