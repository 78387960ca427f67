"""Where a sidecar publishes what only its own user may use, and where a client finds it: the local API's
token (``api-NETNS-PORT.token``) and the Unix socket that shared-memory descriptors are handed over on
(``api-NETNS-PORT.sock``), in a private runtime directory (mode 0700, owned by the user).

The directory: ``$CIUICFLOW_KVFLOW_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/ciuicflow-kvflow``, else
``/tmp/ciuicflow-kvflow-UID``. A directory that is not this user's, is a symlink or is open to others is
never used (another user could have made it first, to read what is put there). The network namespace is in
the names because loopback ports are per namespace: two sidecars in two namespaces may bind the same one.

Both ends share this module: the sidecar writes, ``Client`` reads (``find_api_token``).
"""
from __future__ import annotations

import os
import stat
from typing import Optional

RUNTIME_DIR_ENV = "CIUICFLOW_KVFLOW_RUNTIME_DIR"
API_TOKEN_ENV = "CIUICFLOW_KVFLOW_API_TOKEN"
API_TOKEN_FILE_ENV = "CIUICFLOW_KVFLOW_API_TOKEN_FILE"


def runtime_dir() -> str:
    explicit = os.environ.get(RUNTIME_DIR_ENV)
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "ciuicflow-kvflow")
    return f"/tmp/ciuicflow-kvflow-{os.geteuid()}"


def private_dir(create: bool) -> Optional[str]:
    """The runtime directory if it is private to this user (created, mode 0700, when ``create``); None if
    it does not exist (and not ``create``). Raises PermissionError when it exists but is not private."""
    path = runtime_dir()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise PermissionError(f"runtime directory {path} is not private to this user (it must be a directory "
                              f"owned by uid {os.geteuid()} with mode 0700; set ${RUNTIME_DIR_ENV})")
    return path


def netns_id() -> str:
    try:
        return str(os.stat("/proc/self/ns/net").st_ino)
    except OSError:
        return "0"


def port_of(address: str) -> Optional[int]:
    """The port of a sidecar on this host at ``address`` (None: another host, or no port)."""
    host, sep, port = address.rpartition(":")
    if not sep:
        return None
    host = host.rpartition("/")[2].strip("[]").lower()      # "dns:///localhost:50151" too
    if host not in ("localhost", "::1", "0.0.0.0", "::") and not host.startswith("127."):
        return None         # a remote sidecar: its files are not on this host
    try:
        return int(port)
    except ValueError:
        return None


def api_file(port: int, suffix: str, create_dir: bool = False) -> Optional[str]:
    """The path of the sidecar-on-``port``'s ``suffix`` file ("token", "sock") in the private directory."""
    d = private_dir(create_dir)
    return None if d is None else os.path.join(d, f"api-{netns_id()}-{port}.{suffix}")


def read_secret(path: str, what: str) -> str:
    """A token or secret from a file: its content without surrounding whitespace; an empty one is refused
    (an empty file must never mean "no authentication")."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read().strip()
    if not text:
        raise ValueError(f"{what} file {path} is empty")
    return text


def find_api_token(address: str) -> Optional[str]:
    """The token a client presents to the sidecar at ``address``: ``$CIUICFLOW_KVFLOW_API_TOKEN``, else the
    file ``$CIUICFLOW_KVFLOW_API_TOKEN_FILE``, else the one the sidecar published for its own user (only a
    sidecar on this host, in this network namespace, running as this user)."""
    token = os.environ.get(API_TOKEN_ENV)
    if token:
        return token
    path = os.environ.get(API_TOKEN_FILE_ENV)
    if path:
        return read_secret(path, f"${API_TOKEN_FILE_ENV}")
    port = port_of(address)
    if port is None:
        return None
    try:
        path = api_file(port, "token")
        if path is None:
            return None
        return read_secret(path, "local API token")
    except (OSError, ValueError):
        return None


def publish(path: str, text: str) -> None:
    """Write ``text`` to ``path`` (mode 0600) atomically: readers see the old file or the whole new one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
