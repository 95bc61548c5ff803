"""The device walk's accepted paths on their way to the host (``ddtree.vllm.counts.PathRing``)."""

import numpy as np
import pytest
import torch

from ddtree.vllm.counts import PathRing


#: What the ring's ``current_stream`` returns here: the stream its events must be recorded on.
ENGINE_STREAM = "the engine's current stream"


def _engine_stream():
    return ENGINE_STREAM


class FakeEvent:
    """A CUDA event's interface, with the copy landing when the test says so. ``record`` takes the stream: a
    record without one would have torch look the stream up (``PathRing``'s ``current_stream``)."""

    def __init__(self):
        self.done, self.waited, self.recorded = False, 0, 0

    def record(self, stream):
        assert stream is ENGINE_STREAM, f"recorded on {stream!r}, not the stream the ring was given"
        self.done = False
        self.recorded += 1

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def _rows(serial: int, num_trees: int, width: int = 3) -> torch.Tensor:
    """Rows of each step: ``(serial % 1000) * 100 + tree * 10 + column`` (distinct for nearby serials)."""
    base = (serial % 1000) * 100
    return torch.tensor(
        [[base + tree * 10 + col for col in range(width)] for tree in range(num_trees)], dtype=torch.int32
    )


def _walk(ring: PathRing, serial: int, num_trees: int) -> torch.Tensor:
    """What a walk does on the device: its rows into the ring under the step's uploaded serial."""
    rows = _rows(serial, num_trees)
    ring.write(rows, torch.tensor([serial], dtype=torch.int64))
    return rows


def test_every_slots_th_step_copies_the_ring_once_and_its_steps_come_back_in_order_once_landed():
    ring = PathRing(torch.device("cpu"), max_reqs=4, width=3, slots=4, current_stream=_engine_stream)
    events = ring._events = [FakeEvent(), FakeEvent()]
    sizes = [2, 4, 1, 3]
    for serial, n in enumerate(sizes):
        _walk(ring, serial, n)
        assert ring.note(serial, n, f"step {serial}") == []
        if serial < 3:  # no copy, no event before the fourth step: no host work but the note
            assert events[0].recorded == 0
    assert events[0].recorded == 1 and len(ring) == 4
    assert ring.landed(wait=False) == []  # not landed yet: the host does not wait
    events[0].done = True
    got = ring.landed(wait=False)
    assert [tag for tag, _ in got] == [f"step {s}" for s in range(4)] and len(ring) == 0
    for (tag, rows), serial, n in zip(got, range(4), sizes):
        assert isinstance(rows, np.ndarray) and rows.tolist() == _rows(serial, n).tolist()
    assert ring.lost_steps == 0 and all(e.waited == 0 for e in events)


def test_the_copy_is_a_snapshot_later_walks_do_not_change():
    """On CPU the copy lands at once: the rows read are those of the noted steps, whatever the walks write after."""
    ring = PathRing(torch.device("cpu"), max_reqs=2, width=3, slots=2, current_stream=_engine_stream)
    for serial in range(2):
        _walk(ring, serial, 2)
        ring.note(serial, 2, serial)
    _walk(ring, 2, 2)  # overwrites serial 0's slot on the device after the copy
    got = ring.landed(wait=False)
    assert [(tag, rows.tolist()) for tag, rows in got] == [(0, _rows(0, 2).tolist()), (1, _rows(1, 2).tolist())]


def test_a_pinned_buffer_still_in_flight_is_read_before_it_is_reused():
    ring = PathRing(torch.device("cpu"), max_reqs=2, width=3, slots=1, current_stream=_engine_stream)
    events = ring._events = [FakeEvent(), FakeEvent()]
    _walk(ring, 0, 1)
    assert ring.note(0, 1, "a") == []  # copy into buffer 0
    _walk(ring, 1, 2)
    assert ring.note(1, 2, "b") == []  # copy into buffer 1
    _walk(ring, 2, 1)
    freed = ring.note(2, 1, "c")  # buffer 0 again: its copy is waited for and read first
    assert [(tag, rows.tolist()) for tag, rows in freed] == [("a", _rows(0, 1).tolist())] and events[0].waited == 1
    got = ring.landed(wait=True)  # the summary's read: everything, waiting where needed
    assert [tag for tag, _ in got] == ["b", "c"] and len(ring) == 0


def test_the_summary_copies_the_steps_noted_since_the_last_copy():
    ring = PathRing(torch.device("cpu"), max_reqs=3, width=3, slots=4, current_stream=_engine_stream)
    _walk(ring, 0, 3)
    ring.note(0, 3, "only")
    assert ring.landed(wait=False) == []  # below the copy's period: nothing read
    ((tag, rows),) = ring.landed(wait=True)
    assert tag == "only" and rows.tolist() == _rows(0, 3).tolist()
    assert ring.landed(wait=True) == []  # nothing counted twice


def test_a_slot_holding_another_steps_serial_is_lost_not_miscounted():
    """A step whose walk did not write (or whose slot a later serial of the same copy overwrote) is left out and
    counted as lost: the statistics never count another step's paths."""
    ring = PathRing(torch.device("cpu"), max_reqs=2, width=3, slots=4, current_stream=_engine_stream)
    _walk(ring, 0, 1)
    ring.note(0, 1, "walked")
    ring.note(1, 1, "not walked")  # its slot still holds the initial -1
    _walk(ring, 2, 1)
    ring.note(2, 1, "walked too")
    _walk(ring, 7, 2)  # serial 7 takes serial 3's slot: a skipped serial
    ring.note(3, 1, "overwritten")
    got = ring.landed(wait=True)
    assert [tag for tag, _ in got] == ["walked", "walked too"] and ring.lost_steps == 2


def test_serials_wrap_through_the_ring_and_past_the_int32_stamp():
    ring = PathRing(torch.device("cpu"), max_reqs=1, width=3, slots=2, current_stream=_engine_stream)
    counted = []
    for serial in (2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**33 + 4):
        _walk(ring, serial, 1)
        counted += ring.note(serial, 1, serial)
    counted += ring.landed(wait=True)
    assert [tag for tag, _ in counted] == [2**31 - 2, 2**31 - 1, 2**31, 2**31 + 1, 2**33 + 4]
    assert ring.lost_steps == 0


def test_rows_that_do_not_fit_are_refused_by_name():
    ring = PathRing(torch.device("cpu"), max_reqs=2, width=3, current_stream=_engine_stream)
    with pytest.raises(ValueError, match=r"rows of shape \(3, 3\) do not fit 2 rows of width 3"):
        ring.write(torch.zeros((3, 3), dtype=torch.int32), torch.tensor([0]))
    with pytest.raises(ValueError, match="slots, max_reqs and width must be positive"):
        PathRing(torch.device("cpu"), max_reqs=2, width=3, slots=0, current_stream=_engine_stream)


def test_rows_read_are_the_steps_own_when_the_pinned_buffer_is_written_again():
    """A read hands rows that outlive the pinned buffer's next copy (the statistics keep them for a later fold)."""
    ring = PathRing(torch.device("cpu"), max_reqs=3, width=3, slots=2, current_stream=_engine_stream)
    for serial, n in enumerate([3, 1]):
        _walk(ring, serial, n)
        ring.note(serial, n, serial)
    first = ring.landed(wait=False)
    for serial in range(2, 6):  # both pinned buffers written again, twice
        _walk(ring, serial, 3)
        ring.note(serial, 3, serial)
        ring.landed(wait=False)
    assert [(tag, rows.tolist()) for tag, rows in first] == [(0, _rows(0, 3).tolist()), (1, _rows(1, 1).tolist())]
