"""Sans-IO wire protocol shared by the coordinator and worker-to-worker links.

Imports only aiocoll._errors; never sockets or asyncio. See _framing (frames), _handshake
(authentication) and _coordinator (the coordinator's operations).
"""

from ._framing import (
    CONTROL_READ_SIZE,
    PREFIX,
    Frame,
    FrameDecoder,
    PayloadSink,
    encode_frame,
    encode_header,
    pack_prefix,
)
from ._handshake import (
    HANDSHAKE_MAX_HEADER,
    MAGIC,
    PROTOCOL_VERSION,
    ClientHandshake,
    ServerBusy,
    ServerHandshake,
    token_bytes,
)

__all__ = [
    "HANDSHAKE_MAX_HEADER",
    "MAGIC",
    "CONTROL_READ_SIZE",
    "PREFIX",
    "PROTOCOL_VERSION",
    "ClientHandshake",
    "Frame",
    "FrameDecoder",
    "PayloadSink",
    "ServerBusy",
    "ServerHandshake",
    "encode_frame",
    "encode_header",
    "pack_prefix",
    "token_bytes",
]
