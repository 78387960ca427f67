"""The vLLM routing proxy as an attacker would use it: a real proxy process
(``python -m ciuicflow.integrations.vllm.proxy``) in front of two small HTTP servers on 127.0.0.1 that stand
in for the prefill and decode vLLM servers, record every request they receive and can answer 503.

- Transfer parameters are the proxy's alone: a client's ``kv_transfer_params`` (for example another
  request's ``ciuic_key``) are refused with 400 and reach neither server, whatever the prefill does; the
  decode server gets only what the prefill returned for this request's own key.
- A malformed ``x-ciuic-*`` header is a 400 before anything goes upstream.
- Request size: 413 from Content-Length before reading (the proxy's memory does not follow the body), 411
  without a length or with a chunked body.
- Slow and stalled clients are cut off by the header and body timeouts (a phase's deadline, not one read's);
  the proxy's threads come back to their baseline; while they are held a legitimate request is served, or
  refused at once once the connection cap is reached; connections beyond the cap are refused at once.

To start the proxy with small limits elsewhere (the soak), as here:
``Proxy(tmp_path, prefill, decode, "--header-timeout-s", "1", "--max-connections", "20")`` with two
``Upstream``s, or the same flags on ``python -m ciuicflow.integrations.vllm.proxy --port 0 ...`` (its log says
``proxy ready on http://127.0.0.1:PORT``).
"""
import http.client
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from ciuicflow.integrations.vllm import config as C
from ciuicflow.testing.stub_http import JsonHandler

from tests import REPO
MiB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads /proc/PID/status")


# ---------------------------------------------------------------------------------------------- upstreams
RAW_ANSWERS = {     # decode answers as a failing or hostile server might write them
    "short": b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"choices"',
    "interim": b"HTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\nHTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}",
    "folded": b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\tX-Injected: 1\r\nContent-Length: 2\r\n\r\n{}",
}


class Upstream:
    """A stand-in for a vLLM server (prefill or decode role): records each request; ``mode`` says how it
    answers: ``ok``, ``503``, ``wrong-key`` (prefill: parameters for another request's key), ``huge``
    (prefill: an answer larger than the proxy takes), or one of ``RAW_ANSWERS`` (decode)."""

    def __init__(self, role: str):
        self.role, self.mode, self.received = role, "ok", []
        self._lock = threading.Lock()
        up = self

        class H(JsonHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):
                with up._lock:
                    up.received.append({"method": "GET", "path": self.path})
                self._json(200, {"ok": True})

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                body = json.loads(raw)
                with up._lock:
                    up.received.append({"method": "POST", "path": self.path, "body": body,
                                        "headers": {k.lower(): v for k, v in self.headers.items()}})
                if up.mode == "503":
                    return self._json(503, {"error": "overloaded"})
                if up.role == "decode" and up.mode in RAW_ANSWERS:
                    self.close_connection = True
                    return self.wfile.write(RAW_ANSWERS[up.mode])
                if up.role == "prefill":
                    asked = body.get("kv_transfer_params") or {}
                    back = {C.P_PREFILL: True, C.P_KEY: asked.get(C.P_KEY), C.P_TOKENS: 3, C.P_SOURCE: "prefill0",
                            C.P_PRIORITY: asked.get(C.P_PRIORITY, "normal")}
                    if up.mode == "wrong-key":
                        back[C.P_KEY] = "cf-victim"
                    answer = {"choices": [{"text": "x"}], "kv_transfer_params": back}
                    if up.mode == "huge":
                        answer["pad"] = "x" * (2 * MiB)
                    return self._json(200, answer)
                if body.get("stream"):
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.send_header("Transfer-Encoding", "chunked")
                    self.end_headers()
                    for ev in (b'data: {"choices": [{"text": "he"}]}\n\n', b'data: {"choices": [{"text": "llo"}]}\n\n',
                               b"data: [DONE]\n\n"):
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(ev), ev))
                    self.wfile.write(b"0\r\n\r\n")
                    return
                return self._json(200, {"choices": [{"text": "hello"}], "kv_transfer_params": None})

        class Quiet(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass        # the proxy closing its side of a kept-alive connection: nothing to report

        self.server = Quiet(("127.0.0.1", 0), H)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return "http://127.0.0.1:%d" % self.server.server_address[1]

    def reset(self, mode: str = "ok") -> None:
        with self._lock:
            self.mode, self.received = mode, []

    def posts(self):
        with self._lock:
            return [r for r in self.received if r["method"] == "POST"]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class Proxy:
    """The proxy as a process of its own, in front of ``prefill`` and ``decode``."""

    def __init__(self, tmp_path, prefill: Upstream, decode: Upstream, *flags: str):
        self.log = Path(tmp_path) / f"proxy-{time.monotonic_ns()}.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "ciuicflow.integrations.vllm.proxy", "--port", "0",
                                          "--prefill", prefill.url, "--decode", f"{decode.url}=decode0", *flags],
                                         cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            m = re.search(r"proxy ready on http://127\.0\.0\.1:(\d+)", self.log.read_text())
            if m:
                self.port = int(m.group(1))
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"proxy did not start:\n{self.log.read_text()}")
            time.sleep(0.05)

    def status(self, field: str) -> int:
        with open(f"/proc/{self.proc.pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)

    def threads(self) -> int:
        return self.status("Threads")

    def rss_kib(self) -> int:
        return self.status("VmRSS")

    def wait_threads(self, at_most: int, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.threads() > at_most and time.monotonic() < end:
            time.sleep(0.05)
        return self.threads()

    def request(self, body, headers=None, path="/v1/completions", timeout=10.0):
        """POST ``body`` (an object, or bytes as they are): (status, headers, body bytes)."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            conn.putrequest("POST", path)
            conn.putheader("Content-Type", "application/json")
            conn.putheader("Content-Length", str(len(data)))
            for k, v in (headers.items() if isinstance(headers, dict) else headers or ()):
                conn.putheader(k, v)
            conn.endheaders(data)
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


def raw_exchange(port: int, data: bytes, timeout: float = 5.0) -> bytes:
    """Send ``data`` on a fresh connection; everything the proxy answers until it closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                break
            if not chunk:
                break
            out += chunk
        return out


def status_of(answer: bytes) -> int:
    m = re.match(rb"HTTP/1\.[01] (\d{3})", answer)
    return int(m.group(1)) if m else 0


PROMPT = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4}


@pytest.fixture(scope="module")
def upstreams():
    p, d = Upstream("prefill"), Upstream("decode")
    yield p, d
    p.close()
    d.close()


@pytest.fixture(scope="module")
def proxy(upstreams, tmp_path_factory):
    px = Proxy(tmp_path_factory.mktemp("proxy"), *upstreams, "--max-prefill-answer-bytes", str(1 * MiB),
               "--timeout", "10")
    yield px
    px.stop()


@pytest.fixture
def clean(upstreams):
    for u in upstreams:
        u.reset()
    return upstreams


# ---------------------------------------------------------------------------------------------- transfer parameters
def test_transfer_parameters_are_the_proxys_and_the_prefills(proxy, clean):
    prefill, decode = clean
    status, hdrs, body = proxy.request(PROMPT, {"x-ciuic-priority": "HIGH", "x-ciuic-deadline-s": "2.5",
                                                "x-ciuic-flow": "disabled"})
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "hello"
    key = hdrs["x-ciuic-key"]
    assert "x-ciuic-prefill" not in hdrs
    (pre,), (dec,) = prefill.posts(), decode.posts()
    assert pre["body"]["kv_transfer_params"] == {C.P_DECODE: True, C.P_PREFILL: False, C.P_KEY: key,
                                                 C.P_DEST: "decode0", C.P_PRIORITY: "high", C.P_DEADLINE: 2.5,
                                                 C.P_FLOW: "disabled"}
    assert pre["body"]["max_tokens"] == 1 and pre["body"]["stream"] is False
    assert dec["body"]["kv_transfer_params"] == {C.P_PREFILL: True, C.P_KEY: key, C.P_TOKENS: 3,
                                                 C.P_SOURCE: "prefill0", C.P_PRIORITY: "high"}
    assert {k: v for k, v in dec["body"].items() if k != "kv_transfer_params"} == PROMPT


def test_streamed_answer_passes_through(proxy, clean):
    status, hdrs, body = proxy.request({**PROMPT, "stream": True})
    assert status == 200 and hdrs["content-type"] == "text/event-stream"
    assert body.count(b"data:") == 3 and body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("prefill_mode", ["ok", "503"])
@pytest.mark.parametrize("where", ["top", "vllm_xargs", "empty", "escaped"])
def test_client_transfer_parameters_are_refused_and_reach_nobody(proxy, clean, prefill_mode, where):
    """The attack: another request's key in the body, the prefill made to fail (a 503, or a bad
    deadline header): nothing reaches either server."""
    prefill, decode = clean
    prefill.mode = prefill_mode
    victim = {C.P_PREFILL: True, C.P_KEY: "cf-victim", C.P_TOKENS: 3}
    if where == "top":
        body = json.dumps({**PROMPT, "kv_transfer_params": victim}).encode()
    elif where == "vllm_xargs":
        body = json.dumps({**PROMPT, "vllm_xargs": {"kv_transfer_params": "cf-victim"}}).encode()
    elif where == "empty":
        body = json.dumps({**PROMPT, "kv_transfer_params": None}).encode()
    else:       # the same key spelled with an escape: what vLLM's JSON parser reads is what counts
        body = json.dumps({**PROMPT, "kv\\u005ftransfer_params": victim}).encode().replace(b"\\\\u005f", b"\\u005f")
        assert b"kv\\u005ftransfer_params" in body
    for headers in ({}, {"x-ciuic-deadline-s": "not-a-number"}):
        status, hdrs, answer = proxy.request(body, headers)
        assert status == 400, answer
        error = json.loads(answer)["error"]
        assert "kv_transfer_params" in error or "x-ciuic-deadline-s" in error
    assert prefill.posts() == [] and decode.posts() == []


@pytest.mark.parametrize("mode", ["503", "wrong-key", "huge"])
def test_failed_prefill_sends_no_transfer_parameters(proxy, clean, mode):
    """A prefill that fails (503), answers for another request's key, or answers more than the proxy takes:
    the decode server computes the prompt, with no transfer parameters at all."""
    prefill, decode = clean
    prefill.mode = mode
    status, hdrs, body = proxy.request(PROMPT)
    assert status == 200 and hdrs.get("x-ciuic-prefill") == "failed"
    (dec,) = decode.posts()
    assert "kv_transfer_params" not in dec["body"] and dec["body"] == PROMPT


BAD_HEADERS = [
    {"x-ciuic-deadline-s": v} for v in ("abc", "nan", "inf", "-inf", "-1", "0", "1e9", "86401", "", "0x10", "1e400")
] + [
    {"x-ciuic-priority": v} for v in ("urgent", "", "high;normal")
] + [
    {"x-ciuic-flow": v} for v in ("maybe", "", "1")
] + [
    [("x-ciuic-priority", "high"), ("x-ciuic-priority", "low")],
    [("x-ciuic-deadline-s", "1"), ("x-ciuic-deadline-s", "1")],
]


@pytest.mark.parametrize("headers", BAD_HEADERS, ids=lambda h: repr(h)[:40])
def test_malformed_headers_are_400_and_nothing_goes_upstream(proxy, clean, headers):
    prefill, decode = clean
    status, _, body = proxy.request(PROMPT, headers)
    assert status == 400, body
    assert prefill.posts() == [] and decode.posts() == []


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"text"', b"{not json", b"\xff\xfe{}", b"[" * 100000 + b"]" * 100000,
                                 b"\xef\xbb\xbf{}"], ids=["list", "string", "broken", "utf16", "deep", "bom"])
def test_bodies_that_are_not_json_objects_are_400(proxy, clean, raw):
    prefill, decode = clean
    status, _, _ = proxy.request(raw)
    assert status == 400
    assert prefill.posts() == [] and decode.posts() == []
    assert proxy.request(PROMPT)[0] == 200, "the proxy keeps serving"


def test_empty_object_and_odd_spacing_get_the_prefills_parameters(proxy, clean):
    prefill, decode = clean
    for raw in (b"{}", b'  {"prompt": [1]}  \r\n\t', b'{"prompt": "\\ud800 \\u00e9 \xc3\xa9"}'):
        decode.reset()
        status, hdrs, _ = proxy.request(raw)
        assert status == 200
        (dec,) = decode.posts()
        assert dec["body"]["kv_transfer_params"][C.P_KEY] == hdrs["x-ciuic-key"]
        assert {k: v for k, v in dec["body"].items() if k != "kv_transfer_params"} == json.loads(raw)


def test_body_nested_near_the_recursion_limit_is_answered(proxy, clean):
    """Nesting that json.loads takes but json.dumps (a few frames deeper) does not: a 400, not a connection
    dropped without an answer."""
    prefill, decode = clean
    answers = set()
    for depth in range(950, 1010):
        body = b'{"prompt": [1], "x": ' + b"[" * depth + b"]" * depth + b"}"
        answers.add(proxy.request(body)[0])
    assert answers <= {200, 400} and 400 in answers, answers


@pytest.mark.parametrize("mode", ["short", "interim", "folded"])
def test_failing_decode_answers_do_not_desynchronize_the_client(proxy, clean, mode):
    """A decode server that closes short of its Content-Length (the client's connection is closed at once,
    not kept alive with an answer still owed), answers with an interim 1xx only (502), or folds a header
    (not passed on)."""
    prefill, decode = clean
    decode.mode = mode
    if mode == "short":
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=5)
        try:
            t0 = time.monotonic()
            conn.request("POST", "/v1/completions", json.dumps(PROMPT).encode(), {"Content-Type": "application/json"})
            r = conn.getresponse()
            assert r.status == 200
            with pytest.raises(http.client.IncompleteRead):
                r.read()
            assert time.monotonic() - t0 < 3.0, "closed at once, not after the keep-alive timeout"
        finally:
            conn.close()
    elif mode == "interim":
        status, _, body = proxy.request(PROMPT)
        assert status == 502 and b"interim" in body
    else:
        status, hdrs, body = proxy.request(PROMPT)
        assert status == 200 and hdrs["content-type"] == "application/json" and "x-injected" not in hdrs
    decode.mode = "ok"
    assert proxy.request(PROMPT)[0] == 200


@pytest.mark.parametrize("flags", [("--prefill", "https://127.0.0.1:8100"), ("--prefill", "http://127.0.0.1:x"),
                                   ("--timeout", "nan"), ("--timeout", "0")], ids=["https", "port", "nan", "zero"])
def test_misconfigured_upstream_refuses_to_start(tmp_path, flags):
    """An https URL would be spoken to in cleartext on port 80; a bad port or upstream timeout would fail
    every request: the proxy refuses to start."""
    p = subprocess.run([sys.executable, "-m", "ciuicflow.integrations.vllm.proxy", "--port", "0",
                        "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2=decode0", *flags],
                       cwd=REPO, capture_output=True, text=True, timeout=15)
    assert p.returncode == 2 and "proxy ready" not in p.stderr, p.stderr


# ---------------------------------------------------------------------------------------------- sizes
def test_oversized_body_is_413_before_reading_and_memory_stays_flat(upstreams, tmp_path):
    prefill, decode = upstreams
    prefill.reset(), decode.reset()
    px = Proxy(tmp_path, prefill, decode, "--max-body-bytes", str(1 * MiB))
    try:
        assert px.request(PROMPT)[0] == 200
        prefill.reset(), decode.reset()
        rss0 = px.rss_kib()
        # headers only: the answer comes before any of the body
        t0 = time.monotonic()
        answer = raw_exchange(px.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                              % (48 * MiB))
        assert status_of(answer) == 413 and time.monotonic() - t0 < 3.0
        # Expect: 100-continue: refused before the body is sent
        answer = raw_exchange(px.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                              b"Content-Length: %d\r\n\r\n" % (48 * MiB))
        assert status_of(answer) == 413
        # the whole 48 MiB body sent, three times over: 413 (or a reset while still sending), nothing kept
        big = json.dumps({"model": "tiny", "prompt": "a" * (48 * MiB)}).encode()
        for _ in range(3):
            try:
                status = px.request(big, timeout=20)[0]
            except (ConnectionResetError, BrokenPipeError):
                status = 413
            assert status == 413
        grown = px.rss_kib() - rss0
        print(f"[proxy] RSS {rss0} KiB before, grew {grown} KiB after 5 oversized requests of 48 MiB")
        assert grown < 8 * 1024, f"the proxy's RSS grew {grown} KiB"
        assert prefill.posts() == [] and decode.posts() == []
        assert px.request(PROMPT)[0] == 200
    finally:
        px.stop()


@pytest.mark.parametrize("head,status", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n{}", 411),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1e3\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nx-pad: " + b"a" * 70000 + b"\r\n\r\n", 431),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello", 400),
    (b"POST /v1/other HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 404),
    (b"PUT /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 501),
], ids=["no-length", "chunked", "negative", "two-lengths", "not-integer", "huge-header", "get-body", "path",
        "method"])
def test_request_framing_is_checked(proxy, clean, head, status):
    prefill, decode = clean
    answer = raw_exchange(proxy.port, head)
    assert status_of(answer) == status, answer[:200]
    assert prefill.posts() == [] and decode.posts() == []


def test_bytes_in_flight_are_capped(upstreams, tmp_path):
    """One client sending a body of the largest size slowly holds the in-flight budget: another large body
    is refused at once (503), a small one still fits."""
    prefill, decode = upstreams
    prefill.reset(), decode.reset()
    px = Proxy(tmp_path, prefill, decode, "--max-body-bytes", str(MiB), "--max-inflight-bytes", str(MiB + 4096),
               "--body-timeout-s", "5")
    try:
        with socket.create_connection(("127.0.0.1", px.port)) as hog:
            hog.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % MiB)
            time.sleep(0.3)
            t0 = time.monotonic()
            answer = raw_exchange(px.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n"
                                  % (MiB // 2))
            assert status_of(answer) == 503 and time.monotonic() - t0 < 2.0
            assert px.request(PROMPT)[0] == 200
    finally:
        px.stop()


def test_concurrent_large_bodies_stay_within_the_budget(upstreams, tmp_path):
    """16 clients at once, each with a 1 MiB body built to be expensive to parse (nested empty objects:
    about 25 times their size parsed), against an 8 MiB budget: 8 are served, 8 refused at once, and the
    proxy's peak resident memory stays within a few times the budget."""
    prefill, decode = upstreams
    prefill.reset(), decode.reset()
    px = Proxy(tmp_path, prefill, decode, "--max-body-bytes", str(MiB), "--max-inflight-bytes", str(8 * MiB))
    try:
        assert px.request(PROMPT)[0] == 200
        hwm0 = px.status("VmHWM")
        body = b'{"prompt": [' + b"{}," * ((MiB - 20) // 3) + b"{}]}"
        assert len(body) <= MiB
        out = []
        threads = [threading.Thread(target=lambda: out.append(px.request(body, timeout=60)[0])) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        grown = (px.status("VmHWM") - hwm0) >> 10
        print(f"[proxy] 16 concurrent 1 MiB bodies, 8 MiB budget: answers {sorted(out)}, peak RSS +{grown} MiB")
        assert len(out) == 16 and set(out) <= {200, 503} and out.count(200) >= 8
        assert grown < 64, f"peak resident memory grew {grown} MiB"
    finally:
        px.stop()


# ---------------------------------------------------------------------------------------------- slow clients
HEAD_PART = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl"
BODY_PART = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b'{"prompt": "' + b"a" * 100


def stall(port: int, n: int, payloads=(HEAD_PART, BODY_PART)):
    socks = []
    for i in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(payloads[i % len(payloads)])
        socks.append(s)
    return socks


def wait_closed(socks, timeout: float, since: float = None):
    """Seconds from ``since`` (default: now) until each socket was closed by the proxy (None: still open
    ``timeout`` s from now), and what each got."""
    t0, out = time.monotonic(), []
    since = t0 if since is None else since
    for s in socks:
        got = b""
        while True:
            s.settimeout(max(0.01, t0 + timeout - time.monotonic()))
            try:
                chunk = s.recv(4096)
            except socket.timeout:
                out.append((None, got))
                break
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                out.append((time.monotonic() - since, got))
                break
            got += chunk
        s.close()
    return out


def trickle(port: int, stop: threading.Event, result: dict):
    """A slowloris: one header byte every 0.1 s, for as long as the proxy lets it."""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        try:
            for b in (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"x-slow: " + b"a" * 10000):
                if stop.is_set():
                    break
                s.sendall(bytes([b]))
                time.sleep(0.1)
        except OSError:
            pass
        result["cut_after_s"] = time.monotonic() - t0


def test_stalled_clients_are_cut_off_and_others_served(upstreams, tmp_path):
    """150 connections that stop mid-headers or mid-body, and one trickling a byte every 0.1 s: all are
    closed within the timeouts (1 s here), a legitimate request is served while they are held, and the
    proxy's threads come back to their baseline."""
    prefill, decode = upstreams
    prefill.reset(), decode.reset()
    px = Proxy(tmp_path, prefill, decode, "--header-timeout-s", "1", "--body-timeout-s", "1",
               "--max-connections", "200")
    try:
        assert px.request(PROMPT)[0] == 200
        base = px.wait_threads(0, 0.5)
        stop, slow = threading.Event(), {}
        trickler = threading.Thread(target=trickle, args=(px.port, stop, slow), daemon=True)
        trickler.start()
        t0 = time.monotonic()
        socks = stall(px.port, 150)
        end = time.monotonic() + 0.6          # the proxy's accepting thread catching up
        while px.threads() < base + 151 and time.monotonic() < end:
            time.sleep(0.02)
        held = px.threads()
        t1 = time.monotonic()
        status = px.request(PROMPT, timeout=5)[0]
        served_in = time.monotonic() - t1
        assert status == 200 and served_in < 1.0, (status, served_in)
        closed = wait_closed(socks, timeout=5.0, since=t0)
        trickler.join(5)
        stop.set()
        first, last = min(c[0] or 99 for c in closed), max(c[0] or 99 for c in closed)
        print(f"[proxy] {held - base} threads held by 151 stalled clients; legitimate request served in "
              f"{served_in * 1000:.0f} ms; stalled closed {first:.2f} to {last:.2f} s after they connected, "
              f"the trickler after {slow.get('cut_after_s', 0):.2f} s")
        assert held - base >= 140, "the stalled clients each had a connection (and a thread)"
        assert all(c[0] is not None for c in closed), "every stalled connection closed within 5 s"
        assert 0.9 < min(c[0] for c in closed) and max(c[0] for c in closed) < 2.5, "cut off by the 1 s timeouts"
        assert {status_of(c[1]) for c in closed} <= {408, 0}
        assert 0.8 < slow["cut_after_s"] < 3.0, slow
        assert px.wait_threads(base, 3.0) <= base, "threads back to the baseline"
        assert px.request(PROMPT)[0] == 200
        assert len(decode.posts()) == 3
    finally:
        stop.set()
        px.stop()


def test_connections_beyond_the_cap_are_refused_at_once(upstreams, tmp_path):
    prefill, decode = upstreams
    prefill.reset(), decode.reset()
    px = Proxy(tmp_path, prefill, decode, "--header-timeout-s", "2", "--body-timeout-s", "2",
               "--max-connections", "20")
    try:
        assert px.request(PROMPT)[0] == 200
        base = px.wait_threads(0, 0.5)
        held = stall(px.port, 20)
        time.sleep(0.3)
        t0 = time.monotonic()
        extra = stall(px.port, 130)
        refused = wait_closed(extra, timeout=2.0)
        took = time.monotonic() - t0
        assert all(r[0] is not None for r in refused), "each connection beyond the cap closed at once"
        assert {status_of(r[1]) for r in refused} <= {503, 0} and status_of(refused[0][1]) == 503
        assert took < 2.0, took
        assert px.threads() <= base + 20, "no thread for a refused connection"
        t0 = time.monotonic()
        try:
            status = px.request(PROMPT, timeout=5)[0]
        except (ConnectionResetError, http.client.RemoteDisconnected, BrokenPipeError):
            status = 503
        assert status == 503 and time.monotonic() - t0 < 1.0, "a request at the cap is refused fast, not held"
        closed = wait_closed(held, timeout=4.0)
        assert all(c[0] is not None for c in closed) and {status_of(c[1]) for c in closed} <= {408, 0}
        assert px.wait_threads(base, 3.0) <= base
        assert px.request(PROMPT)[0] == 200, "served again once the stalled connections were cut"
    finally:
        px.stop()


def test_idle_keep_alive_connection_is_closed(upstreams, tmp_path):
    prefill, decode = upstreams
    px = Proxy(tmp_path, prefill, decode, "--idle-timeout-s", "0.5")
    try:
        with socket.create_connection(("127.0.0.1", px.port), timeout=5) as s:
            body = json.dumps(PROMPT).encode()
            for _ in range(2):      # two requests on one connection: it is kept alive between them
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
                          % (len(body), body))
                r = http.client.HTTPResponse(s)
                r.begin()
                assert r.status == 200 and r.read()
            t0 = time.monotonic()
            assert s.recv(1) == b""
            assert 0.3 < time.monotonic() - t0 < 2.0
    finally:
        px.stop()


def test_serve_keeps_its_old_signature():
    """demo.py calls ``serve([prefill], [(decode, peer)], timeout=...)``: the limits are keywords with the
    command line's defaults."""
    from ciuicflow.integrations.vllm import proxy as P
    p, d = Upstream("prefill"), Upstream("decode")
    server = P.serve([p.url], [(d.url, "decode0")], timeout=30)
    try:
        assert server.limits == P.Limits()
        conn = http.client.HTTPConnection(*server.server_address[:2], timeout=10)
        conn.request("GET", "/health")
        assert conn.getresponse().status == 200
        conn.close()
        with pytest.raises(ValueError):
            P.serve([p.url], [(d.url, "decode0")], max_body_bytes=0)
    finally:
        server.shutdown()
        server.server_close()
        p.close()
        d.close()
