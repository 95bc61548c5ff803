"""The engine's current CUDA stream, looked up cheaply, for the events ddtree records every step.

``torch.cuda.Event.record()`` without a stream asks torch for the current one, which builds a Stream object each
call: 9 us with the device idle and 29 us behind a deep launch queue on an H100, against 2 and 7 us with the stream
given (``benches/results/gpu-h100-event-stream-33a1deb``). vLLM keeps the stream it last set
(``vllm.utils.torch_utils.current_stream``: it patches ``torch.cuda.set_stream``, which torch's stream contexts and
CUDA graph captures go through), so :func:`current_stream` returns that one.

vLLM's function has a precondition: a thread in which nothing set a stream gets a *new* stream, made current
there. vLLM 0.25.1's worker sets none before its first step when it runs eagerly (its CUDA graph capture sets one
as a side effect), so the first event ddtree recorded would move the engine onto a fresh stream, unordered behind
the work already queued on the old one. :func:`current_stream` therefore first stores, once per thread, the stream
torch holds current (``torch.cuda.set_stream`` of it: through vLLM's patch, a no-op for torch).
"""

from __future__ import annotations

import threading

import torch
from vllm.utils.torch_utils import current_stream as _vllm_current_stream

_synced = threading.local()


def current_stream() -> torch.cuda.Stream:
    """The current CUDA stream of this thread, as vLLM keeps it (see the module's docstring)."""
    if not getattr(_synced, "done", False):
        torch.cuda.set_stream(torch.cuda.current_stream())  # (vLLM's patch stores it; torch's stays the same)
        _synced.done = True
    return _vllm_current_stream()
