"""Where each request's TTFT went, for bench/vllm/serve.py: the load generator's own stamps (start,
TTFT, the proxy's prefill time, the transfer key) joined with the connector's phase records in the two
vLLM servers' logs (ciuicflow/integrations/vllm/phases.py), per request, then p50/p99 per mode and class.

Phases of one request (seconds; wall clock of one host):
  prefill     the proxy's call to the prefill server (its queue + the prompt's forward + the answer)
  kv_tail     the KV still in transit after that answer (send done - prefill answered; 0 if done before)
  send        first layer appended -> the decode sidecar holds it all (sidecar queueing + the link)
  link        what the link alone needs for those bytes (bytes / link rate; tc or emulated link only)
  queued      send - link: waiting in the sidecars' queues (and the send window) rather than on the wire
  append      time the prefill forward pass spent blocked in the sidecar client's append (back-pressure)
  load        the decode connector's load, request scheduled -> every layer written
  to_load     prefill answered -> the decode server started the load (proxy, HTTP, decode scheduler)
  after_load  load done -> first token at the client (decode scheduling, the last token's forward, HTTP)
"""
from __future__ import annotations

import glob
import os
from typing import Dict, List, Optional

from ciuicflow.integrations.vllm.phases import parse_phases
from bench.vllm.report import pct

PHASES = ("prefill", "kv_tail", "send", "link", "queued", "append", "load", "to_load", "after_load")


def read_records(workdir: str) -> Dict[str, Dict[str, dict]]:
    """{key: {"send": record, "load": record}} from every vLLM log in ``workdir``."""
    out: Dict[str, Dict[str, dict]] = {}
    for path in sorted(glob.glob(os.path.join(workdir, "vllm-*.log"))):
        with open(path, errors="replace") as fh:
            for rec in parse_phases(fh):
                out.setdefault(rec.get("key", ""), {})[rec.get("side", "")] = rec
    return out


def request_phases(r: dict, recs: Dict[str, dict], link_bps: Optional[float]) -> Dict[str, float]:
    """One request's phases (those its records allow)."""
    out: Dict[str, float] = {}
    if not r.get("ok") or r.get("prefill_s") is None:
        return out
    answered = r["t_start"] + r["prefill_s"]
    out["prefill"] = r["prefill_s"]
    send, load = recs.get("send"), recs.get("load")
    if send and send.get("t_done") and send.get("t_open"):
        out["send"] = send["t_done"] - send["t_open"]
        out["kv_tail"] = max(0.0, send["t_done"] - answered)
        out["append"] = send.get("append_s", 0.0)
        if link_bps:
            out["link"] = send.get("bytes", 0) * 8 / link_bps
            out["queued"] = max(0.0, out["send"] - out["link"])
    if load and load.get("t_end"):
        out["load"] = load["t_end"] - load["t_start"]
        out["to_load"] = load["t_start"] - answered
        out["after_load"] = r["t_start"] + r["ttft_s"] - load["t_end"]
    return out


def attach(result: dict, workdir: str, link_bps: Optional[float]) -> None:
    """Add ``phases`` to every request of ``result`` and ``phases`` (p50/p99 per class) to every mode."""
    recs = read_records(workdir)
    for m in result.get("modes", {}).values():
        per_cls: Dict[str, Dict[str, List[float]]] = {}
        for r in m["requests"]:
            r["phases"] = request_phases(r, recs.get(r.get("key") or "", {}), link_bps)
            for name, v in r["phases"].items():
                per_cls.setdefault(r["cls"], {}).setdefault(name, []).append(v)
        m["phases"] = {cls: {name: {"p50_ms": _ms(pct(v, 0.5)), "p99_ms": _ms(pct(v, 0.99)), "n": len(v)}
                             for name, v in ph.items()} for cls, ph in per_cls.items()}


def table(result: dict) -> str:
    rows = ["| mode | class | " + " | ".join(f"{p} p50/p99 ms" for p in PHASES) + " |",
            "| --- | --- | " + " | ".join("---" for _ in PHASES) + " |"]
    for mode, m in result.get("modes", {}).items():
        for cls, ph in sorted(m.get("phases", {}).items()):
            cells = [f"{ph[p]['p50_ms']}/{ph[p]['p99_ms']}" if p in ph else "-" for p in PHASES]
            rows.append(f"| {mode} | {cls} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _ms(v):
    return None if v is None else round(v * 1e3, 1)
