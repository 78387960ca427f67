"""The soak's client processes (``python -m bench.soak.workers ROLE ...``), each killed and restarted
at random by the orchestrator (bench/soak):

* ``sender``: sends transfers of deterministic content (``payload(key, size)``) to random decode sidecars,
  each with its key as idempotency key, retrying until OK (a restarted sender first retries the intents
  of its previous life that never got their OK);
* ``consumer``: receives the transfers meant for its sidecar (it learns their keys from the senders'
  ledgers) with ``manual_ack``, checks their bytes, records the delivery, then acknowledges; keys that failed
  least first, each waiting longer after each failed try;
* ``garbage``: hostile bytes on every port of every sidecar (local API, peer port, data plane, metrics,
  descriptor socket): random bytes, malformed frames and messages, bad tickets, idle connections.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import socket
import sys
import time

from bench.soak.ledger import Ledger, acked_keys, read_all


def payload(key: str, size: int) -> bytes:
    return hashlib.shake_256(key.encode()).digest(size)


def digest(data) -> str:
    return hashlib.sha256(data).hexdigest()


def _stopping(path: str) -> bool:
    return os.path.exists(path)


# ---------------------------------------------------------------------- sender
def sender(a) -> None:
    from ciuicflow.kvflow import Client, KVFlowError
    client = Client(a.api)
    ledger = Ledger(os.path.join(a.ledger, f"sender-{a.name}.jsonl"))
    events = read_all(a.ledger)
    mine = [e for e in events if e.get("worker") == a.name]  # intents (only they name the worker)
    # outcomes carry no worker name: look them up by key (keys are unique to their worker), or a
    # restarted sender would send every earlier transfer again
    done = {e["key"] for e in events if e["ev"] in ("ok", "gave_up")}
    pending = [e for e in mine if e["ev"] == "intent" and e["key"] not in done]
    rng = random.Random(f"{a.seed}-{a.name}-{os.getpid()}")
    n = len({e["key"] for e in mine if e["ev"] == "intent"})
    sizes = [int(s) for s in a.sizes.split(",")]

    def send(intent) -> None:
        data = payload(intent["key"], intent["size"])
        deadline = time.monotonic() + a.retry_s
        while time.monotonic() < deadline:
            try:
                client.send(intent["dest"], intent["key"], data, priority=intent["priority"],
                            idempotency_key=intent["key"]).wait(30)
                ledger.write("ok", **{k: intent[k] for k in ("key", "src", "dest", "size", "sha")})
                return
            except (KVFlowError, TimeoutError):
                time.sleep(0.2)         # its sidecar or the receiver was killed: the same key again
        ledger.write("gave_up", key=intent["key"])

    for intent in pending:
        send(intent)
    while not _stopping(a.stop):
        n += 1
        key = f"{a.name}-{n}"
        size = rng.choice(sizes)
        intent = dict(key=key, src=a.src, dest=rng.choice(a.dests.split(",")), size=size,
                      sha=digest(payload(key, size)), priority=rng.choice(["high", "normal", "low"]),
                      worker=a.name)
        ledger.write("intent", **intent)
        send(intent)


# ---------------------------------------------------------------------- consumer
BACKOFF_S = (0.25, 8.0)         # a key not there: tried again after 0.25 s, doubling to 8 s


def consumer(a) -> None:
    """Receives the keys meant for its sidecar in random order, those that failed least first (among them
    those their sender was told OK: they have arrived): a key not there yet, or never to come (a sender and a
    receiver without spool both killed), waits longer after each failed try, so that such keys cannot starve
    the others (each failed try waits the receive's timeout)."""
    from ciuicflow.kvflow import Client, KVFlowError
    client = Client(a.api)
    ledger = Ledger(os.path.join(a.ledger, f"consumer-{a.name}.jsonl"))
    errors, reported = {}, time.monotonic()
    fails, next_try = {}, {}
    while True:
        if time.monotonic() - reported > 2.0:
            print("consumer", a.name, "errors", errors, flush=True)
            errors, reported = {}, time.monotonic()
        events = read_all(a.ledger)
        acked = acked_keys(events)
        oks = {e["key"] for e in events if e["ev"] == "ok"}
        todo = [e for e in events if e["ev"] == "intent" and e["dest"] == a.dest and e["key"] not in acked]
        if not todo and _stopping(a.stop):
            return
        now = time.monotonic()
        due = [e for e in todo if next_try.get(e["key"], 0.0) <= now]
        random.shuffle(due)
        due.sort(key=lambda e: (fails.get(e["key"], 0), e["key"] not in oks))
        end = now + 5.0             # then the ledger again: new keys, new acknowledgements
        for intent in due[:64]:
            if time.monotonic() > end:
                break
            key = intent["key"]
            t0 = time.monotonic()
            try:
                parts = client.recv(key, timeout_s=0.5, source=intent["src"], manual_ack=True)
            except KVFlowError as exc:
                errors[exc.code.name] = errors.get(exc.code.name, 0) + 1
                if exc.code.name in ("DEADLINE_EXCEEDED", "NOT_FOUND"):      # not there (yet)
                    fails[key] = fails.get(key, 0) + 1
                    next_try[key] = time.monotonic() + min(BACKOFF_S[1], BACKOFF_S[0] * 2 ** (fails[key] - 1))
                continue                # (or being received by the other consumer, or its sidecar is down)
            data = parts if isinstance(parts, bytes) else b"".join(parts)
            ledger.write("delivered", key=key, t0=t0, sha_ok=digest(data) == intent["sha"])
            try:
                client.ack(key, source=intent["src"])
                ledger.write("acked", key=key)
            except KVFlowError:
                pass                    # its sidecar was killed: received again later
        if not due:
            first = min((next_try.get(e["key"], 0.0) for e in todo), default=now)
            time.sleep(min(0.5, max(0.05, first - time.monotonic())))
        else:
            time.sleep(0.05)


# ---------------------------------------------------------------------- garbage
def _tcp(port: int, data: bytes, hold: float = 0.0) -> None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            if data:
                s.sendall(data)
            if hold:
                time.sleep(hold)
            s.settimeout(0.2)
            try:
                s.recv(4096)
            except OSError:
                pass
    except OSError:
        pass


def _grpc_garbage(address: str, token, rng: random.Random) -> None:
    import grpc
    methods = ["/ciuicflow.kvflow.v1.KVFlow/Send", "/ciuicflow.kvflow.v1.KVFlow/Recv",
               "/ciuicflow.kvflow.v1.KVFlow/ShmProbe", "/ciuicflow.kvflow.v1.KVFlow/Acknowledge",
               "/ciuicflow.kvflow.v1.KVFlowPeer/Link", "/ciuicflow.kvflow.v1.KVFlowPeer/DataPlane",
               "/grpc.health.v1.Health/Watch", "/nothing/Here"]
    md = [("x-ciuic-peer", rng.choice(["p0", "d0", "mallory", "x" * 300]))]
    if token and rng.random() < 0.7:
        md.append(("authorization", f"Bearer {token}"))         # authenticated garbage too
    with grpc.insecure_channel(address) as ch:
        method = rng.choice(methods)
        junk = [os.urandom(rng.randint(0, 2048)) for _ in range(rng.randint(1, 4))]
        try:
            if method.endswith(("Send", "Link")):
                call = ch.stream_stream(method) if method.endswith("Link") else ch.stream_unary(method)
                result = call(iter(junk), metadata=md, timeout=1)
                if method.endswith("Link"):
                    list(result)
            else:
                call = ch.unary_stream(method) if method.endswith(("Recv", "Watch")) else ch.unary_unary(method)
                result = call(junk[0], metadata=md, timeout=1)
                if method.endswith(("Recv", "Watch")):
                    list(result)
        except grpc.RpcError:
            pass


def _unix_garbage(path: str, rng: random.Random) -> None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(0.5)
            s.connect(path)
            r, w = os.pipe()
            try:
                socket.send_fds(s, [b"R"], [r])        # not a ring: refused
            finally:
                os.close(r)
                os.close(w)
            s.send(rng.choice([b"", b"D" + os.urandom(16).hex().encode(), os.urandom(100), b"R"]))
            s.recv(256)
    except OSError:
        pass


def garbage(a) -> None:
    from ciuicflow.kvflow.proto.runtime import api_file, find_api_token
    from ciuicflow.kvflow.transports.tcp import HEAD, HELLO, MSG
    targets = json.loads(a.targets)      # [{"api": port, "listen": port, "data": port or 0, "metrics": port}]
    rng = random.Random(f"{a.seed}-garbage-{os.getpid()}")
    while not _stopping(a.stop):
        t = rng.choice(targets)
        port = rng.choice([t["api"], t["listen"], t["data"] or t["listen"], t["metrics"]])
        choice = rng.randrange(7)
        if choice == 0:
            _tcp(port, os.urandom(rng.randint(1, 65536)))
        elif choice == 1:
            _tcp(port, b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + os.urandom(rng.randint(0, 4096)))
        elif choice == 2 and t["data"]:
            _tcp(t["data"], rng.choice([HEAD.pack(MSG, 8 << 20), HEAD.pack(HELLO, 24) + os.urandom(24),
                                        HEAD.pack(HELLO, 1 << 30), os.urandom(5)]))
        elif choice == 3:
            _tcp(port, b"", hold=rng.uniform(0.5, 2.0))              # an idle connection
        elif choice == 4:
            _grpc_garbage(f"127.0.0.1:{rng.choice([t['api'], t['listen']])}",
                          find_api_token(f"127.0.0.1:{t['api']}"), rng)
        elif choice == 5:
            path = api_file(t["api"], "sock")
            if path:
                _unix_garbage(path, rng)
        else:
            _tcp(t["metrics"], b"GET /" + os.urandom(rng.randint(0, 200)) + b" HTTP/1.1\r\n\r\n")
        time.sleep(a.pause)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("sender", "consumer", "garbage"))
    p.add_argument("--name", default="")
    p.add_argument("--api", default="")
    p.add_argument("--src", default="")
    p.add_argument("--dest", default="")
    p.add_argument("--dests", default="")
    p.add_argument("--ledger", required=True)
    p.add_argument("--stop", required=True, help="the orchestrator creates this file to stop the worker")
    p.add_argument("--seed", default="0")
    p.add_argument("--sizes", default="1000,65536,300000")
    p.add_argument("--retry-s", type=float, default=60.0)
    p.add_argument("--targets", default="[]")
    p.add_argument("--pause", type=float, default=0.02)
    a = p.parse_args(argv)
    {"sender": sender, "consumer": consumer, "garbage": garbage}[a.role](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
