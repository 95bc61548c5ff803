"""One host-to-device copy per step for the tree path's small integer arrays.

A verification step needs about ten small arrays on the GPU (positions, ancestor bits, logits rows, the GDN
conv gather index, ...) and its acceptance about six more (accepted rows, KV moves, the GDN commit plan, the
drafter's row order). Copied one by one from pageable numpy memory, each costs a driver call and a staging
copy on the host. :class:`StepStaging` packs them into one pinned buffer that it owns and reuses, copies it
with one asynchronous transfer, and hands back typed views of one device buffer.

Reuse is safe because the next :meth:`StepStaging.upload` first waits for the previous transfer to have left
the pinned buffer (a recorded CUDA event: in practice long done, so the wait costs nothing). The device views
of an upload stay valid until the next upload into the same staging; the runner keeps one staging per phase
(verification inputs, acceptance outputs), each uploaded once per step.

Torch only (no vLLM import): CI tests it on CPU, where the buffers are ordinary memory.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np
import torch

#: Every array starts at a multiple of this many bytes, so each device view is aligned for its dtype.
ALIGN = 16


def _aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class StepStaging:
    """A reusable pinned host buffer and device buffer for one upload per step."""

    def __init__(self, device: torch.device, initial_bytes: int = 1 << 16):
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda"
        self._capacity = 0
        self._host: Optional[torch.Tensor] = None
        self._host_np: Optional[np.ndarray] = None
        self._device_buffer: Optional[torch.Tensor] = None
        self._copied: Optional[torch.cuda.Event] = None
        self.uploads = 0
        self._grow(initial_bytes)

    def _grow(self, nbytes: int) -> None:
        capacity = max(nbytes, 2 * self._capacity)
        self._wait_for_previous_copy()  # the old host buffer may still be read by a transfer
        self._host = torch.empty(capacity, dtype=torch.uint8, pin_memory=self._pin)
        self._host_np = self._host.numpy()
        self._device_buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
        self._capacity = capacity

    def _wait_for_previous_copy(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def upload(self, arrays: Sequence[np.ndarray]) -> List[torch.Tensor]:
        """Device tensors with the dtypes and shapes of ``arrays`` (numpy), after one host-to-device copy.

        The views are valid until the next call of this staging's ``upload``.
        """
        arrays = [np.ascontiguousarray(a) for a in arrays]
        offsets, total = [], 0
        for a in arrays:
            offsets.append(total)
            total += _aligned(a.nbytes)
        if total > self._capacity:
            self._grow(total)
        else:
            self._wait_for_previous_copy()
        host = self._host_np
        for a, offset in zip(arrays, offsets):
            if a.nbytes:
                host[offset : offset + a.nbytes] = a.reshape(-1).view(np.uint8)
        device = self._device_buffer
        if total:
            device[:total].copy_(self._host[:total], non_blocking=True)
            if self._pin:
                self._copied = torch.cuda.Event()
                self._copied.record()
        self.uploads += 1
        return [
            device[offset : offset + a.nbytes].view(_torch_dtype(a.dtype)).view(a.shape)
            for a, offset in zip(arrays, offsets)
        ]


_DTYPES = {
    np.dtype(np.int64): torch.int64,
    np.dtype(np.int32): torch.int32,
    np.dtype(np.uint32): torch.int32,  # bit patterns (ancestor masks): the kernels read int32 words
    np.dtype(np.float32): torch.float32,
    np.dtype(np.bool_): torch.bool,
}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    try:
        return _DTYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"StepStaging uploads int64, int32, uint32, float32 and bool arrays, got {dtype}") from None
