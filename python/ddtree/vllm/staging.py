"""One host-to-device copy per step for the tree path's small integer arrays.

A verification step needs about ten small arrays on the GPU (positions, ancestor bits, logits rows, the GDN
conv gather index, ...) and its acceptance about six more (accepted rows, KV moves, the GDN commit plan, the
drafter's row order). Copied one by one from pageable numpy memory, each costs a driver call and a staging
copy on the host. :class:`StepStaging` lays them out in a pinned buffer that it owns and reuses (the Rust
core writes the tree layouts straight into its views: :meth:`StepStaging.host_arrays`), copies it with one
asynchronous transfer, and hands back typed views of one device buffer.

Two pinned buffers take turns, one upload each. Reuse is safe because :meth:`StepStaging.host_arrays` first waits
for the transfer out of the buffer it hands out, the one two uploads back (a recorded CUDA event). With one buffer
the wait was for the previous upload's transfer, which under asynchronous scheduling is queued behind the previous
step's forward: batch 32's steps after a request ended (they upload every time) waited there ~0.16 ms a verify step
on average (the device plan's `device upload` piece in ``gpu-h100-pair-pieces-7672df9`` and
``gpu-h100-pair-to-host-b5124aa``, unchanged by a 0.60x cut of that piece's host work on CPU). The device views of an
upload stay valid until the next upload into the same staging (one device buffer: the transfers into it are
stream-ordered behind the kernels that read it); the runner keeps one staging per phase (verification inputs,
acceptance outputs), each uploaded once per step.

An upload may also be queued before its data exists (:meth:`StepStaging.upload_ahead`), behind a device-side wait
that the caller releases once it has filled the views (``ddtree.vllm.launch_gate``): the copy reads the pinned
buffer when it runs, not when it is queued.

Torch only (no vLLM import): CI tests it on CPU, where the buffers are ordinary memory.
"""

from __future__ import annotations

import dataclasses
import math
import types
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch

#: ``(dtype, shape)`` of one array of an upload.
ArraySpec = Tuple[np.dtype, Tuple[int, ...]]

#: Every array starts at a multiple of this many bytes, so each device view is aligned for its dtype.
ALIGN = 16


#: Layouts whose views a staging keeps for reuse (a step shape each: whole steps, subset steps, mixed steps).
MAX_RECENT_LAYOUTS = 8


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


#: Pinned host buffers a staging's uploads take in turn (see the module's docstring).
HOST_BUFFERS = 2


class StepStaging:
    """Reusable pinned host buffers (taken in turn) and one device buffer for one upload per step."""

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 16):
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._capacity = 0
        self._hosts: List[torch.Tensor] = []
        self._hosts_np: List[np.ndarray] = []
        self._device_buffer: Optional[torch.Tensor] = None
        self.host_buffer = 0  # the pinned buffer the views handed out belong to (the next upload's source)
        self._turn_after_upload = False  # an upload copied the current buffer: the next views are the other's
        # One event per buffer, recorded again by each upload from it, instead of a new one (and a driver event
        # created) per upload on the step's critical path (the upload's event was ~0.05 ms of host time in a
        # 27B-shape profile; the saving of reuse is not measured by itself); ``_copies_pending``: recorded and not
        # yet waited for.
        self._events: List[Optional[torch.cuda.Event]] = [None] * HOST_BUFFERS
        self._copies_pending = [False] * HOST_BUFFERS
        self.uploads = 0
        self.layouts = 0  # layouts made (views of the buffers laid out anew: what the host buffer holds may differ)
        self.layouts_reused = 0  # ... of them, a recent layout's views taken again (not made anew)
        # Recent layouts by key, ``(placement, host views by buffer, device views, total bytes)``: steps that
        # alternate between layouts (a device-planned subset step and the whole step after it: the subset's has a
        # row index more) take their views again instead of making ~40 numpy and torch views each time (~0.3 ms of a
        # batch-32 subset step's plan on the development CPU); a buffer's host views are made at its first turn.
        # Views of the current buffers only: emptied when they grow.
        self._recent_layouts: Dict[tuple, _Layout] = {}
        self._key: Optional[tuple] = None  # the current layout's (name, dtype, shape)s
        self._layout: Optional[_Layout] = None  # ... and the layout itself
        self._host_views: Dict[str, np.ndarray] = {}
        self._device_views: Dict[str, torch.Tensor] = {}
        self._total = 0
        self._pending = False  # host_arrays() handed out views that upload_host() has not copied yet
        self._awaiting_data = False  # upload_ahead() queued a copy of views not yet filled (data_written() ends it)
        self._grow(initial_bytes)

    def _grow(self, nbytes: int) -> None:
        capacity = max(nbytes, 2 * self._capacity)
        for buffer in range(len(self._hosts)):
            self._wait_for_copy_from(buffer)  # the old host buffers may still be read by transfers
        # Zeroed, not left as found: an early upload whose step never filled its views (its forward failed, and
        # the gate was released) copies what the buffer held, which must be indices in range, not garbage.
        self._hosts = [torch.zeros(capacity, dtype=torch.uint8, pin_memory=self._pin) for _ in range(HOST_BUFFERS)]
        self._hosts_np = [host.numpy() for host in self._hosts]
        self._device_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._capacity = capacity
        self._key = self._layout = None  # views of the old buffers are stale
        self._recent_layouts = {}
        self._given = None  # the specs the current layout was made from, as given
        self._given_read_only = None  # ... when they were a read-only mapping: recognised by identity

    def _wait_for_copy_from(self, buffer: int) -> None:
        """Waits for the transfer out of pinned buffer ``buffer``, if one is queued and not waited for."""
        if self._copies_pending[buffer]:
            self._events[buffer].synchronize()
            self._copies_pending[buffer] = False

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
                key = tuple((name, dtype, tuple(shape)) for name, (dtype, shape) in specs.items())
        if self._awaiting_data:
            # The copy of these views is queued already and waits for them: filling is all that is left (waiting
            # for that copy here would wait for ever).
            if key != self._key:
                raise RuntimeError(
                    f"DDTree: a step's arrays {_names(key)} differ from the layout its early upload was queued with "
                    f"{_names(self._key)} (a bug)"
                )
            return dict(self._host_views)
        if self._turn_after_upload:  # the buffer the last upload copied may still be read: the other one's turn
            self._turn_after_upload = False
            self.host_buffer = (self.host_buffer + 1) % HOST_BUFFERS
            self._wait_for_copy_from(self.host_buffer)  # (its transfer, two uploads back: in practice long done)
            if key == self._key:
                self._host_views = self._layout_host_views(self._layout)
        if key != self._key:
            self._lay_out(key)
        if not recognised:
            self._given = given
            self._given_read_only = specs if isinstance(specs, types.MappingProxyType) else None
        self._pending = True
        return dict(self._host_views)

    def _lay_out(self, key) -> None:
        recent = self._recent_layouts.get(key)
        if recent is not None:
            self._host_views = self._layout_host_views(recent)
            self._device_views, self._total = recent.device_views, recent.total
            self._key, self._layout = key, recent
            self.layouts += 1
            self.layouts_reused += 1
            return
        placement, total = [], 0
        for name, dtype, shape in key:
            dtype = np.dtype(dtype)
            _torch_dtype(dtype)  # refuse what the device side cannot view, before anything is written
            nbytes = dtype.itemsize * math.prod(shape)
            placement.append((name, dtype, shape, total, nbytes))
            total += _aligned(nbytes)
        if total > self._capacity:
            self._grow(total)  # (waits for every transfer out of the old buffers, empties the recent layouts)
        device = self._device_buffer
        device_views = {
            name: device[o : o + n].view(_torch_dtype(dtype)).view(shape) for name, dtype, shape, o, n in placement
        }
        layout = _Layout(placement, [None] * HOST_BUFFERS, device_views, total)
        self._host_views = self._layout_host_views(layout)
        self._device_views = device_views
        self._key, self._layout, self._total = key, layout, total
        self.layouts += 1
        if len(self._recent_layouts) >= MAX_RECENT_LAYOUTS:
            del self._recent_layouts[next(iter(self._recent_layouts))]  # (the oldest)
        self._recent_layouts[key] = layout

    def _layout_host_views(self, layout: "_Layout") -> Dict[str, np.ndarray]:
        """``layout``'s views of the current pinned buffer, made at that buffer's first turn with it."""
        views = layout.host_views[self.host_buffer]
        if views is None:
            host = self._hosts_np[self.host_buffer]
            # An empty array gets its own (empty) allocation: numpy gives empty views of the buffer one address,
            # and the Rust core refuses outputs that share memory.
            views = layout.host_views[self.host_buffer] = {
                name: host[o : o + n].view(dtype).reshape(shape) if n else np.empty(shape, dtype)
                for name, dtype, shape, o, n in layout.placement
            }
        return views

    def device_views(self) -> Dict[str, torch.Tensor]:
        """The current layout's device views, as the last :meth:`upload_host` returned them, without a copy: what
        that upload left there (the caller knows nothing was uploaded since: :attr:`uploads`)."""
        return dict(self._device_views)

    def layout_key(self) -> tuple:
        """What fixes the device views' addresses: the current layout and the device buffer. Two uploads with one
        key hand out views at the same addresses (a CUDA graph captured on one reads the other's arrays)."""
        return (self._key, self._device_buffer.data_ptr())

    def upload_host(self) -> Dict[str, torch.Tensor]:
        """Device views of what :meth:`host_arrays` laid out, after one host-to-device copy."""
        if not self._pending:
            raise RuntimeError("StepStaging.upload_host() without host_arrays() first")
        self._pending = False
        total, buffer = self._total, self.host_buffer
        if total:
            self._device_buffer[:total].copy_(self._hosts[buffer][:total], non_blocking=True)
            if self._pin:
                if self._events[buffer] is None:
                    self._events[buffer] = torch.cuda.Event()
                self._events[buffer].record()
                self._copies_pending[buffer] = True
            self._turn_after_upload = True
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


@dataclasses.dataclass
class _Layout:
    """One layout of a staging's buffers: each array's ``(name, dtype, shape, offset, nbytes)``, its host views by
    pinned buffer (None until that buffer's first turn with it), its device views and its total bytes."""

    placement: List[Tuple[str, np.dtype, Tuple[int, ...], int, int]]
    host_views: List[Optional[Dict[str, np.ndarray]]]
    device_views: Dict[str, torch.Tensor]
    total: int


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
