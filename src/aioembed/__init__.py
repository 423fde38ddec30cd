"""aioembed: move multimodal embeddings from encoder to language-model processes, asynchronously."""

from aioembed.config import TransferConfig
from aioembed.errors import (
    AioembedError,
    AllocationTimeout,
    AllocatorError,
    ConfigError,
    IncompatiblePeer,
    InvalidRequest,
    LayoutError,
    PeerDead,
    PlanError,
    ProtocolError,
    TransferAborted,
    TransferError,
    TransferFailed,
    TransferTimeout,
    TransportError,
)
from aioembed.layout import Field, Layout
from aioembed.memory import AllocatorStats, BlockAllocator, BlockPool
from aioembed.protocol.room import TransferStatus
from aioembed.session import (
    Chunk,
    EmbeddingReceiver,
    EmbeddingSender,
    Lease,
    LeasedChunk,
    Part,
    Received,
    ReceiveHandle,
    RegisteredSources,
    RoomStream,
    TransferStats,
)

__version__ = "0.1.0"

__all__ = [
    "Chunk",
    "Lease",
    "LeasedChunk",
    "Part",
    "RoomStream",
    "TransferStatus",
    "TransferStats",
    "Received",
    "ReceiveHandle",
    "RegisteredSources",
    "EmbeddingSender",
    "EmbeddingReceiver",
    "AioembedError",
    "AllocationTimeout",
    "AllocatorError",
    "AllocatorStats",
    "BlockAllocator",
    "BlockPool",
    "ConfigError",
    "Field",
    "IncompatiblePeer",
    "InvalidRequest",
    "Layout",
    "LayoutError",
    "PeerDead",
    "PlanError",
    "ProtocolError",
    "TransferAborted",
    "TransferConfig",
    "TransferError",
    "TransferFailed",
    "TransferTimeout",
    "TransportError",
    "__version__",
]
