"""Host-side plumbing of the simulated cluster: shell commands, network namespaces (and the ones
a dead run left behind), and stopping process trees."""
from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import time

from ciuicflow.kvflow.sidecar.process import free_port  # noqa: F401  (re-exported: one port allocator)

NETNS_PREFIX = "cfsim"
NETNS_ETC = "/etc/netns"  # `ip netns exec NS` bind-mounts /etc/netns/NS/* over /etc/*


def run_command(cmd, check=True):
    """Run cmd, capturing its output; raise with its stderr when it fails and check is set."""
    result = subprocess.run(cmd, capture_output=True, text=True)
    if check and result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pid: int, sig):
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _descendants(root: int) -> set:
    """Process ids below root, from /proc (empty where /proc is missing)."""
    parents = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            # the command name may hold spaces and parentheses: fields restart after the last ')'
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def _netns_list():
    out = run_command(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_netns_pids(ns: str):
    """Kill what still runs inside one of our namespaces (our own leftover ranks)."""
    out = run_command(["ip", "netns", "pids", ns], check=False).stdout
    for pid in (int(p) for p in out.split() if p.isdigit()):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def remove_netns(ns: str):
    _kill_netns_pids(ns)
    run_command(["ip", "netns", "delete", ns], check=False)
    shutil.rmtree(os.path.join(NETNS_ETC, ns), ignore_errors=True)


def cleanup_stale(prefix: str = NETNS_PREFIX) -> list:
    """Delete namespaces left by SimClusters whose owning process is gone. Returns the names removed."""
    removed = []
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)-[0-9a-f]+-\w+$")
    for ns in _netns_list():
        match = pattern.match(ns)
        if match and not _pid_alive(int(match.group(1))):
            remove_netns(ns)
            removed.append(ns)
    # hosts files whose namespace is already gone
    for name in os.listdir(NETNS_ETC) if os.path.isdir(NETNS_ETC) else []:
        match = pattern.match(name)
        if match and not _pid_alive(int(match.group(1))):
            shutil.rmtree(os.path.join(NETNS_ETC, name), ignore_errors=True)
    return removed


def netns_available() -> tuple:
    """(True, "") when namespaces and tc can be used here, else (False, reason)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return False, "not a POSIX system"
    if os.geteuid() != 0:
        return False, "not running as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"'{tool}' (iproute2) not found"
    probe = f"{NETNS_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    result = run_command(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        return False, f"'ip netns add' failed: {result.stderr.strip()}"
    run_command(["ip", "netns", "delete", probe], check=False)
    return True, ""




def stop_processes(procs) -> None:
    """Stop each process and its children (torchrun starts each rank in a session of its own, so
    killing the launcher's process group does not reach them): SIGTERM, then SIGKILL after 5 s."""
    running = [p for p in procs if p.poll() is None]
    children = set()
    for proc in running:
        children |= _descendants(proc.pid)
        _signal_group(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in running:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
    for pid in children:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
