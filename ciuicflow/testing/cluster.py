"""A simulated multi-node cluster on one machine, for benchmarks and tests.

Each of N nodes is a network namespace holding L ranks; the nodes hang off a bridge that lives in its own
"switch" namespace. A node reaches the bridge through a veth pair whose rate is limited with ``tc tbf`` in both
directions (node egress and switch egress towards the node), so the pair behaves like a full-duplex NIC of the
given rate. Ranks of one node talk over the namespace's own address (the kernel loops that traffic back without
touching the veth); ranks of different nodes cross the shaped link, whose byte counters give the real bytes on the
wire. Only addresses inside namespaces created here are used; nothing is routed to or from the host.

Each node's ranks are launched with ``torchrun --nnodes N --node_rank K --nproc-per-node L`` and a static
rendezvous on node 0's address, the way users run multi-node jobs, with ``GLOO_SOCKET_IFNAME`` set to the
node's veth (otherwise gloo binds the host name, which resolves to 127.0.0.1). Each node also gets its own UTS
namespace and host name, so host-name based topology detection sees distinct nodes.

Without root or ``ip netns`` the cluster falls back to plain loopback: every rank on 127.0.0.1, nothing shaped,
no inter-node byte counts. That is reported loudly (``shaped: False``) in everything it produces.

    with SimCluster(nodes=2, ranks_per_node=2, rate="1gbit") as cluster:
        run = cluster.torchrun(["-m", "bench.comm.worker", "--steps", "5"], timeout=600)
        print(run.inter_node_bytes, run.returncodes)

``cluster_env`` holds what the launched ranks read (the exported variables, the node link's counters);
``cluster_netns`` the namespace and process plumbing; this module imports the names benches use from both.
"""
from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import ciuicflow
from ciuicflow.testing.cluster_env import (ENV_IFACE, ENV_NETNS, ENV_NODE, ENV_RATE, ENV_SHAPED, NODE_IFACE,
                                           format_rate, parse_rate, read_node_link_bytes)
from ciuicflow.testing.cluster_netns import (NETNS_ETC, NETNS_PREFIX, cleanup_stale, free_port, netns_available,
                                             remove_netns, run_command, stop_processes)

MASTER_PORT = 29500
SMALL_BURST = 16 * 1024     # tbf burst below ~33 Mbit/s, with packets of one MTU (see SimCluster._shape)


@dataclass
class ClusterRun:
    """What one launch on every node produced."""
    returncodes: list
    outputs: list  # combined stdout+stderr per node ("" when not captured)
    seconds: float
    shaped: bool
    link_tx_bytes: list | None  # per node, bytes sent on its inter-node link during the launch
    link_rx_bytes: list | None

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)

    @property
    def inter_node_bytes(self):
        """Bytes that crossed between nodes: each counted once, when it left its node."""
        return None if self.link_tx_bytes is None else sum(self.link_tx_bytes)


@dataclass
class _Procs:
    procs: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class SimCluster:
    """N simulated nodes x L ranks. Use as a context manager; ``close()`` is idempotent.

    rate: inter-node rate per node and direction ("1gbit", bits/s, ...); None leaves the link unshaped
    (namespaces still used, bytes still counted). require_netns: raise instead of falling back to loopback.
    loopback: use the loopback fallback even where namespaces work.
    """

    def __init__(self, nodes: int = 2, ranks_per_node: int = 2, rate="1gbit", *, require_netns: bool = False,
                 loopback: bool = False, prefix: str = NETNS_PREFIX, log=None):
        if int(nodes) < 1 or int(ranks_per_node) < 1:
            raise ValueError(f"need at least 1 node and 1 rank per node, got {nodes} x {ranks_per_node}")
        self.nodes = int(nodes)
        self.ranks_per_node = int(ranks_per_node)
        self.rate_bps = None if rate is None else parse_rate(rate)
        self.require_netns = require_netns
        self.loopback = loopback
        self.prefix = prefix
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self.tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
        self.netns = False
        self.fallback_reason = ""
        self._namespaces = []
        self._procs = _Procs()
        self._started = False
        self._old_sigterm = None
        self.master_port = MASTER_PORT

    # ---------------------------------------------------------------- state

    @property
    def shaped(self) -> bool:
        return self.netns and self.rate_bps is not None

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def iface(self) -> str:
        return NODE_IFACE if self.netns else "lo"

    def node_ns(self, k: int) -> str:
        return f"{self.tag}-n{k}"

    def node_hostname(self, k: int) -> str:
        return f"{self.tag}-n{k}"

    def node_addr(self, k: int) -> str:
        if not self.netns:
            return "127.0.0.1"
        # the same addresses in every cluster: each has namespaces of its own, so they never meet
        return f"10.213.{k // 250}.{k % 250 + 1}"

    @property
    def master_addr(self) -> str:
        return self.node_addr(0)

    def describe(self) -> str:
        """One line for logs and reports; loud when the link is not really shaped."""
        shape = f"{self.nodes} nodes x {self.ranks_per_node} ranks"
        if self.shaped:
            return f"{shape}, network namespaces, inter-node link shaped to {format_rate(self.rate_bps)} (tc tbf)"
        if self.netns:
            return f"{shape}, network namespaces, inter-node link NOT SHAPED (no rate given)"
        return (f"!!! NOT SHAPED: {shape} on plain loopback ({self.fallback_reason}); inter-node links are not "
                f"simulated and inter-node bytes are not measured !!!")

    # ---------------------------------------------------------------- setup / teardown

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def start(self):
        if self._started:
            return self
        self._started = True
        ok, reason = (False, "loopback requested") if self.loopback else netns_available()
        if not ok:
            if self.require_netns:
                raise RuntimeError(f"network namespaces unavailable: {reason}")
            self.fallback_reason = reason
            self.master_port = free_port()
            self._log(self.describe())
            return self
        removed = cleanup_stale(self.prefix)
        if removed:
            self._log(f"[cluster] removed stale namespaces: {' '.join(removed)}")
        atexit.register(self.close)
        self._install_sigterm()
        self.netns = True  # addresses and names below are the namespace ones
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        self._log(f"[cluster] {self.describe()}")
        return self

    def _add_ns(self, name):
        run_command(["ip", "netns", "add", name])
        self._namespaces.append(name)
        run_command(["ip", "-n", name, "link", "set", "lo", "up"])

    def _shape(self, ns, dev):
        if self.rate_bps is None:
            return
        rate_bytes = self.rate_bps / 8
        # burst must hold a GSO packet (64 KiB); keep it to a few ms of traffic so the average rate holds
        burst = int(max(rate_bytes / 250, 128 * 1024))
        if rate_bytes / 250 < SMALL_BURST:
            # A slow link: 128 KiB would be 210 ms of 5 Mbit/s let through at once after every pause, a
            # policer rather than a link (a delivery-rate sender measured 8 MB/s on 5 Mbit/s). Packets of
            # one MTU (no GSO) let the bucket hold a few packets only.
            run_command(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_size", "1514", "gso_max_segs", "1"])
            burst = int(max(rate_bytes / 250, SMALL_BURST))
        run_command(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(self.rate_bps)}bit",
              "burst", str(burst), "latency", "100ms"])

    def _build(self):
        switch = f"{self.tag}-sw"
        self._add_ns(switch)
        run_command(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        run_command(["ip", "-n", switch, "link", "set", "br0", "up"])
        for k in range(self.nodes):
            ns, port = self.node_ns(k), f"p{k}"
            self._add_ns(ns)
            run_command(["ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", NODE_IFACE, "netns", ns])
            run_command(["ip", "-n", switch, "link", "set", port, "master", "br0"])
            run_command(["ip", "-n", switch, "link", "set", port, "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{self.node_addr(k)}/16", "dev", NODE_IFACE])
            run_command(["ip", "-n", ns, "link", "set", NODE_IFACE, "up"])
            self._shape(ns, NODE_IFACE)  # node -> switch
            self._shape(switch, port)  # switch -> node
        # every node resolves every node's host name to its address, as on a real cluster
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{self.node_addr(k)} {self.node_hostname(k)}\n" for k in range(self.nodes))
        try:
            for k in range(self.nodes):
                os.makedirs(os.path.join(NETNS_ETC, self.node_ns(k)), exist_ok=True)
                with open(os.path.join(NETNS_ETC, self.node_ns(k), "hosts"), "w") as f:
                    f.write(hosts)
        except OSError as exc:  # only name resolution suffers: ranks use addresses and GLOO_SOCKET_IFNAME
            self._log(f"[cluster] note: cannot write {NETNS_ETC} ({exc}); node host names will not resolve")

    def _install_sigterm(self):
        # turn SIGTERM into an exception so `with` blocks and finally clauses tear the namespaces down
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            def on_term(signum, frame):
                raise SystemExit(128 + signum)
            self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def close(self):
        self.kill_all()
        for ns in reversed(self._namespaces):
            remove_netns(ns)
        self._namespaces = []
        if self._old_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        try:
            atexit.unregister(self.close)
        except Exception:
            pass

    def kill_all(self):
        """Stop every process this cluster launched, and their children."""
        with self._procs.lock:
            procs, self._procs.procs = self._procs.procs, []
        stop_processes(procs)

    # ---------------------------------------------------------------- running things on nodes

    def node_env(self, k: int, extra=None) -> dict:
        """Environment for processes of node k: gloo bound to the node's interface, the sim's facts exported."""
        env = dict(os.environ)
        repo_root = os.path.dirname(os.path.dirname(os.path.abspath(ciuicflow.__file__)))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (repo_root, env.get("PYTHONPATH", "")) if p)
        env["GLOO_SOCKET_IFNAME"] = self.iface
        env[ENV_NETNS] = "1" if self.netns else "0"
        env[ENV_SHAPED] = "1" if self.shaped else "0"
        env[ENV_IFACE] = NODE_IFACE if self.netns else ""
        env[ENV_NODE] = str(k)
        env[ENV_RATE] = str(int(self.rate_bps)) if self.shaped else ""
        env.setdefault("OMP_NUM_THREADS", "1")
        if extra:
            env.update({key: str(value) for key, value in extra.items()})
        return env

    def popen(self, k: int, argv, env=None, **kwargs) -> subprocess.Popen:
        """Start argv on node k (in its namespace, with its own host name), in a new session for clean kills."""
        if not self._started:
            raise RuntimeError("SimCluster not started: use `with SimCluster(...) as cluster:`")
        if not 0 <= k < self.nodes:
            raise ValueError(f"node {k} out of range 0..{self.nodes - 1}")
        argv = [str(a) for a in argv]
        if self.netns:
            if shutil.which("unshare"):  # a host name of its own per node, as on separate machines
                argv = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', self.node_hostname(k), *argv]
            argv = ["ip", "netns", "exec", self.node_ns(k), *argv]
        proc = subprocess.Popen(argv, env=self.node_env(k, env), start_new_session=True, **kwargs)
        with self._procs.lock:
            self._procs.procs.append(proc)
        return proc

    def link_bytes(self):
        """Per node (tx_bytes, rx_bytes) of its inter-node interface, read from the host; None in the fallback."""
        if not self.netns:
            return None
        counts = []
        for k in range(self.nodes):
            out = run_command(["ip", "-n", self.node_ns(k), "-j", "-s", "link", "show", "dev", NODE_IFACE]).stdout
            stats = json.loads(out)[0]["stats64"]
            counts.append((stats["tx"]["bytes"], stats["rx"]["bytes"]))
        return counts

    def torchrun_argv(self, k: int, script_and_args) -> list:
        return [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(self.nodes), "--node_rank", str(k), "--nproc-per-node", str(self.ranks_per_node),
                "--master-addr", self.master_addr, "--master-port", str(self.master_port),
                *[str(a) for a in script_and_args]]

    def torchrun(self, script_and_args, env=None, timeout: float | None = None, capture: bool = True,
                 on_line=None) -> ClusterRun:
        """Run ``torchrun ... script args`` on every node at once and wait for all of them.

        capture=True collects each node's stdout+stderr into ClusterRun.outputs (and passes each line to
        ``on_line(node, line)`` as it comes, if given); False lets them through to this process's outputs.
        On timeout every process is killed and TimeoutError raised (with the captured output).
        """
        before = self.link_bytes()
        outputs = [[] for _ in range(self.nodes)]
        readers = []
        started = time.monotonic()
        procs = []
        try:
            for k in range(self.nodes):
                kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True,
                          "errors": "replace"} if capture else {}
                proc = self.popen(k, self.torchrun_argv(k, script_and_args), env=env, **kwargs)
                procs.append(proc)
                if capture:
                    reader = threading.Thread(target=self._pump, args=(proc.stdout, outputs[k], k, on_line),
                                              daemon=True)
                    reader.start()
                    readers.append(reader)
            returncodes = self._wait(procs, timeout, started)
            seconds = time.monotonic() - started
            stop_processes(procs)  # the survivors of a failed or timed-out launch
            for reader in readers:
                reader.join(timeout=10)
            texts = ["".join(lines) for lines in outputs]
            if returncodes is None:
                raise TimeoutError(f"torchrun on {self.nodes} nodes did not finish in {timeout} s; output:\n"
                                   + "\n".join(f"--- node {k}\n{o[-3000:]}" for k, o in enumerate(texts)))
        except BaseException:
            stop_processes(procs)
            raise
        with self._procs.lock:
            self._procs.procs = [p for p in self._procs.procs if p not in procs]
        after = self.link_bytes()
        tx = rx = None
        if before is not None:
            tx = [a[0] - b[0] for a, b in zip(after, before)]
            rx = [a[1] - b[1] for a, b in zip(after, before)]
        return ClusterRun(returncodes, texts, seconds, self.shaped, tx, rx)

    @staticmethod
    def _pump(stream, lines, node, on_line):
        for line in stream:
            lines.append(line)
            if on_line is not None:
                try:
                    on_line(node, line)
                except Exception:  # a broken callback must not stall the pipe
                    pass
        stream.close()

    def _wait(self, procs, timeout, started):
        """Wait for all; a failing node makes the others pointless, so kill them after a grace period."""
        failed_at = None
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return codes
            now = time.monotonic()
            if timeout is not None and now - started > timeout:
                return None
            if failed_at is None and any(c not in (None, 0) for c in codes):
                failed_at = now
            if failed_at is not None and now - failed_at > 15:
                return [p.poll() if p.poll() is not None else -signal.SIGKILL for p in procs]
            time.sleep(0.05)

