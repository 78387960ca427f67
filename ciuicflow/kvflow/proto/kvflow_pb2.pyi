from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Priority(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIORITY_UNSPECIFIED: _ClassVar[Priority]
    HIGH: _ClassVar[Priority]
    NORMAL: _ClassVar[Priority]
    LOW: _ClassVar[Priority]

class AckCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ACK_OK: _ClassVar[AckCode]
    ACK_CORRUPT: _ClassVar[AckCode]
    ACK_OUT_OF_ORDER: _ClassVar[AckCode]
    ACK_BUSY: _ClassVar[AckCode]
    ACK_FAILED: _ClassVar[AckCode]

class Holding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOLDING_UNKNOWN: _ClassVar[Holding]
    HOLDING_HELD: _ClassVar[Holding]
    HOLDING_COLLECTED: _ClassVar[Holding]
    HOLDING_EXPIRED: _ClassVar[Holding]
    HOLDING_GONE: _ClassVar[Holding]
PRIORITY_UNSPECIFIED: Priority
HIGH: Priority
NORMAL: Priority
LOW: Priority
ACK_OK: AckCode
ACK_CORRUPT: AckCode
ACK_OUT_OF_ORDER: AckCode
ACK_BUSY: AckCode
ACK_FAILED: AckCode
HOLDING_UNKNOWN: Holding
HOLDING_HELD: Holding
HOLDING_COLLECTED: Holding
HOLDING_EXPIRED: Holding
HOLDING_GONE: Holding

class PartInfo(_message.Message):
    __slots__ = ("index", "nbytes", "name", "dtype", "shape", "is_tensor")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    IS_TENSOR_FIELD_NUMBER: _ClassVar[int]
    index: int
    nbytes: int
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    is_tensor: bool
    def __init__(self, index: _Optional[int] = ..., nbytes: _Optional[int] = ..., name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., is_tensor: _Optional[bool] = ...) -> None: ...

class AcknowledgeRequest(_message.Message):
    __slots__ = ("key", "source")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    key: str
    source: str
    def __init__(self, key: _Optional[str] = ..., source: _Optional[str] = ...) -> None: ...

class AcknowledgeReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ShmRef(_message.Message):
    __slots__ = ("path", "offset", "length", "ring_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    offset: int
    length: int
    ring_bytes: int
    def __init__(self, path: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., ring_bytes: _Optional[int] = ...) -> None: ...

class ShmProbeRequest(_message.Message):
    __slots__ = ("path", "nonce")
    PATH_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    path: str
    nonce: bytes
    def __init__(self, path: _Optional[str] = ..., nonce: _Optional[bytes] = ...) -> None: ...

class ShmProbeReply(_message.Message):
    __slots__ = ("ok", "message")
    OK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    message: str
    def __init__(self, ok: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class SendHeader(_message.Message):
    __slots__ = ("dest", "key", "priority", "deadline_s", "payload_kind", "resume", "lease_s", "idempotency_key")
    DEST_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KIND_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    IDEMPOTENCY_KEY_FIELD_NUMBER: _ClassVar[int]
    dest: str
    key: str
    priority: Priority
    deadline_s: float
    payload_kind: str
    resume: bool
    lease_s: float
    idempotency_key: str
    def __init__(self, dest: _Optional[str] = ..., key: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., deadline_s: _Optional[float] = ..., payload_kind: _Optional[str] = ..., resume: _Optional[bool] = ..., lease_s: _Optional[float] = ..., idempotency_key: _Optional[str] = ...) -> None: ...

class SendData(_message.Message):
    __slots__ = ("part", "offset", "data", "info", "shm")
    PART_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    part: int
    offset: int
    data: bytes
    info: PartInfo
    shm: ShmRef
    def __init__(self, part: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., info: _Optional[_Union[PartInfo, _Mapping]] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ...) -> None: ...

class SendEnd(_message.Message):
    __slots__ = ("num_parts",)
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    num_parts: int
    def __init__(self, num_parts: _Optional[int] = ...) -> None: ...

class SendBatch(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[SendData]
    def __init__(self, data: _Optional[_Iterable[_Union[SendData, _Mapping]]] = ...) -> None: ...

class SendRequest(_message.Message):
    __slots__ = ("header", "data", "end", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    END_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: SendHeader
    data: SendData
    end: SendEnd
    batch: SendBatch
    def __init__(self, header: _Optional[_Union[SendHeader, _Mapping]] = ..., data: _Optional[_Union[SendData, _Mapping]] = ..., end: _Optional[_Union[SendEnd, _Mapping]] = ..., batch: _Optional[_Union[SendBatch, _Mapping]] = ...) -> None: ...

class SendReply(_message.Message):
    __slots__ = ("key", "bytes", "chunks", "retransmits", "resumed_chunks", "seconds", "flow")
    KEY_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    RETRANSMITS_FIELD_NUMBER: _ClassVar[int]
    RESUMED_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    FLOW_FIELD_NUMBER: _ClassVar[int]
    key: str
    bytes: int
    chunks: int
    retransmits: int
    resumed_chunks: int
    seconds: float
    flow: bool
    def __init__(self, key: _Optional[str] = ..., bytes: _Optional[int] = ..., chunks: _Optional[int] = ..., retransmits: _Optional[int] = ..., resumed_chunks: _Optional[int] = ..., seconds: _Optional[float] = ..., flow: _Optional[bool] = ...) -> None: ...

class RecvRequest(_message.Message):
    __slots__ = ("key", "timeout_s", "shm_path", "shm_ring_bytes", "source", "manual_ack")
    KEY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    SHM_PATH_FIELD_NUMBER: _ClassVar[int]
    SHM_RING_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    MANUAL_ACK_FIELD_NUMBER: _ClassVar[int]
    key: str
    timeout_s: float
    shm_path: str
    shm_ring_bytes: int
    source: str
    manual_ack: bool
    def __init__(self, key: _Optional[str] = ..., timeout_s: _Optional[float] = ..., shm_path: _Optional[str] = ..., shm_ring_bytes: _Optional[int] = ..., source: _Optional[str] = ..., manual_ack: _Optional[bool] = ...) -> None: ...

class RecvHeader(_message.Message):
    __slots__ = ("key", "source", "payload_kind", "priority")
    KEY_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KIND_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    key: str
    source: str
    payload_kind: str
    priority: Priority
    def __init__(self, key: _Optional[str] = ..., source: _Optional[str] = ..., payload_kind: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ...) -> None: ...

class RecvData(_message.Message):
    __slots__ = ("part", "offset", "data", "info", "shm")
    PART_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    SHM_FIELD_NUMBER: _ClassVar[int]
    part: int
    offset: int
    data: bytes
    info: PartInfo
    shm: ShmRef
    def __init__(self, part: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., info: _Optional[_Union[PartInfo, _Mapping]] = ..., shm: _Optional[_Union[ShmRef, _Mapping]] = ...) -> None: ...

class RecvBatch(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: _containers.RepeatedCompositeFieldContainer[RecvData]
    def __init__(self, data: _Optional[_Iterable[_Union[RecvData, _Mapping]]] = ...) -> None: ...

class RecvReply(_message.Message):
    __slots__ = ("header", "data", "batch")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    header: RecvHeader
    data: RecvData
    batch: RecvBatch
    def __init__(self, header: _Optional[_Union[RecvHeader, _Mapping]] = ..., data: _Optional[_Union[RecvData, _Mapping]] = ..., batch: _Optional[_Union[RecvBatch, _Mapping]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StatsReply(_message.Message):
    __slots__ = ("json",)
    JSON_FIELD_NUMBER: _ClassVar[int]
    json: str
    def __init__(self, json: _Optional[str] = ...) -> None: ...

class IdentifyRequest(_message.Message):
    __slots__ = ("nonce", "caller")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    CALLER_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    caller: str
    def __init__(self, nonce: _Optional[bytes] = ..., caller: _Optional[str] = ...) -> None: ...

class IdentifyReply(_message.Message):
    __slots__ = ("name", "address", "proof")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PROOF_FIELD_NUMBER: _ClassVar[int]
    name: str
    address: str
    proof: bytes
    def __init__(self, name: _Optional[str] = ..., address: _Optional[str] = ..., proof: _Optional[bytes] = ...) -> None: ...

class DataPlaneRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataPlaneReply(_message.Message):
    __slots__ = ("port", "ticket")
    PORT_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    port: int
    ticket: bytes
    def __init__(self, port: _Optional[int] = ..., ticket: _Optional[bytes] = ...) -> None: ...

class TransferOpen(_message.Message):
    __slots__ = ("tid", "key", "priority", "deadline_s", "payload_kind", "uuid", "resume", "lease_s")
    TID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_KIND_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    tid: int
    key: str
    priority: Priority
    deadline_s: float
    payload_kind: str
    uuid: str
    resume: bool
    lease_s: float
    def __init__(self, tid: _Optional[int] = ..., key: _Optional[str] = ..., priority: _Optional[_Union[Priority, str]] = ..., deadline_s: _Optional[float] = ..., payload_kind: _Optional[str] = ..., uuid: _Optional[str] = ..., resume: _Optional[bool] = ..., lease_s: _Optional[float] = ...) -> None: ...

class Chunk(_message.Message):
    __slots__ = ("tid", "seq", "sn", "part", "offset", "data", "crc32c", "info", "more")
    TID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SN_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    CRC32C_FIELD_NUMBER: _ClassVar[int]
    INFO_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    tid: int
    seq: int
    sn: int
    part: int
    offset: int
    data: bytes
    crc32c: int
    info: PartInfo
    more: _containers.RepeatedCompositeFieldContainer[PartInfo]
    def __init__(self, tid: _Optional[int] = ..., seq: _Optional[int] = ..., sn: _Optional[int] = ..., part: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ..., crc32c: _Optional[int] = ..., info: _Optional[_Union[PartInfo, _Mapping]] = ..., more: _Optional[_Iterable[_Union[PartInfo, _Mapping]]] = ...) -> None: ...

class Commit(_message.Message):
    __slots__ = ("tid", "total_chunks", "num_parts")
    TID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    NUM_PARTS_FIELD_NUMBER: _ClassVar[int]
    tid: int
    total_chunks: int
    num_parts: int
    def __init__(self, tid: _Optional[int] = ..., total_chunks: _Optional[int] = ..., num_parts: _Optional[int] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("tid", "code", "message")
    TID_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    tid: int
    code: int
    message: str
    def __init__(self, tid: _Optional[int] = ..., code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Query(_message.Message):
    __slots__ = ("items",)
    ITEMS_FIELD_NUMBER: _ClassVar[int]
    items: _containers.RepeatedCompositeFieldContainer[QueryItem]
    def __init__(self, items: _Optional[_Iterable[_Union[QueryItem, _Mapping]]] = ...) -> None: ...

class QueryItem(_message.Message):
    __slots__ = ("tid", "key", "uuid")
    TID_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    tid: int
    key: str
    uuid: str
    def __init__(self, tid: _Optional[int] = ..., key: _Optional[str] = ..., uuid: _Optional[str] = ...) -> None: ...

class PeerFrame(_message.Message):
    __slots__ = ("open", "chunk", "commit", "abort", "query")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    open: TransferOpen
    chunk: Chunk
    commit: Commit
    abort: Abort
    query: Query
    def __init__(self, open: _Optional[_Union[TransferOpen, _Mapping]] = ..., chunk: _Optional[_Union[Chunk, _Mapping]] = ..., commit: _Optional[_Union[Commit, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., query: _Optional[_Union[Query, _Mapping]] = ...) -> None: ...

class TransferState(_message.Message):
    __slots__ = ("tid", "held_chunks", "held_crc32c", "complete", "error_code", "error", "durable", "queries")
    TID_FIELD_NUMBER: _ClassVar[int]
    HELD_CHUNKS_FIELD_NUMBER: _ClassVar[int]
    HELD_CRC32C_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    tid: int
    held_chunks: int
    held_crc32c: _containers.RepeatedScalarFieldContainer[int]
    complete: bool
    error_code: int
    error: str
    durable: bool
    queries: bool
    def __init__(self, tid: _Optional[int] = ..., held_chunks: _Optional[int] = ..., held_crc32c: _Optional[_Iterable[int]] = ..., complete: _Optional[bool] = ..., error_code: _Optional[int] = ..., error: _Optional[str] = ..., durable: _Optional[bool] = ..., queries: _Optional[bool] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("tid", "seq", "sn", "code", "error_code", "message")
    TID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SN_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    tid: int
    seq: int
    sn: int
    code: AckCode
    error_code: int
    message: str
    def __init__(self, tid: _Optional[int] = ..., seq: _Optional[int] = ..., sn: _Optional[int] = ..., code: _Optional[_Union[AckCode, str]] = ..., error_code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class CommitAck(_message.Message):
    __slots__ = ("tid", "error_code", "message", "lease_s", "durable", "queries")
    TID_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LEASE_S_FIELD_NUMBER: _ClassVar[int]
    DURABLE_FIELD_NUMBER: _ClassVar[int]
    QUERIES_FIELD_NUMBER: _ClassVar[int]
    tid: int
    error_code: int
    message: str
    lease_s: float
    durable: bool
    queries: bool
    def __init__(self, tid: _Optional[int] = ..., error_code: _Optional[int] = ..., message: _Optional[str] = ..., lease_s: _Optional[float] = ..., durable: _Optional[bool] = ..., queries: _Optional[bool] = ...) -> None: ...

class QueryReply(_message.Message):
    __slots__ = ("tid", "holding")
    TID_FIELD_NUMBER: _ClassVar[int]
    HOLDING_FIELD_NUMBER: _ClassVar[int]
    tid: _containers.RepeatedScalarFieldContainer[int]
    holding: _containers.RepeatedScalarFieldContainer[Holding]
    def __init__(self, tid: _Optional[_Iterable[int]] = ..., holding: _Optional[_Iterable[_Union[Holding, str]]] = ...) -> None: ...

class PeerReply(_message.Message):
    __slots__ = ("state", "ack", "commit", "query")
    STATE_FIELD_NUMBER: _ClassVar[int]
    ACK_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    QUERY_FIELD_NUMBER: _ClassVar[int]
    state: TransferState
    ack: Ack
    commit: CommitAck
    query: QueryReply
    def __init__(self, state: _Optional[_Union[TransferState, _Mapping]] = ..., ack: _Optional[_Union[Ack, _Mapping]] = ..., commit: _Optional[_Union[CommitAck, _Mapping]] = ..., query: _Optional[_Union[QueryReply, _Mapping]] = ...) -> None: ...
