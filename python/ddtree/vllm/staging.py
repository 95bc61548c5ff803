"""One host-to-device copy per step for the tree path's small integer arrays.

A verification step needs about ten small arrays on the GPU (positions, ancestor bits, logits rows, the GDN
conv gather index, ...) and its acceptance about six more (accepted rows, KV moves, the GDN commit plan, the
drafter's row order). Copied one by one from pageable numpy memory, each costs a driver call and a staging
copy on the host. :class:`StepStaging` lays them out in one pinned buffer that it owns and reuses (the Rust
core writes the tree layouts straight into its views: :meth:`StepStaging.host_arrays`), copies it with one
asynchronous transfer, and hands back typed views of one device buffer.

Reuse is safe because the next :meth:`StepStaging.host_arrays` first waits for the previous transfer to have left
the pinned buffer (a recorded CUDA event). For the stagings filled in vLLM's input preparation (the plan's, the
counts') that wait costs nothing: vLLM 0.25.1 waits at the start of each step's input preparation for an event it
recorded at the end of the last one (``GPUModelRunner.synchronize_input_prep``), after which that transfer was
queued. (A second pinned buffer taking turns was tried for batch 32's 0.16 ms `device upload` piece and taken
back: that piece is not this wait.) The device views
of an upload stay valid until the next upload into the same staging; the runner keeps one staging per phase
(verification inputs, acceptance outputs), each uploaded once per step.

An upload may also be queued before its data exists (:meth:`StepStaging.upload_ahead`), behind a device-side wait
that the caller releases once it has filled the views (``ddtree.vllm.launch_gate``): the copy reads the pinned
buffer when it runs, not when it is queued.

Torch only (no vLLM import): CI tests it on CPU, where the buffers are ordinary memory.
"""

from __future__ import annotations

import math
import types
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

#: ``(dtype, shape)`` of one array of an upload.
ArraySpec = Tuple[np.dtype, Tuple[int, ...]]

#: Every array starts at a multiple of this many bytes, so each device view is aligned for its dtype.
ALIGN = 16


#: Layouts whose views a staging keeps for reuse (a step shape each: whole steps, subset steps, mixed steps), the
#: least recently used dropped first. A batch draining as its requests end takes a new layout at each request
#: count, a subset step's and a whole step's: 64 hold a drain from 32 (making a layout anew cost ~0.47 ms of a
#: batch-32 upload on an H100, ``gpu-h100-pair-ring16-33a1deb``); they are views of the staging's two buffers.
MAX_RECENT_LAYOUTS = 64


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class StepStaging:
    """A reusable pinned host buffer and device buffer for one upload per step."""

    def __init__(
        self,
        device: torch.device,
        initial_bytes: int = 1 << 16,
        current_stream: Callable[[], torch.cuda.Stream] = torch.cuda.current_stream,
    ):
        self.device = torch.device(device)
        # The stream the upload's event is recorded on. The adapter passes vLLM's ``current_stream``, which keeps
        # the stream it last set: ``Event.record()`` without a stream asks torch, which builds a Stream object
        # each call (9 us with the device idle, 29 us behind a deep launch queue, against 2 and 7 us with the
        # stream given: ``gpu-h100-event-stream-33a1deb``).
        self._current_stream = current_stream
        self._pin = self.device.type == "cuda"
        self._capacity = 0
        self._host: Optional[torch.Tensor] = None
        self._host_np: Optional[np.ndarray] = None
        self._device_buffer: Optional[torch.Tensor] = None
        # One event, recorded again by every upload, instead of a new one (and a driver event created) per upload on
        # the step's critical path (the upload's event was ~0.05 ms of host time in a 27B-shape profile; the saving
        # of reuse is not measured by itself); ``_copy_pending``: recorded and not yet waited for.
        self._event: Optional[torch.cuda.Event] = None
        self._copy_pending = False
        self.uploads = 0
        self.layouts = 0  # layouts made (views of the buffers laid out anew: what the host buffer holds may differ)
        self.layouts_reused = 0  # ... of them, a recent layout's views taken again (not made anew)
        # Recent layouts' views by key, ``(host views, device views, total bytes)``: steps that alternate between
        # layouts (a device-planned subset step and the whole step after it: the subset's has a row index more) take
        # their views again instead of making ~40 numpy and torch views each time (~0.3 ms of a batch-32 subset
        # step's plan on the development CPU). Views of the current buffers only: emptied when they grow.
        self._recent_layouts: Dict[tuple, Tuple[Dict[str, np.ndarray], Dict[str, torch.Tensor], int]] = {}
        self._key: Optional[tuple] = None  # the current layout's (name, dtype, shape)s
        self._host_views: Dict[str, np.ndarray] = {}
        self._device_views: Dict[str, torch.Tensor] = {}
        self._total = 0
        self._pending = False  # host_arrays() handed out views that upload_host() has not copied yet
        self._awaiting_data = False  # upload_ahead() queued a copy of views not yet filled (data_written() ends it)
        self._grow(initial_bytes)

    def _grow(self, nbytes: int) -> None:
        capacity = max(nbytes, 2 * self._capacity)
        self._wait_for_previous_copy()  # the old host buffer may still be read by a transfer
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self._pin)
        self._host_np = self._host.numpy()
        self._device_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._capacity = capacity
        self._key = None  # views of the old buffers are stale
        self._recent_layouts = {}
        self._given = None  # the specs the current layout was made from, as given
        self._given_read_only = None  # ... when they were a read-only mapping: recognised by identity

    def _wait_for_previous_copy(self) -> None:
        if self._copy_pending:
            self._event.synchronize()
            self._copy_pending = False

    def host_arrays(self, specs: Mapping[str, ArraySpec]) -> Dict[str, np.ndarray]:
        """Numpy views of the host buffer, one per ``name: (dtype, shape)``, for the caller (e.g. the Rust core)
        to fill; :meth:`upload_host` then copies them in one transfer. Valid until the next call of either.

        A step usually has the shapes of the step before (the same batch of whole trees): the layout and its
        views are then reused, not made again.
        """
        recognised = specs is self._given_read_only  # the same read-only mapping as last time (a repeated shape)
        if recognised:
            key = self._key
        else:
            given = tuple(specs.items())  # compared as given (~1 us); normalized (~7 us) only when it changed
            if given == self._given:
                key = self._key
            else:
                # (np.dtype: a numpy class and its dtype compare equal but hash apart, and the key is hashed.)
                key = tuple((name, np.dtype(dtype), tuple(shape)) for name, (dtype, shape) in specs.items())
        if self._awaiting_data:
            # The copy of these views is queued already and waits for them: filling is all that is left (waiting
            # for that copy here would wait for ever).
            if key != self._key:
                raise RuntimeError(
                    f"DDTree: a step's arrays {_names(key)} differ from the layout its early upload was queued with "
                    f"{_names(self._key)} (a bug)"
                )
            return dict(self._host_views)
        if key != self._key:
            self._lay_out(key)
        else:
            self._wait_for_previous_copy()
        if not recognised:
            self._given = given
            self._given_read_only = specs if isinstance(specs, types.MappingProxyType) else None
        self._pending = True
        return dict(self._host_views)

    def _lay_out(self, key) -> None:
        recent = self._recent_layouts.pop(key, None)
        if recent is not None:
            self._recent_layouts[key] = recent  # (now the most recently used)
            self._wait_for_previous_copy()  # (the host buffer may still be read by the last transfer)
            self._host_views, self._device_views, self._total = recent
            self._key = key
            self.layouts += 1
            self.layouts_reused += 1
            return
        layout, total = [], 0
        for name, dtype, shape in key:
            dtype = np.dtype(dtype)
            _torch_dtype(dtype)  # refuse what the device side cannot view, before anything is written
            nbytes = dtype.itemsize * math.prod(shape)
            layout.append((name, dtype, shape, total, nbytes))
            total += _aligned(nbytes)
        if total > self._capacity:
            self._grow(total)
        else:
            self._wait_for_previous_copy()
        host, device = self._host_np, self._device_buffer
        # An empty array gets its own (empty) allocation: numpy gives empty views of the buffer one address,
        # and the Rust core refuses outputs that share memory.
        self._host_views = {
            name: host[o : o + n].view(dtype).reshape(shape) if n else np.empty(shape, dtype)
            for name, dtype, shape, o, n in layout
        }
        self._device_views = {
            name: device[o : o + n].view(_torch_dtype(dtype)).view(shape) for name, dtype, shape, o, n in layout
        }
        self._key, self._total = key, total
        self.layouts += 1
        if len(self._recent_layouts) >= MAX_RECENT_LAYOUTS:
            del self._recent_layouts[next(iter(self._recent_layouts))]  # (the oldest)
        self._recent_layouts[key] = (self._host_views, self._device_views, total)

    def device_views(self) -> Dict[str, torch.Tensor]:
        """The current layout's device views, as the last :meth:`upload_host` returned them, without a copy: what
        that upload left there (the caller knows nothing was uploaded since: :attr:`uploads`)."""
        return dict(self._device_views)

    def views_token(self) -> object:
        """An object that is the same exactly while the device views are (the current layout's own mapping; a
        caller holding it keeps its identity unique): the views of two uploads with one token are the same
        tensors."""
        return self._device_views

    def layout_key(self) -> tuple:
        """What fixes the device views' addresses: the current layout and the device buffer. Two uploads with one
        key hand out views at the same addresses (a CUDA graph captured on one reads the other's arrays)."""
        return (self._key, self._device_buffer.data_ptr())

    def upload_host(self) -> Dict[str, torch.Tensor]:
        """Device views of what :meth:`host_arrays` laid out, after one host-to-device copy."""
        if not self._pending:
            raise RuntimeError("StepStaging.upload_host() without host_arrays() first")
        self._pending = False
        total = self._total
        if total:
            self._device_buffer[:total].copy_(self._host[:total], non_blocking=True)
            if self._pin:
                if self._event is None:
                    self._event = torch.cuda.Event()
                self._event.record(self._current_stream())
                self._copy_pending = True
        self.uploads += 1
        return dict(self._device_views)

    def upload_ahead(self) -> Dict[str, torch.Tensor]:
        """:meth:`upload_host` of views not filled yet: the caller has queued a wait on the stream that it releases
        after filling them (the next :meth:`host_arrays` of the same layout hands them out without waiting for this
        copy), and calls :meth:`data_written` then."""
        views = self.upload_host()
        self._awaiting_data = True
        return views

    def data_written(self) -> None:
        """The views of the last :meth:`upload_ahead` are filled; the staging goes back to its usual order."""
        self._awaiting_data = False

    def upload(self, arrays: Sequence[np.ndarray]) -> List[torch.Tensor]:
        """Device tensors with the dtypes and shapes of ``arrays`` (numpy), after one host-to-device copy.

        The views are valid until the next upload of this staging.
        """
        arrays = [np.asarray(a) for a in arrays]
        views = self.host_arrays({str(i): (a.dtype, a.shape) for i, a in enumerate(arrays)})
        for i, a in enumerate(arrays):
            views[str(i)][...] = a
        device = self.upload_host()
        return [device[str(i)] for i in range(len(arrays))]


_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.uint32): torch.int32,  # bit patterns (ancestor masks): the kernels read int32 words
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


def _names(key) -> List[str]:
    return [f"{name}{list(shape)}" for name, _, shape in key or ()]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    try:
        return _DTYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"StepStaging uploads int64, int32, uint32, float32 and bool arrays, got {dtype}") from None
