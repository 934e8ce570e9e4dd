"""The point-to-point ring of the shm links (client/data/_shm_ring.py), both sides over one mapping:
bytes in order through wrap-around and restarts, the capacity bound, chunks filled in pieces,
the sender's wake-up flag, the words of payloads read outside the ring, a receiver that refuses
chunk positions a well-behaved sender cannot produce, and the mailbox: one message at a time, the polling
flag's hand-shake (a message is never left unseen), and counters a sender cannot produce."""

from __future__ import annotations

import mmap
import random

import pytest
from aiocoll.client.data._shm import RING_HEADER
from aiocoll.client.data._shm_ring import MAIL_BYTES, NEWS_FRAMES, NEWS_MAIL, RingReader, RingWriter

CAPACITY = 64 * 1024


def _ring() -> tuple[RingWriter, RingReader]:
    mem = mmap.mmap(-1, RING_HEADER + CAPACITY)  # one mapping stands for both processes' views
    return RingWriter(mem), RingReader(mem)


def test_chunks_arrive_in_order_through_wraps_restarts_and_a_full_ring() -> None:
    writer, reader = _ring()
    rng = random.Random(7)
    pending: list[tuple[int, bytes]] = []  # written, not yet read: (end, bytes)
    for i in range(2000):
        n = rng.choice([1, 63, 64, 1000, 4096, 20_000, CAPACITY // 2, CAPACITY])
        data = bytes([i % 251]) * n
        end = writer.write(memoryview(data))
        if end < 0:
            # full: nothing was written, and there really is no room until the reader frees some
            assert pending and not writer.has_room(n)
            while pending:  # the receiver catches up
                done_end, want = pending.pop(0)
                assert bytes(reader.chunk(done_end, len(want))) == want
                reader.release(done_end)
            end = writer.write(memoryview(data))
            assert end >= 0  # an empty ring takes any chunk up to its capacity
        pending.append((end, data))
        if rng.random() < 0.5:  # the receiver sometimes keeps up, sometimes lags
            done_end, want = pending.pop(0)
            assert bytes(reader.chunk(done_end, len(want))) == want
            reader.release(done_end)
        # never more than the capacity outstanding
        assert sum(len(data) for _, data in pending) <= CAPACITY


def test_an_empty_ring_starts_over_at_its_first_bytes() -> None:
    writer, reader = _ring()
    for _ in range(100):  # request-reply: every chunk is read before the next is written
        end = writer.write(memoryview(b"x" * 1000))
        assert (end - 1000) % CAPACITY == 0
        reader.release(end)


def test_a_chunk_filled_in_pieces_is_readable_as_far_as_written_says() -> None:
    """A reserved chunk is counted in ``written`` piece by piece: the receiver may copy each
    piece out as it lands, and the room stays taken until it frees the whole chunk."""
    writer, reader = _ring()
    first = writer.write(memoryview(b"a" * 1000))
    reader.release(first)
    n = CAPACITY // 2
    end = writer.reserve(n)
    start = end - n
    assert end >= 0 and reader.written() == first <= start  # reserved, nothing of it written
    assert not writer.has_room(CAPACITY // 2 + 64)  # the reserved room is taken
    data = bytes(range(256)) * (n // 256)
    for at in range(0, n, 4096):
        writer.fill(end, n, at, memoryview(data[at : at + 4096]))
        assert reader.written() == start + at + 4096
        assert bytes(reader.chunk(end, n)[at : at + 4096]) == data[at : at + 4096]
    assert bytes(reader.chunk(end, n)) == data
    reader.release(end)
    assert writer.write(memoryview(b"b" * CAPACITY)) >= 0  # all freed: an empty ring again


def test_a_sleeping_sender_is_told_to_wake_and_one_that_finds_room_does_not_sleep() -> None:
    writer, reader = _ring()
    end = writer.write(memoryview(bytes(CAPACITY)))
    assert not writer.has_room(1)
    assert writer.sleep_unless_room(1)  # no room: the flag stays set, sleep
    assert reader.release(end)  # the reader sees the flag: wake the sender
    writer.woken()
    end = writer.write(memoryview(bytes(CAPACITY // 2)))
    reader.release(end)
    assert not writer.sleep_unless_room(10)  # room already: the flag is taken back
    assert not reader.release(end)


@pytest.mark.parametrize(
    ("end", "n", "why"),
    [
        (10, 0, "empty"),
        (CAPACITY + 1, CAPACITY + 1, "larger than the ring"),
        (2 * CAPACITY, 10, "further ahead than a skip to the ring's start"),
        (CAPACITY + 10, 20, "crossing the end"),
    ],
)
def test_the_reader_refuses_chunks_no_well_behaved_sender_writes(end: int, n: int, why: str) -> None:
    _, reader = _ring()
    with pytest.raises(ValueError):
        reader.chunk(end, n)


def test_the_reader_refuses_a_chunk_behind_what_it_already_freed() -> None:
    writer, reader = _ring()
    end = writer.write(memoryview(b"abc"))
    reader.release(end)
    with pytest.raises(ValueError):
        reader.chunk(end, 3)  # the same chunk again


def test_a_payload_read_outside_the_ring_is_reported_in_its_header_and_a_withdrawn_one_is_seen() -> None:
    """The words for payloads the receiver reads from the sender's memory: the sender offers a
    key, the receiver reports its read (waking a sender that sleeps for it), and an offer the
    sender let go of is not taken for a live one."""
    writer, reader = _ring()
    writer.offer(1)
    assert reader.still_offered(1) and not writer.was_read(1)
    assert writer.sleep_unless_read(1)  # not read yet: the sender sleeps, its flag up
    assert reader.report_read(1)  # so the receiver must wake it
    writer.woken()
    assert writer.was_read(1) and not writer.sleep_unless_read(1)  # read meanwhile: no sleep
    writer.offer(2)
    assert not writer.was_read(2) and not reader.report_read(2)  # nobody sleeps: no wake-up
    writer.offer(3)
    writer.offer(0)  # the sender closed: whatever was read of 3 is not whole
    assert not reader.still_offered(3)


def _as_is(message: bytes) -> bytes:
    return message


def test_a_message_larger_than_the_mailbox_is_not_mailed() -> None:
    writer, reader = _ring()
    assert writer.mail(0, _as_is, b"x" * (MAIL_BYTES + 1)) is None
    assert not reader.has_mail() and writer.mail_open(0)


def test_the_mailbox_holds_one_message_until_the_receiver_took_it_and_all_frames_are_dispatched() -> None:
    writer, reader = _ring()
    assert writer.mail_open(0) and not reader.has_mail() and reader.mail(bytes) is None
    assert not writer.mail_open(1)  # a frame we wrote is not dispatched yet: not the next message
    reader.dispatched(1)
    assert writer.mail_open(1)
    for i in range(3):
        message = bytes([i + 1]) * (MAIL_BYTES - i)  # up to a full mailbox
        assert writer.mail(1, _as_is, message) is False  # nobody polls: wake it
        assert not writer.mail_open(1)  # one at a time
        assert writer.mail(1, _as_is, b"z") is None  # (and is not written)
        assert reader.has_mail() and not writer.mail_open(1)
        assert reader.mail(bytes) == message  # copied out, and so taken
        assert not reader.has_mail() and writer.mail_open(1) and reader.mail(bytes) is None


def test_a_message_mailed_as_the_receiver_stops_polling_is_seen_by_one_side_or_the_other() -> None:
    writer, reader = _ring()
    reader.start_polling()
    assert writer.mail(0, _as_is, b"x")  # seen polling: no wake-up needed
    assert reader.stop_polling()  # and the receiver's last look finds it
    assert reader.mail(bytes) == b"x"
    assert not reader.stop_polling()  # nothing came: it may sleep
    reader.start_polling()
    assert not reader.stop_polling()
    assert writer.mail(0, _as_is, b"y") is False  # it stopped before: the sender wakes it


@pytest.mark.parametrize(
    ("mailed", "length", "why"),
    [
        (2, 5, "a message skipped"),
        (1, 0, "an empty message"),
        (1, MAIL_BYTES + 1, "larger than the mailbox"),
        (1, -1, "a negative length"),
    ],
)
def test_the_receiver_refuses_mailbox_counters_no_well_behaved_sender_writes(
    mailed: int, length: int, why: str
) -> None:
    writer, reader = _ring()
    ctl = memoryview(writer._mail.obj)[:RING_HEADER].cast("q")  # the sender's memory, as a peer may set it
    ctl[64], ctl[32] = length, mailed
    with pytest.raises(ValueError, match="mailbox message"):
        reader.mail(bytes)


def test_news_says_in_one_look_whether_mail_or_unread_frames_wait() -> None:
    writer, reader = _ring()
    assert reader.news(0) == 0
    writer.wrote(2)
    assert reader.news(0) == NEWS_FRAMES and reader.news(2) == 0
    reader.dispatched(2)
    assert writer.mail(2, _as_is, b"m") is False
    assert reader.news(2) == NEWS_MAIL and reader.news(1) == NEWS_MAIL | NEWS_FRAMES
    assert reader.mail(bytes) == b"m"
    assert reader.news(2) == 0
