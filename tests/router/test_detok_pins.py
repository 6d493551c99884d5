"""Stream -> detok replica placement for stateful detokenizers (`router.detok_pins`)."""

from __future__ import annotations

from core.messages import TokenChunk
from router.detok_pins import DetokPins


def chunk(req_id: str, seq: int = 0) -> TokenChunk:
    return TokenChunk(req_id, seq, [[0]], 0, 0, 1, False)


def test_new_streams_spread_then_stay_put():
    pins = DetokPins()
    live = {"d1": 0, "d2": 0}
    first = [pins.target(rid, live) for rid in ("a", "b", "c", "d")]
    assert sorted(first) == ["d1", "d1", "d2", "d2"]
    assert [pins.target(rid, {"d1": 9, "d2": 0}) for rid in ("a", "b", "c", "d")] == first  # load no longer moves them


def test_reported_load_breaks_ties_between_equally_placed_replicas():
    assert DetokPins().target("a", {"d1": 5, "d2": 1}) == "d2"


def test_a_stream_whose_replica_is_gone_moves_and_unknown_replicas_leave_the_choice_to_serve():
    pins = DetokPins()
    assert pins.target("a", {}) == ""  # not listed yet: the handle's router picks
    assert pins.target("a", {"d1": 0}) == "d1"
    assert pins.target("a", {}) == "d1"  # the listing blinked: keep the pin
    assert pins.target("a", {"d2": 0, "d3": 3}) == "d2"


def test_a_stream_follows_its_decoder_state_and_is_forgotten_at_its_end():
    pins = DetokPins()
    pins.target("a", {"d1": 0})
    pins.decoded_on("a", "d3")  # the call went elsewhere (d1 died): its state is on d3 now
    assert pins.target("a", {"d1": 0, "d3": 0}) == "d3"
    pins.forget("a")
    assert pins.by_stream == {}


def test_split_keeps_each_groups_order():
    pins = DetokPins()
    live = {"d1": 0, "d2": 0}
    groups = pins.split([chunk("a", 0), chunk("b", 0), chunk("a", 1), chunk("b", 1)], live)
    got = sorted([(c.req_id, c.seq) for c in group] for group in groups.values())
    assert got == [[("a", 0), ("a", 1)], [("b", 0), ("b", 1)]]
