"""The matcher alone, without sockets or an event loop: events in, outcomes out (aiocoll/_matching.py)."""

from __future__ import annotations

from typing import Any

import pytest

from aiocoll._errors import DistError, MismatchError, PeerLostError
from aiocoll._matching import LARGE_PAYLOAD, Matcher

META = {"op": "test"}


class Outcome:
    """A Completion that records what it was given."""

    def __init__(self, on_done: Any = None) -> None:
        self.result: Any = None
        self.exc: BaseException | None = None
        self.cancelled = False
        self.calls = 0
        self._on_done = on_done

    def done(self) -> bool:
        return self.calls > 0

    def set_result(self, result: Any) -> None:
        self.calls += 1
        self.result = result
        if self._on_done:
            self._on_done()

    def set_exception(self, exception: BaseException) -> None:
        self.calls += 1
        self.exc = exception
        if self._on_done:
            self._on_done()

    def cancel(self) -> bool:
        self.calls += 1
        self.cancelled = True
        return True


class Flow:
    def __init__(self) -> None:
        self.reading = True
        self.switches: list[str] = []

    def pause_reading(self) -> None:
        self.reading = False
        self.switches.append("pause")

    def resume_reading(self) -> None:
        self.reading = True
        self.switches.append("resume")


def matcher(world: int = 3, **bounds: int) -> tuple[Matcher, dict[int, Flow]]:
    m = Matcher(0, world, **bounds)
    flows = {peer: Flow() for peer in range(1, world)}
    for peer, flow in flows.items():
        m.attach(peer, flow)
    return m, flows


def buf(n: int) -> memoryview:
    return memoryview(bytearray(n))


def test_a_posted_receive_gets_the_payload_copied_and_the_senders_meta() -> None:
    m, _ = matcher()
    into, done = buf(3), Outcome()
    m.post(1, ("t",), into, done)
    m.arrived(1, ("t",), META, memoryview(b"abc"))
    assert done.result == (1, META) and bytes(into) == b"abc"


def test_an_early_message_waits_and_same_source_and_tag_keep_send_order() -> None:
    m, _ = matcher()
    for i in range(3):
        m.arrived(1, ("t",), {"i": i}, memoryview(bytes([i])))
    into = buf(1)
    assert [m.take(1, ("t",), into) and into[0] for _ in range(3)] == [0, 1, 2]
    assert m.take(1, ("t",), into) is None


def test_receives_match_in_posting_order_whether_specific_or_from_any_source() -> None:
    m, _ = matcher()
    anyone, specific = Outcome(), Outcome()
    m.post(None, ("t",), buf(1), anyone)
    m.post(2, ("t",), buf(1), specific)
    m.arrived(2, ("t",), META, memoryview(b"x"))  # the any-source receive was posted first
    assert anyone.result == (2, META) and not specific.done()
    m.arrived(2, ("t",), META, memoryview(b"y"))
    assert specific.result == (2, META)


def test_claim_lands_payloads_in_place_in_stream_order_and_binds_a_mismatched_receive() -> None:
    m, _ = matcher()
    first, second, third = Outcome(), Outcome(), Outcome()
    a, b = buf(4), buf(4)
    m.post(1, ("t",), a, first)
    m.post(1, ("t",), b, second)
    m.post(1, ("u",), buf(8), third)
    # one read decodes three headers before any frame is reported
    assert m.claim(1, ("t",), 4) is a
    assert m.claim(1, ("t",), 4) is b
    wrong = m.claim(1, ("u",), 5)
    assert wrong is not None and len(wrong) == 5
    a[:] = b"1111"
    b[:] = b"2222"
    m.landed(1, ("t",), {"n": 1}, a)
    m.landed(1, ("t",), {"n": 2}, b)
    m.landed(1, ("u",), {"n": 3}, wrong)
    assert (first.result, second.result) == ((1, {"n": 1}), (1, {"n": 2}))
    assert isinstance(third.exc, MismatchError) and third.exc.remote_meta == {"n": 3}  # type: ignore[attr-defined]
    assert m.received_direct == 2


def test_claim_lands_a_large_early_payload_in_landing_memory_and_leaves_small_ones_to_the_link() -> None:
    m, _ = matcher()
    assert m.claim(1, ("small",), 10) is None
    big = m.claim(1, ("big",), LARGE_PAYLOAD)
    assert big is not None and len(big) == LARGE_PAYLOAD
    big[:3] = b"abc"
    m.landed(1, ("big",), META, big)
    early = m.take_early(1, ("big",), LARGE_PAYLOAD)
    assert early is not None and early.payload is big  # the receive reads it where it landed


def test_a_wrong_sized_early_message_raises_mismatch_with_the_senders_meta_and_is_consumed() -> None:
    m, _ = matcher()
    m.arrived(1, ("t",), {"count": 8}, memoryview(b"12345678"))
    m.arrived(1, ("t",), META, memoryview(b"abcd"))
    with pytest.raises(MismatchError) as info:
        m.take(1, ("t",), buf(4))
    assert info.value.remote_meta == {"count": 8}  # type: ignore[attr-defined]
    into = buf(4)
    assert m.take(1, ("t",), into) == (1, META) and bytes(into) == b"abcd"


def test_a_full_inbox_pauses_its_sources_link_and_a_receive_below_the_bound_resumes_it() -> None:
    m, flows = matcher(inbox_messages=2, inbox_bytes=100)
    m.arrived(1, ("a",), META, memoryview(b"x"))
    assert flows[1].reading
    m.arrived(1, ("b",), META, memoryview(b"x"))
    assert not flows[1].reading and flows[2].reading  # per source
    m.take(1, ("a",), buf(1))
    assert flows[1].reading
    m.arrived(2, ("c",), META, memoryview(b"y" * 100))  # the byte bound
    assert not flows[2].reading
    m.discard(("c",))
    assert flows[2].reading
    assert m.buffered(1) == 1 and m.buffered(2) == 0


def test_discard_cancels_posted_receives_drops_buffered_and_late_messages() -> None:
    m, flows = matcher(inbox_messages=1)
    waiting = Outcome()
    m.post(1, ("c", "g", 1, 0), buf(1), waiting)
    m.arrived(1, ("c", "g", 1, 1), META, memoryview(b"x"))
    assert not flows[1].reading
    m.discard(("c", "g", 1))
    assert waiting.cancelled and flows[1].reading
    m.arrived(1, ("c", "g", 1, 2), META, memoryview(b"late"))
    assert m.take(1, ("c", "g", 1, 2), buf(4)) is None and m.buffered(1) == 0


def test_retired_prefixes_report_buffered_and_late_messages_as_strays() -> None:
    m, _ = matcher()
    strays: list[tuple[int, Any, Any]] = []
    m.on_stray(lambda src, tag, meta: strays.append((src, tag, meta)))
    m.arrived(2, ("c", "g", 4, 0), {"k": "early"}, memoryview(b"x"))
    m.retire(("c", "g", 4))
    m.arrived(1, ("c", "g", 4, 1), {"k": "late"}, memoryview(b"y"))
    m.discard(("c", "g", 5))
    m.arrived(1, ("c", "g", 5, 0), {"k": "dropped"}, memoryview(b"z"))
    assert strays == [(2, ("c", "g", 4, 0), {"k": "early"}), (1, ("c", "g", 4, 1), {"k": "late"})]


def test_finished_prefixes_are_remembered_up_to_a_bound() -> None:
    m = Matcher(0, 2, discard_memory=2)
    for seq in range(3):
        m.discard(("c", "g", seq))
    m.arrived(1, ("c", "g", 0, 0), META, memoryview(b"x"))  # forgotten: buffered again
    m.arrived(1, ("c", "g", 2, 0), META, memoryview(b"x"))  # remembered: dropped
    assert m.buffered(1) == 1


def test_loss_of_a_peer_fails_its_receives_and_keeps_what_it_delivered() -> None:
    m, _ = matcher()
    bound, claimed, other = Outcome(), Outcome(), Outcome()
    m.post(1, ("t",), buf(1), bound)
    m.post(1, ("u",), buf(100), claimed)
    assert m.claim(1, ("u",), 100) is not None  # mid-frame when the link broke
    m.post(2, ("t",), buf(1), other)
    m.arrived(1, ("kept",), META, memoryview(b"k"))
    assert m.peer_lost(1, "cut") and not m.peer_lost(1, "again")
    assert isinstance(bound.exc, PeerLostError) and bound.exc.rank == 1
    assert isinstance(claimed.exc, PeerLostError)
    assert not other.done()
    assert m.take(1, ("kept",), buf(1)) == (1, META)
    with pytest.raises(PeerLostError):
        m.post(1, ("t",), buf(1), Outcome())


def test_a_receive_from_any_source_waits_while_a_live_source_is_left_and_fails_when_none_is() -> None:
    m, _ = matcher(world=3)
    anyone = Outcome()
    m.post(None, ("t",), buf(1), anyone)
    m.peer_lost(2, "gone")
    assert not anyone.done()
    m.arrived(1, ("t",), META, memoryview(b"x"))
    assert anyone.result == (1, META)
    anyone = Outcome()
    m.post(None, ("t",), buf(1), anyone)
    m.peer_lost(1, "gone too")
    assert isinstance(anyone.exc, PeerLostError)
    with pytest.raises(PeerLostError):
        m.post(None, ("t",), buf(1), Outcome())


def test_a_completion_may_discard_other_prefixes_while_a_loss_fails_receives() -> None:
    m, _ = matcher()
    second = Outcome()
    first = Outcome(on_done=lambda: m.discard(("c", "g", 2)))
    m.post(1, ("c", "g", 1, 0), buf(1), first)
    m.post(1, ("c", "g", 2, 0), buf(1), second)
    m.peer_lost(1, "cut")
    assert isinstance(first.exc, PeerLostError)
    assert second.calls == 1  # failed or cancelled, exactly once


def test_unposting_withdraws_a_receive_so_the_message_waits_for_the_next() -> None:
    m, _ = matcher()
    withdrawn = m.post(1, ("t",), buf(1), Outcome())
    m.unpost(withdrawn)
    m.unpost(withdrawn)  # twice is fine
    m.arrived(1, ("t",), META, memoryview(b"x"))
    assert m.take(1, ("t",), buf(1)) == (1, META)


def test_close_fails_every_receive_and_refuses_new_ones() -> None:
    m, _ = matcher()
    posted, anyone = Outcome(), Outcome()
    m.post(1, ("t",), buf(1), posted)
    m.post(None, ("t",), buf(1), anyone)
    m.close("rank 0's transport is closed")
    m.close("twice is fine")
    assert isinstance(posted.exc, DistError) and isinstance(anyone.exc, DistError)
    with pytest.raises(DistError, match="closed"):
        m.post(1, ("t",), buf(1), Outcome())


def test_a_message_from_this_rank_to_itself_is_matched_without_counting_against_a_bound() -> None:
    m, _ = matcher(inbox_messages=1)
    m.arrived(0, ("self",), META, memoryview(b"me"))
    assert m.buffered(0) == 0
    assert m.take(0, ("self",), buf(2)) == (0, META)


def test_a_polled_receive_takes_the_first_message_of_its_source_and_tag_and_later_ones_wait() -> None:
    m, _ = matcher()
    into = buf(4)
    polled = m.poll(1, ("t",), into)
    m.arrived(2, ("t",), META, memoryview(b"two!"))  # another source: the inbox
    m.arrived(1, ("u",), META, memoryview(b"tag!"))  # another tag: the inbox
    assert polled.outcome() is None
    m.arrived(1, ("t",), {"n": 1}, memoryview(b"one!"))
    m.arrived(1, ("t",), {"n": 2}, memoryview(b"next"))  # the polled receive is done: the inbox
    m.unpoll(polled)
    assert polled.outcome() == (1, {"n": 1}) and bytes(into) == b"one!"
    assert m.take(1, ("t",), buf(4)) == (1, {"n": 2})
    assert m.take(2, ("t",), buf(4)) == (2, META) and m.take(1, ("u",), buf(4)) == (1, META)


def test_a_polled_receive_comes_after_posted_receives_and_takes_only_whole_claims() -> None:
    m, _ = matcher()
    into, first = buf(4), Outcome()
    polled = m.poll(1, ("t",), into)
    m.post(None, ("t",), buf(4), first)  # posted (from any source): next in line before the poll
    assert m.claim(1, ("t",), 4, whole=True) is not into
    m.landed(1, ("t",), META, memoryview(b"1111"))
    assert first.result == (1, META) and polled.outcome() is None
    # a payload the link lands over several reads is not bound to a receive that may stop polling
    assert m.claim(1, ("t",), 4) is None
    assert polled.outcome() is None
    assert m.claim(1, ("t",), 4, whole=True) is into
    into[:] = b"2222"
    m.landed(1, ("t",), {"n": 2}, into)
    m.unpoll(polled)
    assert polled.outcome() == (1, {"n": 2})


def test_a_polled_receive_of_another_size_fails_with_the_mismatch_and_consumes_the_message() -> None:
    m, _ = matcher()
    polled = m.poll(1, ("t",), buf(4))
    assert m.claim(1, ("t",), 8, whole=True) is None  # not bound: the link reports it whole
    m.arrived(1, ("t",), {"n": 8}, memoryview(bytes(8)))
    m.unpoll(polled)
    with pytest.raises(MismatchError) as info:
        polled.outcome()
    assert info.value.remote_meta == {"n": 8}  # type: ignore[attr-defined]
    assert m.take_early(1, ("t",), 8) is None  # consumed


def test_a_receive_is_first_to_poll_only_with_no_receive_posted_or_polled_before_it() -> None:
    m, _ = matcher()
    assert m.first_to_poll(1, ("t",))
    m.post(2, ("t",), buf(4), Outcome())  # another source's
    m.post(None, ("u",), buf(4), Outcome())  # another tag's, from any source
    assert m.first_to_poll(1, ("t",))
    posted = m.post(1, ("t",), buf(4), Outcome())
    assert not m.first_to_poll(1, ("t",))
    m.unpost(posted)
    m.post(None, ("t",), buf(4), Outcome())  # from any source: it comes first too
    assert not m.first_to_poll(1, ("t",)) and m.first_to_poll(1, ("v",))
    polled = m.poll(1, ("v",), buf(4))  # (a receive polling already: the matcher decides)
    assert not m.first_to_poll(1, ("w",))
    m.unpoll(polled)
    assert m.first_to_poll(1, ("w",))


def test_an_inner_poll_restores_the_outer_one() -> None:
    m, _ = matcher()
    outer_into, inner_into = buf(1), buf(1)
    outer = m.poll(1, ("o",), outer_into)
    inner = m.poll(2, ("i",), inner_into)
    m.unpoll(inner)
    m.arrived(1, ("o",), META, memoryview(b"o"))
    m.arrived(2, ("i",), META, memoryview(b"i"))  # after the inner poll ended: the inbox
    m.unpoll(outer)
    assert outer.outcome() == (1, META) and inner.outcome() is None
    assert m.take(2, ("i",), buf(1)) == (2, META)


def test_deliver_copies_a_whole_message_where_claim_would_land_it_and_keeps_no_link_memory() -> None:
    m, _ = matcher()
    posted, in_place, anyone, wrong = Outcome(), Outcome(), Outcome(), Outcome()
    a, b, c = buf(4), buf(4), buf(4)
    m.post(1, ("t",), a, posted)
    m.post(1, ("p",), b, in_place, in_place=True)
    m.post(None, ("t",), c, anyone)
    m.post(1, ("w",), buf(2), wrong)
    box = bytearray(b"one!")  # the link's memory: reused once deliver returns
    m.deliver(1, ("t",), {"n": 1}, box)
    box[:] = b"two!"
    m.deliver(2, ("t",), {"n": 2}, box)  # another source: the receive from any source
    m.deliver(1, ("p",), {"n": 3}, box)
    assert (posted.result, bytes(a)) == ((1, {"n": 1}), b"one!")
    assert (anyone.result, bytes(c)) == ((2, {"n": 2}), b"two!")
    assert in_place.result == (1, {"n": 3}, b) and bytes(b) == b"two!"
    m.deliver(1, ("w",), {"n": 4}, box)  # bound to a receive of another size: it fails, consumed
    assert isinstance(wrong.exc, MismatchError) and wrong.exc.remote_meta == {"n": 4}  # type: ignore[attr-defined]
    assert m.received_direct == 3 and m.take_early(1, ("w",), 4) is None
    # early: kept in a copy of its own (unless the payload lasts), in send order
    m.deliver(1, ("e",), {"n": 5}, box)
    lasting = memoryview(b"last")
    m.deliver(1, ("e",), {"n": 6}, lasting, lasting=True)
    box[:] = b"junk"
    into = buf(4)
    assert m.take(1, ("e",), into) == (1, {"n": 5}) and bytes(into) == b"two!"
    early = m.take_early(1, ("e",), 4)
    assert early is not None and early.payload.obj is lasting.obj
    assert m.buffered(1) == 0


def test_deliver_gives_a_polled_receive_its_message_after_posted_ones_and_a_mismatch_fails_it() -> None:
    m, _ = matcher()
    into, first = buf(4), Outcome()
    polled = m.poll(1, ("t",), into)
    m.post(None, ("t",), buf(4), first)  # posted: next in line before the poll
    m.deliver(1, ("t",), {"n": 1}, b"1111")
    assert first.result == (1, {"n": 1}) and polled.outcome() is None
    m.deliver(1, ("t",), {"n": 2}, b"2222")
    m.deliver(1, ("t",), {"n": 3}, b"3333")  # the polled receive is done: the inbox
    m.unpoll(polled)
    assert polled.outcome() == (1, {"n": 2}) and bytes(into) == b"2222"
    assert m.take(1, ("t",), buf(4)) == (1, {"n": 3})
    polled = m.poll(1, ("t",), buf(4))
    m.deliver(1, ("t",), {"n": 8}, bytes(8))
    m.unpoll(polled)
    with pytest.raises(MismatchError):
        polled.outcome()
    assert m.take_early(1, ("t",), 8) is None  # consumed


def test_a_message_bound_to_a_polled_receive_that_stopped_before_it_landed_goes_to_the_next_one() -> None:
    """The link claimed a whole message for a polled receive but could not land it within the
    call (its sender was held off its core mid-copy); the receive stopped polling and was
    posted again: the message, landing in its buffer, goes to the receive posted again, and
    the stream's next message to the next receive. Not posted again, it waits in the inbox as a
    copy of what landed."""
    m, _ = matcher()
    into = buf(4)
    polled = m.poll(1, ("t",), into)
    assert m.claim(1, ("t",), 4, whole=True) is into
    m.unpoll(polled)
    assert polled.outcome() is None
    again = Outcome()
    m.post(1, ("t",), into, again)
    into[:] = b"big!"
    m.landed(1, ("t",), {"n": 1}, into)
    assert again.result == (1, {"n": 1}) and bytes(into) == b"big!"
    after = Outcome()
    m.post(1, ("t",), buf(1), after)
    m.arrived(1, ("t",), {"n": 2}, memoryview(b"x"))
    assert after.result == (1, {"n": 2})
    # not posted again before it landed: it waits in the inbox, in order
    into = buf(4)
    polled = m.poll(1, ("t",), into)
    assert m.claim(1, ("t",), 4, whole=True) is into
    m.unpoll(polled)
    into[:] = b"next"
    m.landed(1, ("t",), {"n": 3}, into)
    m.arrived(1, ("t",), {"n": 4}, memoryview(b"y"))
    assert polled.outcome() is None
    into[:] = b"mine"  # the buffer is its caller's again: the message kept is a copy
    got = buf(4)
    assert m.take(1, ("t",), got) == (1, {"n": 3}) and bytes(got) == b"next"
    assert m.take(1, ("t",), buf(1)) == (1, {"n": 4})
