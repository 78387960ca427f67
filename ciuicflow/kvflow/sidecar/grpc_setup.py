"""The sidecar's gRPC plumbing: channel and server options, TLS credentials, and servers whose services are
registered by the generated ``add_*Servicer_to_server`` functions (with health checking and reflection)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import List, Optional, Tuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from ..core.limits import Gate
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


# Reconnect within a second of the other end coming back (gRPC's default backoff grows to 2 minutes).
# Not "grpc.min_reconnect_backoff_ms": gRPC takes it as the time a connection attempt may take, and at
# 100 ms a busy host's handshakes (or TLS over a slow link) were cut off and a first call failed at
# once ("tcp handshaker shutdown"); gRPC's default (20 s) stays. Peers' channels and the vLLM
# connector's channels to its sidecar.
FAST_RECONNECT: List[Tuple[str, int]] = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


def peer_channel(cfg, address: str, server_name: Optional[str] = None) -> grpc.aio.Channel:
    """The channel to a peer's ``--listen`` address: TLS with this sidecar's certificate when configured,
    checking the peer's certificate for ``server_name`` (a discovered peer: its name, since the registry's
    address proves nothing), else ``--tls-server-name``, else the address's host."""
    opts = options(cfg.max_message_bytes) + FAST_RECONNECT
    if cfg.tls_cert:
        if server_name or cfg.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", server_name or cfg.tls_server_name))
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


def _lenient(handler):
    """Health and reflection requests that do not parse are taken as empty ones (answered as such) instead
    of making gRPC log a traceback for every stranger's garbage."""
    parse = handler.request_deserializer
    cls = getattr(parse, "__self__", None)
    if parse is None or cls is None:
        return handler

    def deserialize(data: bytes):
        try:
            return parse(data)
        except Exception:       # noqa: BLE001 - any malformed bytes
            return cls()
    return handler._replace(request_deserializer=deserialize)


async def _idle_limited(requests, idle_s: float):
    """A stream's requests, ending when none comes for ``idle_s`` (a silent client holds nothing for ever)."""
    iterator = requests.__aiter__()
    while True:
        try:
            yield await asyncio.wait_for(iterator.__anext__(), idle_s)
        except (StopAsyncIteration, asyncio.TimeoutError):
            return


def _gated(handler, gate: Gate, what: str, max_s: float):
    """``handler`` with at most ``gate.limit`` calls at once (RESOURCE_EXHAUSTED beyond) and an end: a
    server stream (health Watch) ends after ``max_s``, a bidirectional one (reflection) when its client is
    silent that long. Health and reflection need no token, so strangers must not hold them open without
    limit."""
    if handler.unary_stream is not None:
        behavior = handler.unary_stream

        async def unary_stream(request, context):
            if not gate.enter():
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many {what} streams")
            try:
                await asyncio.wait_for(behavior(request, context), max_s)
            except asyncio.TimeoutError:
                pass
            finally:
                gate.leave()
        return handler._replace(unary_stream=unary_stream)
    if handler.stream_stream is not None:
        behavior = handler.stream_stream

        async def stream_stream(requests, context):
            if not gate.enter():
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"too many {what} streams")
            try:
                async for reply in behavior(_idle_limited(requests, max_s), context):
                    yield reply
            finally:
                gate.leave()
        return handler._replace(stream_stream=stream_stream)
    return handler


class _Wrap(grpc.GenericRpcHandler):
    def __init__(self, inner, wrap):
        self._inner, self._wrap = inner, wrap

    def service(self, handler_call_details):
        handler = self._inner.service(handler_call_details)
        return None if handler is None else self._wrap(handler)


class _Registration:
    """The server as a generated ``add_*Servicer_to_server`` sees it, with every handler it registers passed
    through ``wrap`` (e.g. ``_safe``: request deserializers that answer MALFORMED for bytes that are not
    their message, proto.codec.safe_deserializer, so the servicer replies INVALID_ARGUMENT itself)."""

    def __init__(self, server: grpc.aio.Server, wrap=_safe):
        self._server = server
        self._wrap = wrap

    def add_generic_rpc_handlers(self, handlers) -> None:
        self._server.add_generic_rpc_handlers(tuple(_Wrap(h, self._wrap) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers) -> None:
        self._server.add_registered_method_handlers(service, {name: self._wrap(h) for name, h in handlers.items()})


@dataclass(frozen=True)
class ServerLimits:
    """What one port lets strangers hold: connections, their handshake, idle connections, streams."""
    max_connections: int = 256
    hello_timeout_s: float = 5.0
    idle_timeout_s: float = 300.0
    streams_per_connection: int = 1024
    max_rpcs: Optional[int] = None          # concurrent calls in all (None: no limit beyond the streams)
    watch_streams: int = 16                 # health Watch streams at once
    reflection_streams: int = 8
    reflection_idle_s: float = 30.0

    def options(self) -> List[Tuple[str, int]]:
        return [("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.server_handshake_timeout_ms", int(self.hello_timeout_s * 1000)),
                ("grpc.max_connection_idle_ms", int(self.idle_timeout_s * 1000)),
                ("grpc.max_concurrent_streams", self.streams_per_connection)]


class Servers:
    """The sidecar's gRPC servers, each serving health checking and reflection beside its service."""

    def __init__(self, max_message_bytes: int):
        self.max_message_bytes = max_message_bytes
        self.servers: List[grpc.aio.Server] = []
        self._health: List[Tuple[health.aio.HealthServicer, str]] = []

    def new(self, service_name: str, servicer, add_servicer, extra_options=(),
            limits: ServerLimits = ServerLimits()) -> grpc.aio.Server:
        """A server for ``servicer`` (registered with ``add_servicer``, the generated function)."""
        server = grpc.aio.server(options=options(self.max_message_bytes) + limits.options() + list(extra_options),
                                 maximum_concurrent_rpcs=limits.max_rpcs)
        add_servicer(servicer, _Registration(server))
        hs = health.aio.HealthServicer()
        watch = Gate(limits.watch_streams)
        health_pb2_grpc.add_HealthServicer_to_server(
            hs, _Registration(server, lambda h: _gated(_lenient(h), watch, "health Watch", limits.idle_timeout_s)))
        names = (service_name, health.SERVICE_NAME, reflection.SERVICE_NAME)
        streams = Gate(limits.reflection_streams)
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(names),
            _Registration(server, lambda h: _gated(_lenient(h), streams, "reflection", limits.reflection_idle_s)))
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
