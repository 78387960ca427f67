"""Proof of a name found in the registry, before anything is sent to it.

The static ``--peer`` list is the operator's word; a registry entry is anyone's who can write to etcd. So a
sidecar that finds ``NAME at ADDRESS`` in the registry calls ``Identify`` at ADDRESS first and takes the
entry only if the answer proves NAME with the credential this sidecar already holds for it:

* a pairwise secret (``--peer-secrets-file``): the answer carries HMAC-SHA256(secret, caller's nonce, both
  names, the address the answerer registered). The nonce makes it fresh; the address stops a relay (an
  impostor that forwards the question to the real peer gets a proof for the real peer's address, not
  its own). The question carries no credential, so an impostor learns no secret from it;
* mutual TLS (``--tls-ca``): the channel checks that the answerer's certificate carries NAME (the TLS
  target name is the entry's name, not its host), and the client certificate shows who asks.

With neither (a shared ``--token`` only, or no credential on loopback) names are not bound to anything, as
without discovery (docs/security.md): the answer's name must still match, and the sidecar warns at start.
Peers' senders present their secret only to a peer that passed this.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import Optional

import grpc

from ..core.identity import tokens_equal
from ..proto import kvflow_pb2 as pb

NONCE_BYTES = 16
MAX_NONCE = 64
DOMAIN = b"ciuicflow-kvflow-identify-v1"
IDENTIFY_TIMEOUT_S = 2.0


def proof(secret: str, nonce: bytes, caller: str, name: str, address: str) -> bytes:
    msg = b"\0".join([DOMAIN, nonce, caller.encode(), name.encode(), address.encode()])
    return hmac.new(secret.encode("utf-8", "surrogateescape"), msg, hashlib.sha256).digest()


def answer(request: pb.IdentifyRequest, name: str, address: str, secrets) -> pb.IdentifyReply:
    """The receiving side: prove ``name`` (registered at ``address``) to ``request.caller`` if a secret is
    shared with it. An ill-formed question gets an empty answer (which proves nothing)."""
    if not NONCE_BYTES <= len(request.nonce) <= MAX_NONCE or len(request.caller) > 128:
        return pb.IdentifyReply()
    secret = secrets.get(request.caller)
    mac = proof(secret, request.nonce, request.caller, name, address) if secret else b""
    return pb.IdentifyReply(name=name, address=address, proof=mac)


class Mismatch(Exception):
    """The answer does not prove the entry's name: the entry is ignored (and logged)."""


async def identify(channel: grpc.aio.Channel, me: str, name: str, address: str, secret: Optional[str],
                   tls: bool) -> None:
    """Ask the peer at ``address`` (over ``channel``) to prove ``name``; raises Mismatch when it does not,
    grpc.aio.AioRpcError when it cannot be asked (not up yet, unreachable: the caller retries)."""
    nonce = os.urandom(NONCE_BYTES)
    call = channel.unary_unary("/ciuicflow.kvflow.v1.KVFlowPeer/Identify",
                               request_serializer=pb.IdentifyRequest.SerializeToString,
                               response_deserializer=pb.IdentifyReply.FromString)
    reply = await call(pb.IdentifyRequest(nonce=nonce, caller=me), timeout=IDENTIFY_TIMEOUT_S)
    if reply.name != name:
        raise Mismatch(f"it answers as {reply.name[:128]!r}")
    if secret is not None:
        if reply.address != address:
            raise Mismatch(f"it registered {reply.address[:80]!r}, not this address")
        expected = proof(secret, nonce, me, name, address)
        if not tokens_equal(reply.proof.hex(), expected.hex()):
            raise Mismatch("its proof does not match the secret shared with that name")
    elif not tls:
        return      # names bound to nothing: only the answer's name is checked (warned at start)
