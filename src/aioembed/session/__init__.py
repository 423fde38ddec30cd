"""Sessions: the sender and receiver that drive rooms over the control channel and a transport."""

from aioembed.session.assembly import Part
from aioembed.session.handle import Received, ReceiveHandle, TransferStats
from aioembed.session.lease import Lease
from aioembed.session.receiver import EmbeddingReceiver
from aioembed.session.sender import EmbeddingSender
from aioembed.session.source_buffers import RegisteredSources
from aioembed.session.stream import Chunk, LeasedChunk, RoomStream

__all__ = ["Chunk", "EmbeddingReceiver", "EmbeddingSender", "Lease", "LeasedChunk", "Part", "ReceiveHandle", "Received",
           "RegisteredSources", "RoomStream", "TransferStats"]
