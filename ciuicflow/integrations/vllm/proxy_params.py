"""What the routing proxy (proxy.py) accepts from a client and what it passes upstream: the checked
``x-ciuic-*`` headers, the client's JSON body (refused if it carries transfer parameters), the prefill
request, and the decode request's body with the prefill's parameters for this request's own key spliced in.
Clients are untrusted (docs/security.md, The routing proxy). Standard library only.
"""
from __future__ import annotations

import json
import math
import re
from typing import Tuple

from . import config as C

H_PRIORITY, H_DEADLINE, H_FLOW = "x-ciuic-priority", "x-ciuic-deadline-s", "x-ciuic-flow"
FLOWS = ("enabled", "disabled")
MAX_DEADLINE_S = 86400.0            # the sidecars cut longer deadlines to this; the proxy refuses them
CLIENT_FORBIDDEN = "kv_transfer_params"     # set by the proxy only (top level, or in vllm_xargs)


class BadRequest(Exception):
    """A request refused with ``status`` (and ``message`` as its JSON error) before anything went upstream."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def transfer_headers(headers) -> dict:
    """The ``kv_transfer_params`` entries a client may ask for, from its ``x-ciuic-*`` headers, checked:
    ``BadRequest`` (400) for a value out of range, a malformed one, or one given twice."""
    out = {}
    for name in (H_PRIORITY, H_DEADLINE, H_FLOW):
        values = headers.get_all(name) or []
        if len(values) > 1:
            raise BadRequest(400, f"{name} given {len(values)} times")
        if not values:
            continue
        v = values[0].strip()
        if name == H_PRIORITY:
            if v.lower() not in C.PRIORITIES:
                raise BadRequest(400, f"{name} must be one of {', '.join(C.PRIORITIES)}, not {v[:40]!r}")
            out[C.P_PRIORITY] = v.lower()
        elif name == H_FLOW:
            if v.lower() not in FLOWS:
                raise BadRequest(400, f"{name} must be one of {', '.join(FLOWS)}, not {v[:40]!r}")
            out[C.P_FLOW] = v.lower()
        else:
            try:
                seconds = float(v)
            except ValueError:
                seconds = math.nan
            if not (math.isfinite(seconds) and 0 < seconds <= MAX_DEADLINE_S):
                raise BadRequest(400, f"{name} must be a number of seconds > 0 and <= {MAX_DEADLINE_S:g}, "
                                      f"not {v[:40]!r}")
            out[C.P_DEADLINE] = seconds
    return out


_JSON = json.JSONDecoder()
_JSON_SPACE = re.compile(r"[ \t\n\r]*")        # JSON's whitespace, as json.loads skips it


def client_body(raw) -> Tuple[dict, int]:
    """The client's JSON object and the offset of its closing brace in ``raw``; refused (``BadRequest``)
    if it is not one, or if it carries transfer parameters anywhere vLLM would read them from (top-level
    ``kv_transfer_params``; ``vllm_xargs``, which vLLM makes the request's ``extra_args``, where it also
    looks for ``kv_transfer_params``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest(400, "body is not UTF-8") from None
    try:            # json.loads, keeping where the object ends
        body, end = _JSON.raw_decode(text, _JSON_SPACE.match(text).end())
        if _JSON_SPACE.match(text, end).end() != len(text):
            raise ValueError("extra data after the JSON value")
    except (ValueError, RecursionError):
        raise BadRequest(400, "body is not JSON") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "body must be a JSON object")
    if CLIENT_FORBIDDEN in body:
        raise BadRequest(400, f"{CLIENT_FORBIDDEN} are set by the proxy, not by clients")
    xargs = body.get("vllm_xargs")
    if isinstance(xargs, dict) and CLIENT_FORBIDDEN in xargs:
        raise BadRequest(400, f"vllm_xargs.{CLIENT_FORBIDDEN} are set by the proxy, not by clients")
    return body, len(raw) - (len(text) - end) - 1      # what follows the object is ASCII whitespace


def json_bytes(obj) -> bytes:
    """Compact UTF-8 JSON. ``RecursionError`` for an object nested close to the recursion limit: one that
    json.loads took may be too deep for json.dumps, called from a deeper frame."""
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except UnicodeEncodeError:      # a lone surrogate (from a \\ud800 escape): keep it escaped
        return json.dumps(obj, separators=(",", ":")).encode("ascii")


def prefill_request(body: dict, asked: dict, peer: str, key: str) -> dict:
    """The prefill instance's request: the client's, one token, with the proxy's transfer parameters
    (``asked``: from the client's checked headers, ``transfer_headers``)."""
    pre = dict(body)
    pre.pop("stream_options", None)
    pre.update(stream=False, max_tokens=1)
    if "max_completion_tokens" in pre:
        pre["max_completion_tokens"] = 1
    pre.pop("min_tokens", None)
    pre["kv_transfer_params"] = {C.P_DECODE: True, C.P_PREFILL: False, C.P_KEY: key, C.P_DEST: peer, **asked}
    return pre


def prefill_params(answer: bytes, key: str) -> bytes:
    """The ``kv_transfer_params`` of a prefill answer, as JSON, only if they are for this request's own
    key (``ValueError`` or ``RecursionError`` otherwise: the prefill counts as failed)."""
    data = json.loads(answer)
    params = data.get("kv_transfer_params") if isinstance(data, dict) else None
    if not isinstance(params, dict):
        raise ValueError("the prefill answer has no kv_transfer_params")
    if params.get(C.P_KEY) != key or params.get(C.P_PREFILL) is not True:
        raise ValueError(f"the prefill answer's kv_transfer_params are not this request's ({key}): "
                         f"{C.P_KEY}={str(params.get(C.P_KEY))[:80]!r}")
    return json_bytes(params)


def with_transfer_params(raw, brace: int, empty: bool, params_json: bytes) -> bytes:
    """The client's body (checked by ``client_body``: a JSON object without transfer parameters, its
    closing brace at ``brace``; ``empty``: it has no members) with ``kv_transfer_params`` (``params_json``,
    from ``prefill_params``) added as its last member, spliced in rather than re-serialized."""
    if raw[brace:brace + 1] != b"}":
        raise ValueError("not the end of a JSON object")
    return b"".join((memoryview(raw)[:brace], b"" if empty else b",", b'"kv_transfer_params":', params_json,
                     memoryview(raw)[brace:]))
