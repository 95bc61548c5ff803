"""StepStaging: one upload of a step's small arrays, typed views back (CPU buffers here)."""

import numpy as np
import pytest
import torch

from ddtree.vllm.staging import ALIGN, MAX_RECENT_LAYOUTS, StepStaging


def _arrays(rng, scale=1):
    return [
        rng.integers(-(2**40), 2**40, size=7 * scale, dtype=np.int64),
        rng.integers(0, 2**32, size=(5 * scale, 3), dtype=np.uint64).astype(np.uint32),  # ancestor bits
        rng.integers(-5, 5, size=(3, 4 * scale), dtype=np.int32),
        np.zeros((0, 4), dtype=np.int64),
        rng.random(3).astype(np.float32),
        np.array([True, False, True]),
    ]


def test_every_array_comes_back_with_its_dtype_shape_and_bits():
    rng = np.random.default_rng(0)
    arrays = _arrays(rng)
    staging = StepStaging(torch.device("cpu"), initial_bytes=64)  # too small: grows on the first upload
    views = staging.upload(arrays)
    assert staging.uploads == 1
    for a, v in zip(arrays, views):
        assert tuple(v.shape) == a.shape
        assert v.is_contiguous()
        expected = a.view(np.int32) if a.dtype == np.uint32 else a
        assert np.array_equal(v.numpy(), expected)
    offsets = [v.storage_offset() * v.element_size() for v in views]
    assert all(offset % ALIGN == 0 for offset in offsets)


def test_buffers_are_reused_and_grow_only_when_needed():
    rng = np.random.default_rng(1)
    staging = StepStaging(torch.device("cpu"), initial_bytes=1 << 12)
    first = staging.upload(_arrays(rng))
    address = first[0].untyped_storage().data_ptr()
    second_arrays = _arrays(rng)
    second = staging.upload(second_arrays)
    assert second[0].untyped_storage().data_ptr() == address  # same device buffer, no allocation
    assert np.array_equal(second[0].numpy(), second_arrays[0])
    big = staging.upload(_arrays(rng, scale=200))
    assert big[0].shape == (1400,) and staging.uploads == 3


def test_non_contiguous_inputs_are_packed():
    a = np.arange(24, dtype=np.int64).reshape(4, 6)[:, ::2]
    (v,) = StepStaging(torch.device("cpu")).upload([a])
    assert np.array_equal(v.numpy(), a)


def test_unsupported_dtype_names_itself():
    with pytest.raises(TypeError, match="float64"):
        StepStaging(torch.device("cpu")).upload([np.zeros(3)])


def test_a_layout_is_kept_while_its_specs_are_equal_however_they_are_written():
    """The specs are compared as given before they are normalized: equal specs written another way (a list shape,
    a dtype object) keep the layout and its key (a graph captured on it replays); other shapes lay out anew."""
    staging = StepStaging(torch.device("cpu"))
    views = staging.host_arrays({"a": (np.int64, (3,)), "b": (np.int32, (2, 2))})
    key = staging.layout_key()
    views["a"][:] = [1, 2, 3]
    staging.upload_host()
    again = staging.host_arrays({"a": (np.dtype(np.int64), [3]), "b": (np.int32, (2, 2))})
    assert staging.layout_key() == key and again["a"].ctypes.data == views["a"].ctypes.data
    staging.upload_host()
    staging.host_arrays({"a": (np.int64, (3,)), "b": (np.int32, (2, 2))})  # as first given
    assert staging.layout_key() == key
    staging.upload_host()
    wider = staging.host_arrays({"a": (np.int64, (4,)), "b": (np.int32, (2, 2))})
    assert staging.layout_key() != key and wider["a"].shape == (4,)
    staging.upload_host()
    back = staging.host_arrays({"a": (np.int64, (3,)), "b": (np.int32, (2, 2))})
    assert staging.layout_key() == key and back["b"].shape == (2, 2)


def test_alternating_layouts_take_their_views_again_and_upload_what_was_written():
    """A step shape seen recently (a subset step's layout, then the whole step's, then the subset's again) gets its
    views back instead of new ones; each upload carries what its step wrote; the layouts still count as changes
    (what the host buffer holds may differ), and a buffer that grows drops them."""
    from ddtree.vllm import staging as staging_module

    staging = StepStaging(torch.device("cpu"), initial_bytes=256)
    whole = {"a": (np.int64, (4,)), "b": (np.int32, (3,))}
    subset = {"a": (np.int64, (4,)), "b": (np.int32, (3,)), "rows": (np.int64, (2,))}
    first = staging.host_arrays(whole)
    first["a"][:] = [1, 2, 3, 4]
    first["b"][:] = [5, 6, 7]
    staging.upload_host()
    second = staging.host_arrays(subset)
    second["rows"][:] = [9, 8]
    assert torch.equal(staging.upload_host()["rows"], torch.tensor([9, 8]))
    again = staging.host_arrays(whole)
    assert again["a"] is first["a"] and again["b"] is first["b"]  # the same views, not new ones
    again["a"][:] = [4, 3, 2, 1]
    got = staging.upload_host()
    assert got["a"].tolist() == [4, 3, 2, 1] and got["b"].tolist() == [5, 6, 7]
    assert staging.host_arrays(subset)["rows"] is second["rows"]
    assert (staging.layouts, staging.layouts_reused) == (4, 2)
    staging.upload_host()
    big = staging.host_arrays({"a": (np.int64, (100,))})  # grows the buffers: the kept views were of the old ones
    big["a"][:] = 0
    staging.upload_host()
    assert staging.host_arrays(whole)["a"] is not first["a"] and staging.layouts_reused == 2
    staging.upload_host()
    # At most MAX_RECENT_LAYOUTS kept: the oldest is made anew.
    for n in range(1, staging_module.MAX_RECENT_LAYOUTS + 1):
        staging.host_arrays({"a": (np.int64, (n,))})
        staging.upload_host()
    made = staging.layouts - staging.layouts_reused
    staging.host_arrays(whole)
    assert staging.layouts - staging.layouts_reused == made + 1


def test_a_recent_layout_is_found_again_when_its_dtypes_are_written_another_way():
    """A numpy class and its dtype compare equal but hash apart: the key holds dtypes, so a layout asked for with
    ``np.dtype(np.int64)`` after one laid out with ``np.int64`` takes its views again (and its graphs' key)."""
    staging = StepStaging(torch.device("cpu"))
    first = staging.host_arrays({"a": (np.int64, (3,))})
    key = staging.layout_key()
    staging.upload_host()
    staging.host_arrays({"b": (np.int32, (2,))})
    staging.upload_host()
    again = staging.host_arrays({"a": (np.dtype(np.int64), (3,))})
    assert again["a"] is first["a"] and staging.layouts_reused == 1 and staging.layout_key() == key


class _RecordedEvent:
    def __init__(self):
        self.streams = []

    def record(self, stream):
        self.streams.append(stream)


def test_an_uploads_event_is_recorded_on_the_stream_the_staging_was_given():
    # (torch's own lookup of the stream costs ~20 us more a record in the engine: test_event_records.py)
    stream = object()
    staging = StepStaging(torch.device("cpu"), current_stream=lambda: stream)
    staging.host_arrays({"positions": (np.int64, (4,))})["positions"][...] = 7
    staging._pin, staging._event = True, _RecordedEvent()  # as on a GPU, where the copy is asynchronous
    views = staging.upload_host()
    assert staging._event.streams == [stream]
    assert views["positions"].tolist() == [7, 7, 7, 7]


def test_the_least_recently_used_layout_is_the_one_dropped():
    """A drain goes through a layout per request count, again at every repeat: the layouts still in use stay."""
    staging = StepStaging(torch.device("cpu"), initial_bytes=1 << 16)  # (no growth below: views stay valid)

    def take(n):
        views = staging.host_arrays({"a": (np.int64, (n,))})
        staging.upload_host()
        return views["a"]

    first = {n: take(n) for n in range(1, MAX_RECENT_LAYOUTS + 1)}
    assert take(1) is first[1]  # used again: now the most recent
    take(MAX_RECENT_LAYOUTS + 1)  # one more: the least recently used (2) goes
    assert take(1) is first[1]
    assert take(3) is first[3]
    assert take(2) is not first[2]
