"""``min_tokens`` for tree steps, counted from the engine's token counts rather than vLLM's processor.

vLLM's ``MinTokensLogitsProcessor`` keeps a request while ``len(output_token_ids) < min_tokens`` and drops it for
good once the list is that long. Under asynchronous scheduling vLLM extends that list optimistically by every
draft of the previous step before the processor looks (``gpu_model_runner._update_states``) and trims it a step
later; with a tree those drafts are the whole tree (64 placeholders at budget 64), so the processor dropped
requests after their first tree and stop tokens came through early (``ddtree64-async``'s min_tokens scenario in
the first asynchronous run on a GPU). The engine's counts are exact where the sampler runs: vLLM applies the
previous step's acceptance to ``num_computed_tokens_cpu`` once the forward is launched, before sampling. So the
requests with ``min_tokens`` are kept here, and what each still needs is computed per step from those counts.

No vLLM import (CPU-tested in CI).
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Sequence, Tuple

import numpy as np

#: ``(request index, outputs still to come before a stop token may end the request, stop tokens)``: what
#: :func:`ddtree.vllm.step.stop_token_rows` masks.
Pending = Tuple[int, int, Tuple[int, ...]]


class MinTokensRequests:
    """The running requests that have a ``min_tokens``, until they have generated that many tokens."""

    def __init__(self):
        self._requests: Dict[str, Tuple[int, Tuple[int, ...]]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, req_id: str, min_tokens: int, stop_token_ids) -> None:
        """A new request; nothing is kept without a ``min_tokens`` or without stop tokens to hold back."""
        stops = tuple(sorted(int(t) for t in stop_token_ids or ()))
        if min_tokens and min_tokens > 0 and stops:
            self._requests[req_id] = (int(min_tokens), stops)

    def discard(self, req_ids) -> None:
        for req_id in req_ids:
            self._requests.pop(req_id, None)

    def pending(
        self,
        req_id_to_index: Mapping[str, int],
        num_reqs: int,
        num_computed: np.ndarray,
        num_scheduled: np.ndarray,
        num_prompt: np.ndarray,
        num_rows: Sequence[int],
    ) -> List[Pending]:
        """What each request of this step still needs before a stop token (those with nothing left are dropped).

        Request ``r`` was scheduled ``num_scheduled[r]`` tokens after its ``num_computed[r]`` computed ones and is
        sampled at ``num_rows[r]`` logits rows (a tree's nodes, or its last token). Its first row samples the token
        after ``num_computed + num_scheduled - (num_rows - 1)`` tokens, ``num_prompt[r]`` of them the prompt's.
        """
        pending: List[Pending] = []
        done = []
        for req_id, (min_tokens, stops) in self._requests.items():
            r = req_id_to_index.get(req_id)
            if r is None or r >= num_reqs:
                continue  # not in this step (preempted, or not scheduled)
            generated = int(num_computed[r]) + int(num_scheduled[r]) - (int(num_rows[r]) - 1) - int(num_prompt[r])
            if generated >= min_tokens:
                done.append(req_id)  # outputs only grow: nothing to hold back any more
            else:
                pending.append((r, min_tokens - max(generated, 0), stops))
        self.discard(done)
        return pending
