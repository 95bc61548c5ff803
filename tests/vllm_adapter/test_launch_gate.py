"""The launch gate's host side (``ddtree.vllm.launch_gate``) and the staging's early upload, on CPU with a
stand-in for the driver's stream wait."""

import time

import numpy as np
import pytest
import torch

from ddtree.vllm import launch_gate
from ddtree.vllm.launch_gate import WAIT_GEQ, GateTimeout, StreamGate, probe
from ddtree.vllm.staging import StepStaging

CPU = torch.device("cpu")


def recording_gate(timeout_s=20.0, result=0):
    waits = []

    def wait(stream, address, value, flags):
        waits.append((stream, address, value, flags))
        return result

    return StreamGate(CPU, wait=wait, timeout_s=timeout_s), waits


def test_tickets_grow_and_a_release_writes_the_counter_the_stream_waits_on():
    gate, waits = recording_gate()
    first, second = gate.queue(), gate.queue(stream=7)
    assert (first, second) == (1, 2) and gate.released == 0
    address = gate._counter.data_ptr()
    assert waits == [(0, address, 1, WAIT_GEQ), (7, address, 2, WAIT_GEQ)]
    gate.release(first)
    assert gate.released == 1
    gate.release(second)
    gate.release(first)  # an older ticket never goes back over a newer release
    assert gate.released == 2


def test_tickets_wrap_around_32_bits_in_the_drivers_own_order():
    gate, waits = recording_gate()
    gate._queued = 0xFFFFFFFF
    gate._counter_np[0] = 0xFFFFFFFF
    ticket = gate.queue()
    assert ticket == 0 and waits[-1][2] == 0
    gate.release(ticket)
    assert gate.released == 0  # (int32)(0 - 0xFFFFFFFF) = 1 >= 0: a newer ticket, written


def test_a_failing_stream_wait_is_refused_with_the_drivers_result():
    gate, _ = recording_gate(result=801)
    with pytest.raises(RuntimeError, match="CUresult 801"):
        gate.queue()
    assert gate.released == 0


def test_the_watchdog_releases_a_ticket_held_too_long_and_the_late_release_says_why():
    gate, _ = recording_gate(timeout_s=0.05)
    ticket = gate.queue()
    deadline = time.monotonic() + 5.0
    while gate.released != ticket and time.monotonic() < deadline:
        time.sleep(0.01)
    assert gate.released == ticket  # the GPU would have been let go
    with pytest.raises(GateTimeout, match="DDTREE_LAUNCH_AHEAD=0"):
        gate.release(ticket)
    # A ticket released in time is not touched by the watchdog, and its release does not raise.
    ticket = gate.queue()
    gate.release(ticket)
    time.sleep(0.1)
    gate.release(ticket)


def test_the_probe_says_why_a_cpu_cannot_gate():
    assert probe(CPU) == "not a CUDA device"


def test_the_probe_refuses_hosts_whose_store_order_the_release_cannot_rely_on(monkeypatch):
    """The release is a plain store after the plan's: only x86-64 makes the GPU see them in that order (a review
    helper's finding: on aarch64, a GH200, the gated copy could read the plan's old bytes)."""
    monkeypatch.setattr(launch_gate.platform, "machine", lambda: "aarch64")
    assert probe(torch.device("cuda")) == "the gate's release relies on x86-64's store order; this host is aarch64"
    assert probe(CPU) == "not a CUDA device"


def test_an_early_upload_hands_out_its_views_to_be_filled_without_waiting_and_refuses_another_layout():
    staging = StepStaging(CPU)
    specs = {"a": (np.int64, (4,)), "b": (np.int32, (2, 3))}
    staging.host_arrays(specs)
    device = staging.upload_ahead()
    host = staging.host_arrays(specs)  # the same layout: the queued copy's own buffer, to fill now
    host["a"][:] = [1, 2, 3, 4]
    with pytest.raises(RuntimeError, match=r"differ from the layout its early upload was queued with"):
        staging.host_arrays({"a": (np.int64, (5,))})
    staging.data_written()
    assert staging._host_views["a"].tolist() == [1, 2, 3, 4]
    # Back to the usual order: the next layout is laid out and uploaded as ever.
    staging.host_arrays({"a": (np.int64, (5,))})["a"][:] = 9
    assert staging.upload_host()["a"].tolist() == [9] * 5
    assert device["a"].shape == (4,)
