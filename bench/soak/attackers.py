"""The soak's attackers (``python -m bench.soak.attackers ROLE ...``), started by bench/soak beside
its legitimate traffic and never killed by its chaos. Each runs rounds against the soak's sidecars (or its
own proxy) until the stop file appears, and writes one ``attack`` event per round to its ledger file: what
it did (``did``), what the sidecar or proxy did (``got``: answers and refusals, counted), anything that went
other than the limits promise (``bad``), its window (``t0``, ``t1``) and its target. A round whose target
the orchestrator killed meanwhile is excused in the verdict (bench.soak.ledger.attack_report).

* ``metrics``: the metrics port of a sidecar: garbage requests (random bytes, a 20 KB header, POST, another
  path: 400, 431, 405, 404), three slowloris heads (a byte every 0.2 s) and idle connections up to and past
  its cap (those beyond refused with 503 at once, the rest closed by the header timeout), then a scrape
  that must succeed;
* ``proxy``: a real vLLM routing proxy process with small limits in front of two stand-in upstream HTTP
  servers (prefill and decode roles), flooded each round with stalled connections past its connection cap
  (mid-headers and mid-body) and a trickler, oversized bodies (announced and sent), malformed ``x-ciuic-*``
  headers, client-supplied ``kv_transfer_params`` (top level and in ``vllm_xargs``) and broken framing, while
  a legitimate client sends requests through it all along (each answered 200, or 503 at once while the
  connection cap is full); no attack request may reach an upstream server, and the decode server may get
  only the transfer parameters the prefill returned for the request's own key;
* ``packed``: crafted packed chunks from an authenticated peer (the soak's shared token, a configured
  peer's name) on both transports (gRPC Link and the TCP data plane): one with 1.3 million zero-byte part
  descriptions (~7.8 MB), one of MAX_PACKED_PARTS + 1 parts with data; each must be refused
  (ACK_FAILED, INVALID_ARGUMENT, naming the bound) and its key never receivable;
* ``handles``: descriptor floods through a sidecar's descriptor socket: client processes that each park
  ring handles until refused (the refusal naming the per-client cap), more of them until the total cap
  refuses (``in all``), held for a while (the soak's own clients then send in-band), then released.
"""
from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import random
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import ThreadingHTTPServer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root
from bench.soak.ledger import Ledger
from ciuicflow.testing.crafted import Trickle, more_block, wire_session, zero_parts_frame
from ciuicflow.testing.stub_http import JsonHandler

ROLES = ("metrics", "proxy", "packed", "handles")
STATUS_RE = re.compile(rb"HTTP/1\.[01] (\d{3})")


def _stopping(path: str) -> bool:
    return os.path.exists(path)


def _pause(a, stop_path: str) -> None:
    end = time.monotonic() + a.pause
    while time.monotonic() < end and not _stopping(stop_path):
        time.sleep(0.1)


def status_of(answer) -> int:
    m = STATUS_RE.match(answer or b"")
    return int(m.group(1)) if m else 0


def closed_within(s: socket.socket, timeout: float):
    """What the other end sent before it closed ``s`` within ``timeout`` (None: still open then)."""
    s.settimeout(max(timeout, 0.001))
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


def settle(socks, least: float, most: float, cap: int):
    """Which of ``socks`` the other end closed (socket -> what it sent first), polled from ``least`` until
    at most ``cap`` are left open or ``most`` seconds passed: a refusal comes at once, but a loaded
    machine may take a moment to get to it."""
    done, t0 = {}, time.monotonic()
    while True:
        for s in socks:
            if s not in done:
                got = closed_within(s, 0.002)
                if got is not None:
                    done[s] = got
        elapsed = time.monotonic() - t0
        if elapsed >= most or (elapsed >= least and len(socks) - len(done) <= cap):
            return done
        time.sleep(0.05)


def open_conns(port: int, n: int, first: bytes = b""):
    """Up to ``n`` connections to ``port`` (each sent ``first``); (held sockets, connects that failed)."""
    held, failed = [], 0
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.settimeout(2)
        try:
            s.connect(("127.0.0.1", port))
            if first:
                s.sendall(first)
            held.append(s)
        except OSError:
            s.close()
            failed += 1
    return held, failed


def exchange(port: int, raw: bytes, timeout: float = 5.0):
    """``raw`` on a fresh connection; everything answered until the other end closed (None: it did not
    within ``timeout``)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        try:
            s.sendall(raw)
        except OSError:
            pass                # refused (and closed) while still sending: what came back says why
        return closed_within(s, timeout)


def _stats(api: str):
    from ciuicflow.kvflow import Client
    client = Client(api)
    try:
        return client.stats()
    finally:
        client.close()


class Round:
    """One round's record: ``did``, ``got`` (counters), ``bad`` (what broke a promise), written at the end."""

    def __init__(self, ledger: Ledger, attacker: str, target: str):
        self.ledger, self.attacker, self.target = ledger, attacker, target
        self.did, self.got = collections.Counter(), collections.Counter()
        self.bad, self.extra = [], {}
        self.t0 = time.monotonic()

    def write(self, **fields) -> None:
        self.ledger.write("attack", attacker=self.attacker, target=self.target, t0=self.t0, t1=time.monotonic(),
                          did=dict(self.did), got=dict(self.got), bad=self.bad[:20], **self.extra, **fields)


def _target_down(ledger, attacker: str, t: dict) -> bool:
    """Whether ``t``'s sidecar does not answer now (killed by the chaos): the round is skipped, recorded."""
    from ciuicflow.kvflow import KVFlowError
    try:
        t["caps"] = _stats(t["api"])["caps"]
        return False
    except (KVFlowError, OSError, KeyError, ValueError):
        ledger.write("attack_skipped", attacker=attacker, target=t["name"])
        return True


# ====================================================================== metrics port
def _metrics_garbage(rng: random.Random):
    junk = bytes(b for b in os.urandom(200) if b not in b"\r\n") + b"\r\n\r\n"
    return [("random bytes", junk, 400),
            ("20 KB header", b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n", 431),
            ("POST", b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 405),
            ("other path", b"GET /../etc/passwd HTTP/1.1\r\n\r\n", 404),
            ("binary request line", b"GET /" + bytes(rng.randrange(1, 256) for _ in range(50)).replace(b" ", b"")
             + b" HTTP/1.1\r\n\r\n", 404)]


def metrics_round(a, ledger, t: dict, rng: random.Random) -> None:
    r = Round(ledger, "metrics", t["name"])
    port, cap = t["metrics"], t["caps"]["metrics"]
    r.extra["cap"] = cap
    try:
        for kind, raw, want in _metrics_garbage(rng):
            r.did["garbage_requests"] += 1
            status = status_of(exchange(port, raw, 5.0))
            r.got[f"answered_{status or 'nothing'}"] += 1
            if status not in (want, 503):       # 503: the port's slots were full (the garbage worker too)
                r.bad.append(f"{kind}: answered {status}, not {want}")
        # slowloris heads first (they take slots), then idle connections up to and past the cap
        slow, failed = open_conns(port, 3)
        trickle = Trickle(slow)
        started = time.monotonic()
        idle, failed2 = open_conns(port, cap + a.extra)
        r.did["slowloris"] += len(slow)
        r.did["idle_connections"] += len(idle)
        r.got["connect_failed"] += failed + failed2
        # the refusals (at once; a loaded host may take a moment), then the rest: closed by the header
        # timeout; each counted by what it says (503 refused, 408 timed out)
        answered = settle(idle, 0.5, 3.0, cap - len(slow))
        early = set(answered)
        deadline = started + a.header_timeout_s + 2.5
        for s in idle + slow:
            if s not in answered:
                answered[s] = closed_within(s, deadline - time.monotonic())
            got = answered[s]
            if got is None:
                r.bad.append(f"a connection held past the header timeout ({a.header_timeout_s:g}s) + 2.5s")
            elif status_of(got) == 503:
                r.got["refused_503"] += 1
            elif status_of(got) == 408:
                r.got["closed_by_timeout_408"] += 1
            elif status_of(got):
                r.bad.append(f"an idle or slow connection answered {status_of(got)}")
            else:
                r.got["refused_closed" if s in early else "closed_by_timeout_nothing"] += 1
        refused = [s for s in idle + slow if status_of(answered[s]) == 503 or (s in early and not answered[s])]
        held = len(idle) + len(slow) - len(refused)
        r.extra["held_at_once"] = held
        if held > cap:
            r.bad.append(f"{held} connections held at once, cap {cap}")
        trickle.stop()
        for s in idle + slow:
            s.close()
        for _ in range(5):      # the flood is over: a scrape is served (a slot may still be the garbage's)
            r.did["scrapes"] += 1
            answer = exchange(port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", 5.0)
            if status_of(answer) == 200 and b"ciuicflow_kvflow" in answer:
                r.got["scrape_ok"] += 1
                break
            time.sleep(0.3)
        else:
            r.bad.append("no scrape served after the flood")
    except OSError as exc:
        r.bad.append(f"{type(exc).__name__}: {exc}")
    r.write()


# ====================================================================== the proxy
MARK = "soak-attack-marker"
PROMPT = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}


class Upstream:
    """A stand-in for a vLLM server behind the proxy (prefill or decode role) that records what reaches it:
    requests carrying the attackers' mark, the keys the prefill was asked for, and decode requests whose
    transfer parameters name a key the prefill never answered for."""

    def __init__(self, role: str, peer: "Upstream" = None):
        self.role, self.peer = role, peer
        self.lock = threading.Lock()
        self.posts = 0
        self.marked = 0
        self.keys: set = set()
        self.foreign = []
        up = self

        class H(JsonHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                self._json(200, {"ok": True})

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                params = None
                with up.lock:
                    up.posts += 1
                    if MARK.encode() in raw:
                        up.marked += 1
                    try:
                        body = json.loads(raw)
                        params = body.get("kv_transfer_params")
                    except ValueError:
                        body = {}
                    if up.role == "prefill":
                        key = (params or {}).get("ciuic_key")
                        up.keys.add(key)
                    elif params is not None:
                        key = params.get("ciuic_key")
                        with up.peer.lock:
                            known = key in up.peer.keys
                        if not known:
                            up.foreign.append(key)
                if up.role == "prefill":
                    back = {"do_remote_prefill": True, "ciuic_key": key, "ciuic_tokens": 3,
                            "ciuic_source": "prefill0"}
                    return self._json(200, {"choices": [{"text": "x"}], "kv_transfer_params": back})
                return self._json(200, {"choices": [{"text": "hello"}]})

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass

        self.server = Quiet(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.server.server_address[1]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _die_with_parent() -> None:
    """Linux: SIGKILL when the attacker that started this process dies (killed by the drain: no orphan)."""
    try:
        import ctypes
        ctypes.CDLL(None).prctl(1, 9)       # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        pass


class ProxyProcess:
    def __init__(self, log_path: str, prefill: Upstream, decode: Upstream, flags):
        self.log_path = log_path
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ciuicflow.integrations.vllm.proxy", "--port", "0",
                                          "--prefill", prefill.url, "--decode", f"{decode.url}=decode0", *flags],
                                         cwd=REPO, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=_die_with_parent)
        deadline = time.monotonic() + 30
        while True:
            with open(log_path, errors="replace") as fh:
                m = re.search(r"proxy ready on http://127\.0\.0\.1:(\d+)", fh.read())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not start; see {log_path}")
            time.sleep(0.05)

    def status(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        return 0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class LegitClient(threading.Thread):
    """Requests through the proxy one after another (a pause between): (t, status, seconds, key ok)."""

    def __init__(self, port: int, decode: Upstream, pause: float = 0.1):
        super().__init__(daemon=True)
        self.port, self.decode, self.pause = port, decode, pause
        self.results, self.stop = [], threading.Event()

    def one(self):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("POST", "/v1/completions", json.dumps(PROMPT), {"Content-Type": "application/json"})
            resp = conn.getresponse()
            body = resp.read()
            ok = resp.status != 200 or (json.loads(body)["choices"][0]["text"] == "hello"
                                        and resp.getheader("x-ciuic-key", "").startswith("cf-")
                                        and resp.getheader("x-ciuic-prefill") != "failed")
            return resp.status, ok
        except (OSError, http.client.HTTPException):
            return 0, True      # reset at the connection cap (refused before the request was read)
        finally:
            conn.close()

    def run(self):
        while not self.stop.is_set():
            t0 = time.monotonic()
            status, ok = self.one()
            self.results.append((t0, status, time.monotonic() - t0, ok))
            self.stop.wait(self.pause)


def _proxy_request(port: int, head: bytes, body: bytes = b"", timeout: float = 5.0) -> int:
    try:
        return status_of(exchange(port, head + body, timeout))
    except OSError:
        return 0


def _post(path: str, body: bytes, headers=()) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def proxy_attacks(rng: random.Random):
    """(kind, raw request, statuses it may get): each must be refused before anything goes upstream."""
    marked = dict(PROMPT, prompt=MARK)
    victim = {"do_remote_prefill": True, "ciuic_key": "cf-victim", "ciuic_tokens": 3}
    body = json.dumps(marked).encode()
    out = [
        ("client kv_transfer_params", _post("/v1/completions", json.dumps({**marked, "kv_transfer_params": victim})
                                            .encode()), {400}),
        ("kv_transfer_params in vllm_xargs", _post("/v1/completions", json.dumps(
            {**marked, "vllm_xargs": {"kv_transfer_params": "cf-victim"}}).encode()), {400}),
        ("kv_transfer_params and a bad deadline", _post("/v1/chat/completions", json.dumps(
            {**marked, "kv_transfer_params": victim}).encode(), [("x-ciuic-deadline-s", "not-a-number")]), {400}),
        ("malformed x-ciuic-deadline-s", _post("/v1/completions", body,
                                               [("x-ciuic-deadline-s", rng.choice(["nan", "inf", "-1", "1e400"]))]),
         {400}),
        ("malformed x-ciuic-priority", _post("/v1/completions", body, [("x-ciuic-priority", "urgent")]), {400}),
        ("x-ciuic-flow twice", _post("/v1/completions", body, [("x-ciuic-flow", "enabled"),
                                                               ("x-ciuic-flow", "disabled")]), {400}),
        ("oversized Content-Length", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
         % (48 << 20), {413}),
        ("chunked body", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
         b"2\r\n{}\r\n0\r\n\r\n", {411}),
        ("two Content-Lengths", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
         b"Content-Length: 3\r\n\r\n{}", {400}),
        ("70 KB header", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-pad: " + b"a" * 70000 + b"\r\n\r\n", {431}),
        ("random bytes", os.urandom(rng.randint(16, 4096)), {400, 408, 0}),     # 408: no line end, ever
        ("not JSON", _post("/v1/completions", b"{" + MARK.encode() + b" not json"), {400}),
    ]
    return out


def proxy_round(a, ledger, px: ProxyProcess, legit: LegitClient, ups, rng: random.Random) -> None:
    prefill, decode = ups
    r = Round(ledger, "proxy", "proxy")
    with prefill.lock, decode.lock:
        marked0 = prefill.marked + decode.marked
        foreign0 = len(decode.foreign)
    threads0 = px.status("Threads")
    try:
        # every kind of refused request, on fresh connections
        for kind, raw, want in proxy_attacks(rng):
            r.did["bad_requests"] += 1
            status = _proxy_request(px.port, raw)
            r.got[f"answered_{status or 'closed'}"] += 1
            if status not in want and status != 503:
                r.bad.append(f"{kind}: answered {status}, not {sorted(want)}")
        # a body over --max-body-bytes, sent whole
        r.did["oversized_bodies_sent"] += 1
        big = json.dumps({"model": "tiny", "prompt": MARK + "a" * (2 << 20)}).encode()
        status = _proxy_request(px.port, _post("/v1/completions", big), timeout=10)
        r.got[f"oversized_{status or 'reset'}"] += 1
        if status not in (413, 0, 503):
            r.bad.append(f"a 2 MiB body answered {status}, not 413")
        # stalled connections past the connection cap, and a trickler
        stop, cut = threading.Event(), {}

        def trickle():
            t0 = time.monotonic()
            try:
                with socket.create_connection(("127.0.0.1", px.port), timeout=5) as s:
                    for b in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-slow: " + b"a" * 1000:
                        if stop.is_set():
                            break
                        s.sendall(bytes([b]))
                        time.sleep(0.1)
            except OSError:
                pass
            cut["s"] = time.monotonic() - t0
        peak = {"threads": threads0}

        def watch():            # the proxy's threads: one per connection it holds (its real concurrency)
            while not stop.is_set():
                peak["threads"] = max(peak["threads"], px.status("Threads"))
                time.sleep(0.02)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        trickler = threading.Thread(target=trickle, daemon=True)
        trickler.start()
        time.sleep(0.3)         # the trickler has its slot before the flood fills the others
        heads = [b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",          # mid-headers
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"  # mid-body
                 b'{"prompt": "' + MARK.encode() + b"a" * 100]
        started = time.monotonic()
        stalled, failed = [], 0
        for i in range(a.proxy_stalled):
            s, f = open_conns(px.port, 1, heads[i % 2])
            stalled += s
            failed += f
        r.did["stalled_connections"] += len(stalled) + failed
        r.did["tricklers"] += 1
        r.got["connect_failed"] += failed
        # the answers that came before its 1 s timeouts, then the rest; counted by what they say: 503 refused
        # (whenever a loaded host got to it), 408 cut by a timeout, nothing: closed at once or cut
        answered = settle(stalled, 0.3, 0.8, a.proxy_max_connections)
        early = set(answered)
        for s in stalled:
            if s not in answered:
                answered[s] = closed_within(s, started + 1.0 + 2.5 - time.monotonic())
            got = answered[s]
            if got is None:
                r.bad.append("a stalled connection held past its 1 s timeout + 2.5 s")
            elif status_of(got) == 503:
                r.got["refused_503"] += 1
            elif status_of(got) == 408:
                r.got["cut_by_timeout_408"] += 1
            elif status_of(got):
                r.bad.append(f"a stalled connection answered {status_of(got)}")
            else:
                r.got["refused_closed" if s in early else "cut_closed"] += 1
        trickler.join(5)
        stop.set()
        watcher.join(2)
        # connections held at once: the threads beyond those before the round (a connection thread of the
        # legitimate client's among them, perhaps; the opening of the flood may take longer than the 1 s
        # timeouts on a loaded machine, so the client side cannot tell)
        held = peak["threads"] - threads0
        r.extra["held_at_once"] = held
        if held > a.proxy_max_connections:
            r.bad.append(f"{held} connections held at once (threads), cap {a.proxy_max_connections}")
        r.extra["trickler_cut_after_s"] = round(cut.get("s", -1), 2)
        if not 0.5 < cut.get("s", 99) < 4.0:
            r.bad.append(f"the trickler was cut after {cut.get('s')} s (timeout 1 s)")
        for s in stalled:
            s.close()
        end = time.monotonic() + 3.0
        while px.status("Threads") > threads0 + 1 and time.monotonic() < end:
            time.sleep(0.05)
        r.extra["threads"] = [threads0, px.status("Threads")]
        if px.status("Threads") > threads0 + 1:
            r.bad.append(f"proxy threads {px.status('Threads')} 3 s after the flood, {threads0} before")
    except OSError as exc:
        r.bad.append(f"{type(exc).__name__}: {exc}")
    time.sleep(0.3)             # a legitimate request or two after the flood
    with prefill.lock, decode.lock:
        marked = prefill.marked + decode.marked - marked0
        foreign = decode.foreign[foreign0:]
    if marked:
        r.bad.append(f"{marked} attack requests reached an upstream server")
    if foreign:
        r.bad.append(f"the decode server got transfer parameters the prefill never answered for: {foreign[:3]}")
    window = [x for x in list(legit.results) if r.t0 <= x[0] <= time.monotonic()]
    for _, status, took, ok in window:
        r.got[f"legit_{status or 'reset'}"] += 1
        if status not in (200, 503, 0) or not ok:
            r.bad.append(f"a legitimate request answered {status} (ok={ok})")
        elif status in (503, 0) and took > 2.0:
            r.bad.append(f"a legitimate request refused only after {took:.2f}s")
    r.extra["legit_ok"] = sum(1 for x in window if x[1] == 200 and x[3])
    r.extra["legit_worst_ms"] = round(1000 * max((x[2] for x in window if x[1] == 200), default=0), 1)
    r.extra["proxy_rss_mib"] = round(px.status("VmRSS") / 1024, 1)
    r.extra["proxy_peak_rss_mib"] = round(px.status("VmHWM") / 1024, 1)
    r.write()


def proxy(a) -> None:
    ledger = Ledger(os.path.join(a.ledger, "attack-proxy.jsonl"))
    rng = random.Random(f"{a.seed}-proxy")
    prefill = Upstream("prefill")
    decode = Upstream("decode", peer=prefill)
    flags = ["--header-timeout-s", "1", "--body-timeout-s", "1", "--idle-timeout-s", "0.5",
             "--max-connections", str(a.proxy_max_connections), "--max-body-bytes", str(1 << 20), "--timeout", "10"]
    px = ProxyProcess(os.path.join(a.logs, "proxy.log"), prefill, decode, flags)
    ledger.write("proxy_started", pid=px.proc.pid, port=px.port, flags=flags,
                 rss_mib=round(px.status("VmRSS") / 1024, 1))
    legit = LegitClient(px.port, decode)
    legit.start()
    try:
        while not _stopping(a.stop):
            proxy_round(a, ledger, px, legit, (prefill, decode), rng)
            _pause(a, a.stop)
    finally:
        legit.stop.set()
        legit.join(15)
        ok = sum(1 for x in legit.results if x[1] == 200 and x[3])
        ledger.write("proxy_stopped", legit_requests=len(legit.results), legit_ok=ok,
                     exited=px.proc.poll(), peak_rss_mib=round(px.status("VmHWM") / 1024, 1))
        px.stop()
        prefill.close()
        decode.close()


# ====================================================================== crafted packed chunks
ZERO_PARTS = 1_300_000      # zero-byte part descriptions in one frame (~7.8 MB): descriptions that must not bypass the memory budget


def over_bound_frame(tid: int, parts: int, nbytes: int = 100) -> bytes:
    """A packed chunk of ``parts`` parts of ``nbytes`` each, with their data: well formed but one part too many."""
    import crc32c
    from ciuicflow.kvflow.proto import kvflow_pb2 as pb
    data = os.urandom(parts * nbytes)
    infos = [pb.PartInfo(index=k, nbytes=nbytes) for k in range(parts)]
    chunk = pb.Chunk(tid=tid, seq=0, sn=1, part=0, offset=0, data=data, crc32c=crc32c.crc32c(data), info=infos[0],
                     more=infos[1:])
    return pb.PeerFrame(chunk=chunk).SerializeToString()


def _open_frame(key: str, tid: int) -> bytes:
    from ciuicflow.kvflow.proto import kvflow_pb2 as pb
    return pb.PeerFrame(open=pb.TransferOpen(tid=tid, key=key, uuid=f"{key}-u", payload_kind="bytes")
                        ).SerializeToString()


def _link(listen: str, md, requests):
    import grpc
    from ciuicflow.kvflow.proto import kvflow_pb2 as pb
    opts = [("grpc.max_send_message_length", 16 << 20), ("grpc.max_receive_message_length", 16 << 20)]
    with grpc.insecure_channel(listen, options=opts) as channel:
        link = channel.stream_stream("/ciuicflow.kvflow.v1.KVFlowPeer/Link", request_serializer=lambda raw: raw,
                                     response_deserializer=pb.PeerReply.FromString)
        return [x.ack for x in link(iter(requests), metadata=md, timeout=30) if x.HasField("ack")]


def _data_plane(listen: str, md, requests):
    import grpc
    from ciuicflow.kvflow.proto import kvflow_pb2 as pb
    from ciuicflow.kvflow.transports.tcp import HELLO, MSG, STATUS
    with grpc.insecure_channel(listen) as ch:
        plane = ch.unary_unary("/ciuicflow.kvflow.v1.KVFlowPeer/DataPlane",
                               request_serializer=pb.DataPlaneRequest.SerializeToString,
                               response_deserializer=pb.DataPlaneReply.FromString)(pb.DataPlaneRequest(),
                                                                                   metadata=md, timeout=10)
    if not plane.port:
        return None, None
    acks, status = [], None
    frames = [(HELLO, plane.ticket)] + [(MSG, raw) for raw in requests]
    for kind, payload in wire_session(plane.port, frames, timeout=30):
        if kind == STATUS:
            status = payload
        elif kind == MSG:
            reply = pb.PeerReply.FromString(payload)
            if reply.HasField("ack"):
                acks.append(reply.ack)
    return acks, status


def packed_round(a, ledger, t: dict, token: str, block: bytes, rng: random.Random, n: int) -> None:
    import grpc
    from ciuicflow.kvflow import Client, KVFlowError
    from ciuicflow.kvflow.proto import kvflow_pb2 as pb
    from ciuicflow.kvflow.proto.messages import MAX_PACKED_PARTS
    r = Round(ledger, "packed", t["name"])
    source = rng.choice(t["peers"])
    r.extra["as_peer"] = source
    md = (("x-ciuic-peer", source), ("authorization", f"Bearer {token}"))
    keys = []
    for transport in ("link", "data_plane"):
        requests, kinds = [], []
        for tid, kind in ((1, "zero_byte_parts"), (2, "over_bound")):
            key = f"attack-{os.getpid()}-{n}-{transport}-{tid}"
            keys.append(key)
            frame = zero_parts_frame(tid, block) if kind == "zero_byte_parts" else \
                over_bound_frame(tid, MAX_PACKED_PARTS + 1)
            requests += [_open_frame(key, tid), frame]
            kinds.append(kind)
            r.did[f"{transport}_{kind}"] += 1
            r.did["bytes"] += len(frame)
        try:
            if transport == "link":
                acks, status = _link(t["listen"], md, requests), 0
            else:
                acks, status = _data_plane(t["listen"], md, requests)
                if acks is None:
                    r.got["no_data_plane"] += 1
                    continue
        except grpc.RpcError as exc:
            r.bad.append(f"{transport}: {exc.code().name} {exc.details()}")
            continue
        except OSError as exc:
            r.bad.append(f"{transport}: {type(exc).__name__}: {exc}")
            continue
        if status not in (0, None):
            r.bad.append(f"{transport}: session ended with status {status}")
        for ack in acks:
            refused = ack.code == pb.ACK_FAILED and ack.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0] \
                and f"more than {MAX_PACKED_PARTS} parts" in ack.message
            r.got["refused_invalid_argument" if refused else "accepted_or_other"] += 1
            if not refused:
                r.bad.append(f"{transport}: chunk answered code {ack.code} error {ack.error_code} {ack.message!r}")
        if len(acks) != len(kinds):
            r.bad.append(f"{transport}: {len(acks)} acks for {len(kinds)} crafted chunks")
    client = Client(t["api"])
    try:
        for key in keys:
            try:
                client.recv(key, timeout_s=0.2, source=source)
                r.bad.append(f"{key}: a crafted transfer was received")
                r.got["receivable"] += 1
            except KVFlowError:
                r.got["not_receivable"] += 1
    finally:
        client.close()
    r.write()


def packed(a) -> None:
    ledger = Ledger(os.path.join(a.ledger, "attack-packed.jsonl"))
    rng = random.Random(f"{a.seed}-packed")
    with open(a.token_file) as fh:
        token = fh.read().strip()
    block = more_block(ZERO_PARTS)          # built once (~1 s), each round's frames around it
    targets, n = json.loads(a.targets), 0
    while not _stopping(a.stop):
        t = rng.choice(targets)
        if not _target_down(ledger, "packed", t):
            n += 1
            packed_round(a, ledger, t, token, block, rng, n)
        _pause(a, a.stop)


# ====================================================================== descriptor floods
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
            refusal = "connect: " + str(exc)
            break
        got = 0
        while taken < count:
            try:
                socket.send_fds(sock, [b"R"], [fd])
                reply = sock.recv(512).decode()
            except OSError as exc:
                reply = "E" + str(exc)
            if not reply.startswith("H"):
                refusal = reply[1:] or "connection closed"
                break
            taken, got = taken + 1, got + 1
        if not got:
            break
    print(taken, refusal, flush=True)
    sys.stdin.read()          # hold the handles until told
""")


def handles_round(a, ledger, t: dict) -> None:
    from ciuicflow.kvflow.proto import runtime
    from ciuicflow.kvflow.proto.shm import HEADER
    r = Round(ledger, "handles", t["name"])
    caps = t["caps"]
    r.extra.update(cap_per_client=caps["handles_per_client"], cap_total=caps["handles"])
    path = runtime.api_file(int(t["api"].rpartition(":")[2]), "sock")
    procs, total, refusals = [], 0, []
    ask = 100000
    try:
        for _ in range(caps["handles"] // caps["handles_per_client"] + 3):
            proc = subprocess.Popen([sys.executable, "-c", FLOOD, path, str(ask), str(HEADER)], cwd=REPO,
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            procs.append(proc)
            taken, _, refusal = proc.stdout.readline().strip().partition(" ")
            taken = int(taken or 0)
            r.did["flood_clients"] += 1
            r.did["handles_offered"] += taken + 1
            total += taken
            refusals.append(refusal)
            kind = "per_client" if "this client" in refusal else "in_all" if "in all" in refusal else "other"
            r.got[f"refused_{kind}"] += 1
            r.got["handles_parked"] += taken
            if taken >= ask or taken > caps["handles_per_client"]:
                r.bad.append(f"a client parked {taken} handles (cap {caps['handles_per_client']} per client)")
            if kind == "other":
                r.bad.append(f"refusal not naming a cap: {refusal!r}")
                break
            if kind == "in_all" or taken == 0:
                break
        r.extra["parked_at_once"] = total
        if total > caps["handles"]:
            r.bad.append(f"{total} handles parked at once, cap {caps['handles']} in all")
        if "in all" not in refusals[-1]:
            r.bad.append(f"the total cap never refused ({total} parked, cap {caps['handles']})")
        time.sleep(a.hold_s)        # the soak's own clients meanwhile: in-band when no handle is to be had
    finally:
        for proc in procs:
            try:
                proc.stdin.close()
            except OSError:
                pass
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    r.extra["refusals"] = sorted(set(x[:90] for x in refusals))
    r.write()


def handles(a) -> None:
    ledger = Ledger(os.path.join(a.ledger, "attack-handles.jsonl"))
    rng = random.Random(f"{a.seed}-handles")
    targets = json.loads(a.targets)
    while not _stopping(a.stop):
        t = rng.choice(targets)
        if not _target_down(ledger, "handles", t):
            handles_round(a, ledger, t)
        _pause(a, a.stop)


def metrics(a) -> None:
    ledger = Ledger(os.path.join(a.ledger, "attack-metrics.jsonl"))
    rng = random.Random(f"{a.seed}-metrics")
    targets = json.loads(a.targets)
    while not _stopping(a.stop):
        t = rng.choice(targets)
        if not _target_down(ledger, "metrics", t):
            metrics_round(a, ledger, t, rng)
        _pause(a, a.stop)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=ROLES)
    p.add_argument("--ledger", required=True)
    p.add_argument("--stop", required=True, help="the orchestrator creates this file to stop the attacker")
    p.add_argument("--logs", default=".")
    p.add_argument("--seed", default="0")
    p.add_argument("--targets", default="[]", help='[{"name", "api", "listen", "metrics", "peers"}]')
    p.add_argument("--token-file", default="", help="the sidecars' shared peer token (packed)")
    p.add_argument("--pause", type=float, default=2.0, help="seconds between rounds")
    p.add_argument("--extra", type=int, default=24, help="metrics: idle connections beyond the cap")
    p.add_argument("--header-timeout-s", type=float, default=5.0, help="metrics: the sidecars' --hello-timeout-s")
    p.add_argument("--hold-s", type=float, default=3.0, help="handles: how long the parked handles are held")
    p.add_argument("--proxy-stalled", type=int, default=40, help="proxy: stalled connections per round")
    p.add_argument("--proxy-max-connections", type=int, default=20)
    a = p.parse_args(argv)
    {"metrics": metrics, "proxy": proxy, "packed": packed, "handles": handles}[a.role](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
