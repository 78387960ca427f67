"""Who a peer is: the checks of a peer stream's credentials, pure logic (no gRPC context, no I/O).

A peer names itself in ``x-ciuic-peer``; the name counts only when a credential binds it:

* mutual TLS: the name must be the common name or a subject alternative name of the certificate the
  peer presented (verified by TLS against ``--tls-ca``);
* a per-peer secret (``--peer-secrets-file``): the pairwise secret this sidecar shares with that peer
  name, presented as ``authorization: Bearer SECRET``; once secrets are configured, a name without one is
  refused (unless mutual TLS binds it);
* the shared ``--token`` alone proves only that the peer is one of the token's holders: any of them can
  claim any name (docs/security.md). ``PeerPolicy.binds_names`` says whether names are bound.

Every token and secret is compared in constant time (``tokens_equal``).
"""
from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from typing import Collection, Mapping, Optional, Sequence

import grpc

MAX_PEER_NAME = 128


class AuthError(Exception):
    """A refused peer: the gRPC status and why."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code, self.message = code, message


def tokens_equal(presented: Optional[str], expected: Optional[str]) -> bool:
    """Whether ``presented`` is ``expected``, in time independent of where they differ; never for an empty
    or missing expected token."""
    if not expected or presented is None:
        return False
    return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"),
                               expected.encode("utf-8", "surrogateescape"))


def bearer(value: Optional[str]) -> Optional[str]:
    """The token of an ``authorization: Bearer TOKEN`` value (None: not that form)."""
    if not value or not value.startswith("Bearer "):
        return None
    return value[len("Bearer "):]


def check_peer_name(name: str) -> Optional[str]:
    """Why ``name`` cannot be a peer's name (None: it can): 1..128 printable ASCII characters, no spaces or
    '=' (names are metric labels, log fields and keys of state)."""
    if not name:
        return "empty peer name"
    if len(name) > MAX_PEER_NAME:
        return f"peer name longer than {MAX_PEER_NAME} characters"
    if any(not 0x21 <= ord(ch) <= 0x7E or ch == "=" for ch in name):
        return "peer name with a space, '=' or a character outside printable ASCII"
    return None


def certificate_names(auth_context: Mapping[str, Sequence[bytes]]) -> Optional[list]:
    """The identities of a TLS peer's verified certificate (common name, subject alternative names), from a
    gRPC ``auth_context()``; None when the stream carried no certificate."""
    names = [v.decode("utf-8", "replace") for key in ("x509_common_name", "x509_subject_alternative_name")
             for v in auth_context.get(key, ())]
    return names or None


@dataclass(frozen=True)
class PeerPolicy:
    """How a receiving sidecar authenticates peer streams. ``token``: the shared token (None: none);
    ``peer_secrets``: peer name -> pairwise secret; ``mutual_tls``: peers present certificates (the name
    must be the certificate's); ``known_peers``: names given by ``--peer``."""
    token: Optional[str] = None
    peer_secrets: Mapping[str, str] = field(default_factory=dict)
    mutual_tls: bool = False
    known_peers: Collection[str] = ()
    allow_unknown_peers: bool = False

    @property
    def binds_names(self) -> bool:
        return self.mutual_tls or bool(self.peer_secrets)

    def authenticate(self, name: str, authorization: Optional[str], cert_names: Optional[Sequence[str]]) -> str:
        """The peer's name once its credentials check out; raises AuthError. The credential is checked
        before anything about names is said, so a stranger learns nothing from the answer."""
        presented = bearer(authorization)
        secret = self.peer_secrets.get(name) if name else None
        if secret is not None:
            if not tokens_equal(presented, secret):
                raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                                "peer link needs this peer's secret ('authorization: Bearer SECRET')")
        elif self.peer_secrets and not self.mutual_tls:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "no secret is configured for this peer name")
        elif self.token and not tokens_equal(presented, self.token):
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED,
                            "peer link needs a valid token (metadata 'authorization: Bearer TOKEN')")
        if not name:
            raise AuthError(grpc.StatusCode.INVALID_ARGUMENT, "peer link needs metadata 'x-ciuic-peer'")
        err = check_peer_name(name)
        if err:
            raise AuthError(grpc.StatusCode.INVALID_ARGUMENT, err)
        if self.mutual_tls and (not cert_names or name not in cert_names):
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            f"peer name {name!r} is not an identity of the certificate it presented")
        if name not in self.known_peers and not self.allow_unknown_peers:
            raise AuthError(grpc.StatusCode.PERMISSION_DENIED,
                            f"unknown peer {name!r}: not named by --peer (or use --allow-unknown-peers)")
        return name

    def credential_for(self, dest: str) -> Optional[str]:
        """What this sidecar presents to peer ``dest``: their pairwise secret, else the shared token."""
        return self.peer_secrets.get(dest, self.token)
