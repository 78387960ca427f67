"""Every port bounded by the descriptor budget: floods of idle, slow and garbage connections on the metrics
port, ring handles parked on the descriptor socket, and idle connections on every port of a sidecar whose
descriptor limit is low. The sidecar's threads and descriptors stay bounded, nothing logs EMFILE, and
legitimate work goes on meanwhile (local Stats, transfers between sidecars, another client's handoff)."""
import os
import re
import resource
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

import pytest

from ciuicflow.kvflow.client.handoff import FdHandoff
from ciuicflow.kvflow.proto import runtime
from ciuicflow.kvflow.proto.shm import HEADER
from ciuicflow.testing.crafted import Trickle
from tests import REPO

EMFILE = re.compile(r"Too many open files|EMFILE|out of system resource", re.I)


@pytest.fixture(autouse=True)
def _room_for_the_flood():
    """This process holds a few thousand sockets while flooding: its own soft limit up to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 8192)), hard))
    yield
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _threads(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        return int(next(line for line in fh if line.startswith("Threads:")).split()[1])


def _open(port: int, n: int, family=socket.AF_INET, address=None):
    """Up to ``n`` connections to ``port`` (or the Unix ``address``), held idle; those that failed are left out."""
    held = []
    for _ in range(n):
        s = socket.socket(family, socket.SOCK_STREAM if family == socket.AF_INET else socket.SOCK_SEQPACKET)
        s.settimeout(2)
        try:
            s.connect(address or ("127.0.0.1", port))
            held.append(s)
        except OSError:
            s.close()
    return held


def _closed(s: socket.socket, timeout: float) -> bytes:
    """What the other end sent before it closed ``s`` within ``timeout`` (None: still open)."""
    s.settimeout(timeout)
    data = b""
    try:
        while True:
            more = s.recv(65536)
            if not more:
                return data
            data += more
    except socket.timeout:
        return None
    except OSError:
        return data


def _http(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        return _closed(s, timeout)


def _stats_ms(client) -> float:
    t = time.perf_counter()
    client.stats()
    return (time.perf_counter() - t) * 1000


def _close_all(socks) -> None:
    for s in socks:
        s.close()


def _pair(sidecars, nofile: int, b_args=()):
    """Sidecars a and b (b's descriptor limit ``nofile``), each the other's peer, ready."""
    a, b = sidecars.make("a"), sidecars.make("b", args=b_args)
    a.peers, b.peers = {"b": b.listen}, {"a": a.listen}
    b.nofile = nofile
    sidecars.start_all(a, b)
    return a, b


def _warm(a, b, key: str = "warm"):
    """Clients of both sidecars, and one transfer a -> b (links, data plane and descriptor sockets up)."""
    ca, cb = a.client(), b.client()
    ca.send("b", key, b"warm").wait(30)
    assert cb.recv(key, timeout_s=10) == b"warm"
    return ca, cb


# ---------------------------------------------------------------------- the metrics port
def test_metrics_port_is_bounded(sidecars):
    """~300 idle connections, slow ones and garbage on --metrics-port: those beyond the cap are refused at
    once, the rest closed within the header timeout; no thread per connection, descriptors within the cap;
    garbage answered 4xx without a traceback; local Stats fast and a transfer completes meanwhile."""
    port = sidecars.free_port()
    # 1024: a usual default soft limit; the caps come from it
    a, b = _pair(sidecars, 1024, ["--metrics-port", str(port), "--hello-timeout-s", "3"])
    ca, cb = _warm(a, b)
    cap = cb.stats()["caps"]["metrics"]
    pid = b.proc.pid
    threads0, fds0 = _threads(pid), _fds(pid)

    slow = _open(port, 3)               # slowloris: a request head one byte at a time, never finished
    trickle = Trickle(slow)
    started = time.monotonic()
    held = _open(port, 300)
    try:
        time.sleep(0.5)
        assert _threads(pid) <= threads0 + 1
        assert _fds(pid) <= fds0 + cap + 2
        refused = [s for s in held if _closed(s, 0.01) is not None]
        assert len(refused) >= len(held) - cap and len(held) - len(refused) <= cap
        latencies = sorted(_stats_ms(cb) for _ in range(10))
        assert latencies[5] < 100, latencies
        ca.send("b", "during", os.urandom(1 << 20)).wait(30)
        assert len(cb.recv("during", timeout_s=10)) == 1 << 20
        # the rest are closed within the header timeout (3 s), the slow ones too
        left = [s for s in held if s not in refused] + slow
        assert all(_closed(s, max(0.1, started + 4.5 - time.monotonic())) is not None for s in left)
    finally:
        trickle.stop()
        _close_all(held + slow)
    assert _http(port, os.urandom(200).replace(b"\r\n", b"") + b"\r\n\r\n").startswith(b"HTTP/1.1 400")
    assert _http(port, b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n").startswith(b"HTTP/1.1 431")
    assert _http(port, b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc").startswith(b"HTTP/1.1 405")
    assert _http(port, b"GET /../etc/passwd HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 404")
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert "ciuicflow_kvflow_bytes_total" in text
    assert _threads(pid) <= threads0 + 1 and _fds(pid) <= fds0 + 2
    assert "Traceback" not in b.log() and not EMFILE.search(b.log())


# ---------------------------------------------------------------------- ring handles
FLOOD = textwrap.dedent("""
    import os, socket, sys
    path, count, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, size)
    socks, taken, refusal = [], 0, ""
    while taken < count:        # refused: again on a new connection, until a new one takes nothing either
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        socks.append(sock)
        try:
            sock.connect(path)
        except OSError as exc:
            refusal = str(exc)
            break
        got = 0
        while taken < count:
            try:
                socket.send_fds(sock, [b"R"], [fd])
                reply = sock.recv(512).decode()
            except OSError as exc:
                reply = "E" + str(exc)
            if not reply.startswith("H"):
                refusal = reply[1:]
                break
            taken, got = taken + 1, got + 1
        if not got:
            break
    print(taken, refusal, flush=True)
    sys.stdin.read()          # hold the handles until told
""")


def _flood_handles(b, count: int = 999):
    """A client process that parks up to ``count`` handles on ``b``'s descriptor socket; (process, taken,
    refusal)."""
    path = runtime.api_file(b.api_port, "sock")
    proc = subprocess.Popen([sys.executable, "-c", FLOOD, path, str(count), str(HEADER)], cwd=str(REPO),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    taken, _, refusal = proc.stdout.readline().strip().partition(" ")
    return proc, int(taken), refusal


def _ring_fd() -> int:
    fd = os.open("/dev/shm", os.O_TMPFILE | os.O_RDWR, 0o600)
    os.ftruncate(fd, HEADER)
    return fd


def test_ring_handles_are_capped_per_client_and_in_all(sidecars):
    """One client parks handles until refused (the refusal names the cap); another client's handoff and a
    transfer still work; several flooding clients together stop at the total cap, far below the limit."""
    a, b = _pair(sidecars, 1024)
    ca, cb = _warm(a, b)
    caps = cb.stats()["caps"]
    floods = []
    try:
        proc, taken, refusal = _flood_handles(b)
        floods.append(proc)
        assert taken == caps["handles_per_client"] and "cap" in refusal and "this client" in refusal
        other = FdHandoff(runtime.api_file(b.api_port, "sock"))
        fd = _ring_fd()
        try:
            assert other.register(fd).startswith("fd:")
        finally:
            os.close(fd)
            other.close()
        ca.send("b", "during", os.urandom(1 << 20)).wait(30)
        assert len(b.client(shm=True).recv("during", timeout_s=10)) == 1 << 20
        total = taken
        for _ in range(caps["handles"] // caps["handles_per_client"] + 1):
            proc, taken, refusal = _flood_handles(b)
            floods.append(proc)
            total += taken
            if "in all" in refusal:
                break
        # the floods and this process's own clients' rings, together
        assert "in all" in refusal and caps["handles"] - 20 <= total < caps["handles"]
        assert _fds(b.proc.pid) < 1024 - caps["reserve"] // 2
        assert cb.stats()["name"] == "b"
    finally:
        for proc in floods:
            proc.stdin.close()
            proc.wait(10)


# ---------------------------------------------------------------------- a low descriptor limit
def test_every_port_under_a_low_descriptor_limit(sidecars):
    """RLIMIT_NOFILE=256: 300 idle connections on each port (local API, peer port, data plane, metrics,
    descriptor socket) at once never make the sidecar run out of descriptors (no EMFILE in its log), and a
    transfer between two sidecars completes meanwhile."""
    metrics = sidecars.free_port()
    a, b = _pair(sidecars, 256, ["--metrics-port", str(metrics)])
    ca, cb = _warm(a, b)
    stats = cb.stats()
    caps = stats["caps"]
    assert caps["nofile"] == 256 and f"descriptor limit 256: connections api {caps['api']}" in b.log()
    held = []
    try:
        for port in (b.api_port, b.listen_port, stats["data_port"], metrics):
            held += _open(port, 300)
        held += _open(0, 300, socket.AF_UNIX, runtime.api_file(b.api_port, "sock"))
        time.sleep(1.0)
        assert _fds(b.proc.pid) < 256
        latencies = sorted(_stats_ms(cb) for _ in range(10))
        assert latencies[5] < 100, latencies
        ca.send("b", "during", os.urandom(4 << 20)).wait(30)
        assert len(cb.recv("during", timeout_s=10)) == 4 << 20
    finally:
        _close_all(held)
    assert b.proc.poll() is None and not EMFILE.search(b.log()), b.log()[-3000:]


# ---------------------------------------------------------------------- another local user
LOCAL_FLOOD = textwrap.dedent("""
    import socket, sys, time
    port, sock_path = int(sys.argv[1]), sys.argv[2]
    held = []
    for _ in range(300):        # idle connections on the metrics port, as many as it takes
        s = socket.socket()
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            held.append(s)
        except OSError:
            s.close()
    # the descriptor socket: its directory is the sidecar user's alone
    try:
        u = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        u.connect(sock_path)
        handoff = "connected"
    except OSError as exc:
        handoff = type(exc).__name__
    time.sleep(1.0)
    still = 0                   # connections the sidecar still holds open (a read times out)
    for s in held:
        s.settimeout(0.01)
        try:
            s.recv(1)           # b"": closed; bytes: refused with an answer
        except socket.timeout:
            still += 1
        except OSError:
            pass
    print(len(held), still, handoff, flush=True)
""")


def test_another_local_user_cannot_exhaust_the_sidecar(sidecars, unprivileged):
    """An unprivileged local user (not the sidecar's) floods the metrics port and tries the descriptor
    socket: the metrics port holds at most its cap and refuses the rest, the descriptor socket refuses
    that user outright, and the sidecar's own clients go on (Stats fast, a transfer completes)."""
    port = sidecars.free_port()
    a, b = _pair(sidecars, 1024, ["--metrics-port", str(port), "--hello-timeout-s", "3"])
    ca, cb = _warm(a, b)
    cap, pid = cb.stats()["caps"]["metrics"], b.proc.pid
    threads0 = _threads(pid)
    run = unprivileged.run(LOCAL_FLOOD.replace("sys.argv[1]", repr(str(port))).replace(
        "sys.argv[2]", repr(runtime.api_file(b.api_port, "sock"))), timeout=60)
    assert run.returncode == 0, run.stderr
    opened, still_open, handoff = run.stdout.split()
    assert int(still_open) <= cap, (opened, still_open, cap)
    assert handoff in ("PermissionError", "FileNotFoundError"), handoff
    assert _threads(pid) <= threads0 + 1
    assert sorted(_stats_ms(cb) for _ in range(10))[5] < 100
    ca.send("b", "after", os.urandom(1 << 20)).wait(30)
    assert len(cb.recv("after", timeout_s=10)) == 1 << 20
    assert "Traceback" not in b.log() and not EMFILE.search(b.log())
