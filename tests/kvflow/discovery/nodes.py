"""Sidecars that register in a real etcd, for the discovery tests: starting one, writing a raw entry, sending once a peer is found."""
import asyncio
import time

import grpc

from ciuicflow.kvflow import KVFlowError
from ciuicflow.kvflow.discovery.etcd import EtcdClient


SECRETS = {("a", "b"): "sec-ab", ("a", "d"): "sec-ad", ("b", "d"): "sec-bd", ("a", "c"): "sec-ac"}


def _secrets_file(tmp_path, me, overrides=None):
    lines = []
    for (x, y), secret in SECRETS.items():
        if me in (x, y):
            lines.append(f'{y if me == x else x} = "{(overrides or {}).get((x, y), secret)}"')
    path = tmp_path / f"{me}.secrets.toml"
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)
    return str(path)


TTL = 2


PREFIX = "/fleet"


def _make(sidecars, tmp_path, etcd, name, role="both", overrides=None, extra=(), ttl=TTL):
    return sidecars.make(name, args=["--discovery", etcd.url(PREFIX), "--role", role, "--discovery-ttl-s",
                                     str(ttl), "--peer-secrets-file", _secrets_file(tmp_path, name, overrides),
                                     "--resume-timeout-s", "30", *extra])


def _send_when_found(client, dest, key, payload, timeout):
    """Send until ``dest`` is a peer (NOT_FOUND before); the time it took and the result."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return client.send(dest, key, payload).wait(timeout)
        except KVFlowError as exc:
            if exc.code != grpc.StatusCode.NOT_FOUND or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _etcd_put(endpoint, key, value: bytes):
    async def put():
        client = EtcdClient([endpoint])
        try:
            await client.put(key.encode(), value)
        finally:
            await client.close()
    asyncio.run(put())
