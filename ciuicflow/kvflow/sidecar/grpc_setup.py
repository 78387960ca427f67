"""The sidecar's gRPC plumbing: channel and server options, TLS credentials, and servers whose services are
registered by the generated ``add_*Servicer_to_server`` functions (with health checking and reflection)."""
from __future__ import annotations

import asyncio
from typing import List, Optional, Tuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..proto.codec import safe_deserializer


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()


def options(max_message_bytes: int) -> List[Tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def peer_channel(cfg, address: str) -> grpc.aio.Channel:
    """The channel to a peer's ``--listen`` address: TLS with this sidecar's certificate when configured."""
    opts = options(cfg.max_message_bytes) + [
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.min_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
    ]
    if cfg.tls_cert:
        if cfg.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
        creds = grpc.ssl_channel_credentials(root_certificates=_read(cfg.tls_ca), private_key=_read(cfg.tls_key),
                                             certificate_chain=_read(cfg.tls_cert))
        return grpc.aio.secure_channel(address, creds, options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


def server_credentials(cfg) -> Optional[grpc.ServerCredentials]:
    """TLS for the peer port (mutual with ``--tls-ca``), or None."""
    if not cfg.tls_cert:
        return None
    return grpc.ssl_server_credentials([(_read(cfg.tls_key), _read(cfg.tls_cert))],
                                       root_certificates=_read(cfg.tls_ca), require_client_auth=bool(cfg.tls_ca))


def _safe(handler):
    return handler._replace(request_deserializer=safe_deserializer(handler.request_deserializer))


class _SafeHandler(grpc.GenericRpcHandler):
    def __init__(self, inner):
        self._inner = inner

    def service(self, handler_call_details):
        handler = self._inner.service(handler_call_details)
        return None if handler is None else _safe(handler)


class _SafeRegistration:
    """The server as the generated ``add_*Servicer_to_server`` sees it: every request deserializer it
    registers answers MALFORMED for bytes that are not its message (proto.codec.safe_deserializer), so the
    servicer replies INVALID_ARGUMENT itself."""

    def __init__(self, server: grpc.aio.Server):
        self._server = server

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_SafeHandler(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self._server.add_registered_method_handlers(service, {name: _safe(h) for name, h in handlers.items()})


class Servers:
    """The sidecar's gRPC servers, each serving health checking and reflection beside its service."""

    def __init__(self, max_message_bytes: int):
        self.max_message_bytes = max_message_bytes
        self.servers: List[grpc.aio.Server] = []
        self._health: List[Tuple[health.aio.HealthServicer, str]] = []

    def new(self, service_name: str, servicer, add_servicer, extra_options=()) -> grpc.aio.Server:
        """A server for ``servicer`` (registered with ``add_servicer``, the generated function)."""
        server = grpc.aio.server(options=options(self.max_message_bytes) + list(extra_options))
        add_servicer(servicer, _SafeRegistration(server))
        hs = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        self._health.append((hs, service_name))
        self.servers.append(server)
        return server

    async def start(self) -> None:
        for server in self.servers:
            await server.start()
        for hs, name in self._health:
            await hs.set("", health_pb2.HealthCheckResponse.SERVING)
            await hs.set(name, health_pb2.HealthCheckResponse.SERVING)

    async def not_serving(self) -> None:
        for hs, _ in self._health:
            await hs.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        await asyncio.gather(*(server.stop(grace_s) for server in self.servers))
