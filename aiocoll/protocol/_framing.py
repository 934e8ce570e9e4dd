"""Sans-IO framing: bytes in, frames out; bytes to send. No sockets, no asyncio, no aiocoll imports
beyond _errors.

A frame is a 12-byte prefix (header length u32, payload length u64, network order), a msgpack
header and a raw payload. The header is a map, or, on a decoder made with ``lists=True`` (the
coordinator conversation, whose store requests and replies are positional: protocol._store), a
map or an array. The decoder announces a frame's header before its payload
arrives, so the caller may hand it the destination buffer (a tensor's memory) and the bulk of the
payload is received straight into it: ``get_buffer`` then returns a slice of that buffer. Small
frames are parsed out of one internal buffer, many per read.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from .._errors import ProtocolError

__all__ = [
    "CONTROL_READ_SIZE",
    "PREFIX",
    "Frame",
    "FrameDecoder",
    "PayloadSink",
    "encode_frame",
    "encode_header",
    "pack_prefix",
]

PREFIX = struct.Struct("!IQ")
# The read buffer of a connection between a client and the coordinator, at either end: thousands
# are open at once, each exchanging small frames, and a fresh buffer of this size costs no page
# faults to make (a larger one is a fresh mapping, zeroed page by page). A larger header grows
# it for a while.
CONTROL_READ_SIZE = 16 * 1024
_PREFIX_SIZE = PREFIX.size
_EMPTY = memoryview(b"")

# What msgpack may build from an untrusted header: no container larger than the header itself
# could describe (unpackb's own default), and no extension types (see _decode_header).
_unpackb = msgpack.unpackb


def encode_header(header: dict[str, Any]) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def pack_prefix(header_len: int, payload_len: int) -> bytes:
    return PREFIX.pack(header_len, payload_len)


def encode_frame(header: dict[str, Any], payload: bytes | bytearray | memoryview = b"") -> list[Any]:
    """Return the pieces of one frame for ``writelines``; the payload is not copied."""
    head = encode_header(header)
    prefix_and_head = PREFIX.pack(len(head), len(payload)) + head
    return [prefix_and_head, payload] if len(payload) else [prefix_and_head]


@dataclass(slots=True)
class Frame:
    """One decoded frame. ``payload`` is the caller's sink when one was given (``in_sink``)."""

    header: dict[str, Any]
    payload: memoryview
    in_sink: bool = False


# Called with (header, payload_length) once a header is decoded; returns a writable memoryview of
# exactly payload_length bytes to receive into, or None to let the decoder allocate.
PayloadSink = Callable[[dict[str, Any], int], "memoryview | None"]


class FrameDecoder:
    """Incremental decoder for a stream of frames.

    Use either ``feed(data)`` (simple) or the buffered pair ``get_buffer`` / ``buffer_updated``
    (matches asyncio.BufferedProtocol, and lets the kernel write payloads into the sink).

    Args:
        max_header: largest header accepted, in bytes (a hard cap: bigger is a ProtocolError).
        max_payload: largest payload accepted, in bytes.
        sink: optional PayloadSink choosing where a payload lands.
        read_size: size of the internal buffer used for prefixes, headers and small payloads.
        lists: accept msgpack arrays as headers too (the coordinator's compact store frames).
    """

    def __init__(
        self,
        *,
        max_header: int = 64 * 1024,
        max_payload: int = 64 * 1024 * 1024,
        sink: PayloadSink | None = None,
        read_size: int = 256 * 1024,
        lists: bool = False,
    ) -> None:
        self.max_header = max_header
        self.lists = lists
        self._kinds = frozenset((dict, list)) if lists else frozenset((dict,))  # a header's types
        self.max_payload = max_payload
        self.sink = sink
        # Start small and grow only for a header that needs it: a connection allowed 16 MiB headers
        # must not hold 16 MiB while it exchanges small frames (thousands of connections do).
        self._read_size = max(read_size, PREFIX.size + 1024)
        self._buf = bytearray(min(self._read_size, PREFIX.size + max_header + 1024))
        self._view = memoryview(self._buf)
        self._start = 0  # first unparsed byte in _buf
        self._end = 0  # one past the last valid byte in _buf
        # Payload phase: a frame whose header is parsed and whose payload is still arriving.
        self._pending_header: dict[str, Any] | None = None
        self._pending_payload: memoryview | None = None
        self._pending_in_sink = False
        self._pending_filled = 0
        self.closed_reason: str | None = None

    # -- buffered interface ----------------------------------------------------------------
    def get_buffer(self, sizehint: int = -1) -> memoryview:
        """Where the next received bytes should be written."""
        if self._pending_payload is not None:
            return self._pending_payload[self._pending_filled :]
        if self._start == self._end:
            self._start = self._end = 0
            if len(self._buf) > self._read_size:  # a large header came and went: shrink back
                self._buf = bytearray(self._read_size)
                self._view = memoryview(self._buf)
            return self._view  # the whole buffer: no new view per read
        elif len(self._buf) - self._end < PREFIX.size + 1024 or self._start > len(self._buf) // 2:
            # Compact: move the unparsed tail to the front so there is room to read.
            tail = self._end - self._start
            self._buf[:tail] = self._buf[self._start : self._end]
            self._start, self._end = 0, tail
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> list[Frame]:
        """Account for ``nbytes`` written into the last ``get_buffer`` result; return finished frames."""
        if self._pending_payload is not None:
            self._pending_filled += nbytes
            frames: list[Frame] = []
            if self._pending_filled == len(self._pending_payload):
                frames.append(self._finish_pending())
            return frames
        self._end += nbytes
        return self._parse()

    def buffer_updated_messages(self, nbytes: int) -> list[tuple[Any, bytes | bytearray]]:
        """``buffer_updated`` for a consumer without a sink (the coordinator): the finished
        frames as (header, payload) pairs, small ones parsed straight out of the buffer with no
        Frame objects (the store's hot path: many small frames per read).

        Raises:
            ProtocolError: as ``buffer_updated``.
        """
        if self._pending_payload is not None:
            return [(f.header, f.payload.obj) for f in self.buffer_updated(nbytes)]  # type: ignore[misc]
        start = self._start
        end = self._end = self._end + nbytes
        buf, view = self._buf, self._view
        if start == 0 and end >= _PREFIX_SIZE:
            pstart = self._lone_frame(buf, end)
            if pstart:
                # One whole frame from the start of the buffer, nothing more: the common read
                # (one request per round trip). Everything is taken: the buffer starts over.
                self._end = 0
                return [
                    (
                        self._decode_header(view[_PREFIX_SIZE:pstart]),
                        bytes(view[pstart:end]) if pstart < end else b"",
                    )
                ]
        unpack = PREFIX.unpack_from
        decode = self._decode_header
        max_header, max_payload = self.max_header, self.max_payload
        messages: list[tuple[Any, bytes | bytearray]] = []
        while end - start >= _PREFIX_SIZE:
            header_len, payload_len = unpack(buf, start)
            if header_len == 0 or header_len > max_header or payload_len > max_payload:
                break  # _parse raises the precise error
            pstart = start + _PREFIX_SIZE + header_len
            pend = pstart + payload_len
            if pend > end:
                break
            messages.append(
                (
                    decode(view[start + _PREFIX_SIZE : pstart]),
                    bytes(view[pstart:pend]) if payload_len else b"",
                )
            )
            start = pend
        self._start = start
        if start < end:
            # A frame that is not whole yet, or one to refuse: the general path. Without a sink
            # its payloads are fresh bytearrays of their own (the memoryview's object).
            messages.extend((f.header, f.payload.obj) for f in self._parse())  # type: ignore[misc]
        return messages

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        """Decode ``data``; convenient where zero-copy receive does not matter."""
        if (
            type(data) is bytes
            and self._start == self._end
            and self._pending_payload is None
            and self.sink is None
        ):
            # Nothing buffered: parse the whole frames straight out of ``data`` (a reply link's
            # common case, one or a few small frames per read) and buffer only what is left.
            frames, used = self._parse_bytes(data)
            if used == len(data):
                return frames
            frames.extend(self._feed_slow(memoryview(data)[used:]))
            return frames
        return self._feed_slow(data)

    def feed_messages(self, data: bytes | bytearray | memoryview) -> list[tuple[dict[str, Any], bytes]]:
        """Decode ``data`` like ``feed``, as (header, payload bytes) pairs: for a consumer that
        keeps each payload as bytes anyway (a request/reply link), without Frame objects and
        with one copy of each payload.

        Raises:
            ProtocolError: as ``feed``.
        """
        if type(data) is bytes and self._start == self._end and self._pending_payload is None:
            end = len(data)
            if end >= _PREFIX_SIZE:
                pstart = self._lone_frame(data, end)
                if pstart and (pstart == end or self.sink is None):
                    # One whole frame, nothing more: the common read of a request/reply link.
                    return [(self._decode_header(data[_PREFIX_SIZE:pstart]), data[pstart:])]
            messages: list[tuple[dict[str, Any], bytes]] = []
            pos = 0
            unpack = PREFIX.unpack_from
            max_header, max_payload = self.max_header, self.max_payload
            # A sink is not consulted here: only frames with no payload are parsed on this path
            # then, and the buffered path below hands the others to it.
            sinkless = self.sink is None
            while end - pos >= _PREFIX_SIZE:
                header_len, payload_len = unpack(data, pos)
                if header_len == 0 or header_len > max_header or payload_len > max_payload:
                    break  # the buffered path raises the precise error
                if payload_len and not sinkless:
                    break
                hstart = pos + _PREFIX_SIZE
                pstart = hstart + header_len
                pend = pstart + payload_len
                if pend > end:
                    break
                messages.append((self._decode_header(data[hstart:pstart]), data[pstart:pend]))
                pos = pend
            if pos == end:
                return messages
            messages.extend((f.header, bytes(f.payload)) for f in self.feed(memoryview(data)[pos:]))
            return messages
        return [(f.header, bytes(f.payload)) for f in self.feed(data)]

    def _parse_bytes(self, data: bytes) -> tuple[list[Frame], int]:
        """Whole frames at the front of ``data``, with the same checks as ``_parse``; returns the
        frames and how many bytes they took (a partial frame is left to the buffered path)."""
        frames: list[Frame] = []
        pos = 0
        end = len(data)
        unpack = PREFIX.unpack_from
        max_header = self.max_header
        while end - pos >= _PREFIX_SIZE:
            header_len, payload_len = unpack(data, pos)
            if header_len == 0 or header_len > max_header or payload_len > self.max_payload:
                break  # the buffered path raises the precise error
            hstart = pos + _PREFIX_SIZE
            pstart = hstart + header_len
            pend = pstart + payload_len
            if pend > end:
                break
            header = self._decode_header(data[hstart:pstart])
            if payload_len:
                payload = memoryview(bytearray(data[pstart:pend]))
            else:
                payload = _EMPTY
            frames.append(Frame(header, payload, False))
            pos = pend
        return frames, pos

    def _feed_slow(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        frames: list[Frame] = []
        mv = memoryview(data).cast("B")
        while len(mv):
            target = self.get_buffer(len(mv))
            n = min(len(target), len(mv))
            target[:n] = mv[:n]
            mv = mv[n:]
            frames.extend(self.buffer_updated(n))
        return frames

    @property
    def payload_remaining(self) -> int:
        """Bytes of the current frame's payload still to arrive (0 outside a payload)."""
        if self._pending_payload is None:
            return 0
        return len(self._pending_payload) - self._pending_filled

    @property
    def mid_frame(self) -> bool:
        """True while a frame is partly received (a close now truncates it)."""
        return self._pending_payload is not None or self._end > self._start

    # -- internals -------------------------------------------------------------------------
    def _finish_pending(self) -> Frame:
        assert self._pending_header is not None and self._pending_payload is not None
        frame = Frame(self._pending_header, self._pending_payload, self._pending_in_sink)
        self._pending_header = None
        self._pending_payload = None
        self._pending_filled = 0
        self._pending_in_sink = False
        return frame

    def _parse(self) -> list[Frame]:
        frames: list[Frame] = []
        buf, view = self._buf, self._view
        start, end = self._start, self._end
        unpack = PREFIX.unpack_from
        while end - start >= _PREFIX_SIZE:
            header_len, payload_len = unpack(buf, start)
            if header_len == 0 or header_len > self.max_header:
                self._start = start
                raise ProtocolError(
                    f"frame header of {header_len} bytes is outside 1..{self.max_header}; "
                    f"closing the connection"
                )
            if payload_len > self.max_payload:
                self._start = start
                raise ProtocolError(
                    f"frame payload of {payload_len} bytes exceeds the limit of {self.max_payload}"
                )
            hstart = start + _PREFIX_SIZE
            pstart = hstart + header_len
            if pstart > end:
                self._start = start
                if pstart > len(buf):
                    self._grow(pstart - start)
                return frames
            self._start = start
            header = self._decode_header(view[hstart:pstart])
            if not payload_len:
                frames.append(Frame(header, _EMPTY, False))
                start = pstart
                continue
            self._start = pstart
            payload, in_sink = self._payload_target(header, payload_len)
            have = end - pstart
            if have >= payload_len:
                start = pstart + payload_len
                payload[:] = view[pstart:start]
                frames.append(Frame(header, payload, in_sink))
                continue
            if have:
                payload[:have] = view[pstart:end]
            self._start = end
            self._pending_header = header
            self._pending_payload = payload
            self._pending_in_sink = in_sink
            self._pending_filled = have
            return frames
        self._start = start
        return frames

    def _grow(self, frame_head: int) -> None:
        """Make room for a prefix plus header of ``frame_head`` bytes (at most max_header)."""
        tail = self._end - self._start
        buf = bytearray(max(frame_head, self._read_size))
        buf[:tail] = self._view[self._start : self._end]
        self._buf, self._view = buf, memoryview(buf)
        self._start, self._end = 0, tail

    def _payload_target(self, header: dict[str, Any], payload_len: int) -> tuple[memoryview, bool]:
        if payload_len == 0:
            return _EMPTY, False
        if self.sink is not None:
            target = self.sink(header, payload_len)
            if target is not None:
                target = target.cast("B") if target.format != "B" or target.ndim != 1 else target
                if len(target) != payload_len or target.readonly:
                    raise ProtocolError(
                        f"payload sink gave {len(target)} writable bytes for a {payload_len}-byte payload",
                        remote=False,
                    )
                return target, True
        return memoryview(bytearray(payload_len)), False

    def _lone_frame(self, data: bytes | bytearray, end: int) -> int:
        """Where the payload starts when ``data[:end]`` (at least a prefix long) holds exactly
        one whole frame whose lengths this decoder accepts; 0 otherwise."""
        header_len, payload_len = PREFIX.unpack_from(data)
        pstart = _PREFIX_SIZE + header_len
        if (
            pstart + payload_len == end
            and 0 < header_len <= self.max_header
            and payload_len <= self.max_payload
        ):
            return pstart
        return 0

    def _decode_header(self, raw: bytes | memoryview) -> Any:
        try:
            # unpackb caps every str, bin, array and map at the input's own length by default
            # (msgpack >= 1.0; test_protocol checks it), so only ext types need refusing here.
            # Spelling the other limits out cost more than the decoding of a small header.
            header = _unpackb(raw, max_ext_len=0, strict_map_key=False)
        except Exception as exc:  # msgpack raises several unrelated types for bad input
            raise ProtocolError(f"undecodable frame header ({type(exc).__name__}: {exc})") from exc
        if type(header) not in self._kinds:
            kinds = "a map or an array" if self.lists else "a map"
            raise ProtocolError(f"frame header must be {kinds}, got {type(header).__name__}")
        return header
