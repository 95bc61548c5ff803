"""The device walk's accepted counts on their way to the host (``ddtree.vllm.counts``)."""

import numpy as np
import torch

from ddtree.vllm.counts import LandingCounts


class FakeEvent:
    """A CUDA event's interface, with the copy landing when the test says so."""

    def __init__(self):
        self.done, self.waited = False, 0

    def record(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.waited += 1
        self.done = True


def test_counts_are_read_in_step_order_once_landed_and_a_full_ring_waits_for_the_oldest():
    counts = LandingCounts(torch.device("cpu"), max_reqs=4, slots=2)
    events = counts._events = [FakeEvent(), FakeEvent()]
    assert counts.send(torch.tensor([3, 1], dtype=torch.int32), "step 1") is None
    assert counts.send(torch.tensor([2], dtype=torch.int32), "step 2") is None
    assert counts.landed(wait=False) == [] and len(counts) == 2  # nothing landed: the host does not wait
    events[1].done = True  # step 2 landed, step 1 not: counted in order, so neither yet
    assert counts.landed(wait=False) == []
    # A third step needs step 1's slot: step 1 is read first (waiting for it), and handed back.
    evicted = counts.send(torch.tensor([5, 6, 7], dtype=torch.int32), "step 3")
    assert evicted[0] == "step 1" and evicted[1].tolist() == [3, 1] and events[0].waited == 1
    got = counts.landed(wait=False)
    assert [(tag, c.tolist()) for tag, c in got] == [("step 2", [2])]
    got = counts.landed(wait=True)  # a synchronous engine: everything, waiting where needed
    assert [(tag, c.tolist()) for tag, c in got] == [("step 3", [5, 6, 7])] and len(counts) == 0


def test_on_cpu_copies_land_at_once_and_are_copies():
    counts = LandingCounts(torch.device("cpu"), max_reqs=3)
    source = torch.tensor([4, 2, 9], dtype=torch.int32)
    counts.send(source, "s")
    ((tag, got),) = counts.landed(wait=False)
    source[0] = 0
    counts.send(torch.tensor([1], dtype=torch.int32), "t")  # reuses no slot still being read
    assert tag == "s" and got.tolist() == [4, 2, 9] and isinstance(got, np.ndarray)


def test_the_host_looks_only_once_read_every_steps_are_in_flight():
    """With ``read_every`` 3 no event is queried and nothing counted until three steps are in flight; then every
    landed one comes back, in order, and a ring of more slots than that never waits."""
    counts = LandingCounts(torch.device("cpu"), max_reqs=2, slots=4, read_every=3)
    events = counts._events = [FakeEvent() for _ in range(4)]
    queried = []
    for i, event in enumerate(events):
        event.query = (lambda e, i: lambda: queried.append(i) or e.done)(event, i)
    for step in range(2):
        assert counts.send(torch.tensor([step], dtype=torch.int32), step) is None
        events[step].done = True
        assert counts.landed(wait=False) == []
    assert queried == []  # below read_every: no query at all
    assert counts.send(torch.tensor([2], dtype=torch.int32), 2) is None
    got = counts.landed(wait=False)  # three in flight; steps 0 and 1 landed, step 2 not yet
    assert [(tag, c.tolist()) for tag, c in got] == [(0, [0]), (1, [1])] and len(counts) == 1
    assert all(e.waited == 0 for e in events)
    assert [(tag, c.tolist()) for tag, c in counts.landed(wait=True)] == [(2, [2])]  # the summary's read: all


def test_read_every_must_leave_a_free_slot():
    import pytest

    with pytest.raises(ValueError, match="read_every must be 1 .. slots - 1 = 3, got 4"):
        LandingCounts(torch.device("cpu"), max_reqs=2, slots=4, read_every=4)
