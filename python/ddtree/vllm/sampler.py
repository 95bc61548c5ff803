"""DDTree's replacement of vLLM's rejection sampler (``runner.rejection_sampler``).

vLLM calls ``rejection_sampler(spec_decode_metadata, draft_probs, logits,
sampling_metadata)`` with one logits row per verified token (``b + 1`` rows
per request with ``b`` drafts, one row for the others) and expects
``SamplerOutput.sampled_token_ids`` ``[num_reqs, max_spec_len + 1]`` in chain
format: accepted draft tokens, then the bonus token, then -1. Everything
downstream (scheduler, ``num_computed_tokens -= num_rejected``, metrics, the
drafter's next input) reads only that.

This sampler draws one target token per row (:func:`ddtree.vllm.node_sampling.sample_rows`),
copies the tree rows' tokens to the host once, walks every tree in one Rust
call and writes the chain rows. Rows of requests without a tree keep their
single sampled token. Requested logprobs are those of the target's raw
distribution at the node each emitted token was sampled from (vLLM's default
``raw_logprobs`` mode, or ``raw_logits``), in the layout vLLM's own rejection
sampler returns.
"""

from __future__ import annotations

import weakref
from typing import Dict, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from ddtree.vllm.bounded import keep
from vllm.v1.outputs import SamplerOutput
from vllm.v1.utils import record_function_or_nullcontext
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
)

from ddtree.vllm import device_accept
from ddtree.vllm.node_sampling import sample_rows
from ddtree.vllm.step import emitted_logit_rows, row_output_tokens, stop_token_rows

#: Logits elements per chunk of rows when applying penalties (vLLM counts every row's tokens over the whole
#: vocabulary in int64): ~512 MB at a time.
PENALTY_CHUNK_ELEMENTS = 1 << 26

#: vLLM's logprobs modes this sampler serves: the target's own distribution at each node. The processed
#: modes (after temperature, top-k, top-p) are refused at start-up (``ddtree.vllm.config.check_target``).
RAW_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A small host array on ``device`` without waiting for the GPU: a blocking copy from pageable memory
    synchronizes the stream first, so the sampler would wait for the verification it has just queued behind (and
    the walk, the commit and the drafter would be launched only after it). From pageable memory the driver stages
    the data before the call returns, so ``array`` may go right after."""
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)


def _processors(sampling_metadata, kind: str):
    """vLLM's built-in logits processors of one kind (``argmax_invariant`` / ``non_argmax_invariant``)."""
    return getattr(getattr(sampling_metadata, "logitsprocs", None), kind, ())


def _apply_penalties(logits, sampling_metadata, per_row, outputs) -> None:
    """vLLM's presence/frequency/repetition penalties, in place, each row over its own history ``outputs``
    (:func:`ddtree.vllm.step.row_output_tokens`), in chunks of rows to bound vLLM's per-row token counts."""
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    prompts = per_row(sampling_metadata.prompt_token_ids)
    presence = per_row(sampling_metadata.presence_penalties)
    frequency = per_row(sampling_metadata.frequency_penalties)
    repetition = per_row(sampling_metadata.repetition_penalties)
    step = max(1, PENALTY_CHUNK_ELEMENTS // (logits.shape[1] + 1))
    for lo in range(0, logits.shape[0], step):
        hi = min(lo + step, logits.shape[0])
        logits[lo:hi] = apply_all_penalties(
            logits[lo:hi], prompts[lo:hi], presence[lo:hi], frequency[lo:hi], repetition[lo:hi], outputs[lo:hi]
        )


def _logit_bias_entries(sampling_metadata, starts, counts, num_reqs):
    """``(rows, tokens, biases)`` of vLLM's logit_bias processor over every row of each biased request (None:
    no bias)."""
    rows, tokens, values = [], [], []
    for processor in _processors(sampling_metadata, "non_argmax_invariant"):
        if not isinstance(processor, LogitBiasLogitsProcessor):
            continue
        for index, biases in processor.biases.items():
            if index >= num_reqs or not biases:
                continue
            own = np.arange(starts[index], starts[index] + counts[index], dtype=np.int64)
            rows.append(np.repeat(own, len(biases)))
            tokens.append(np.tile(np.fromiter(biases.keys(), np.int64, len(biases)), own.shape[0]))
            values.append(np.tile(np.fromiter(biases.values(), np.float32, len(biases)), own.shape[0]))
    if not rows:
        return None
    return np.concatenate(rows), np.concatenate(tokens), np.concatenate(values)


def _sampled_positions(runner, metadata) -> Optional[torch.Tensor]:
    """``[rows]`` the absolute position of the token each logits row samples: its own token's position (the depth
    based one of a tree node, written before the forward; vLLM's corrected one under asynchronous scheduling) plus
    one, read on the device (None without a runner: the dummy sampler's callers)."""
    if runner is None:
        return None
    positions = runner.mrope_positions.gpu[0] if runner.uses_mrope else runner.positions
    return positions[metadata.logits_indices] + 1


def _rows_of_requests_without_trees(tokens, metadata, num_reqs: int, width: int) -> torch.Tensor:
    """vLLM's chain rows ``[num_reqs, width]`` int32 where a request without a tree (no drafts, or the dummy run)
    emits its last row's token; -1 elsewhere (the trees' rows are written over them)."""
    out = torch.full((num_reqs, width), -1, dtype=torch.int32, device=tokens.device)
    out[:, 0] = tokens[metadata.bonus_logits_indices].to(torch.int32)
    return out


class DraftlessStep(NamedTuple):
    """What :class:`DDTreeRejectionSampler` reads of vLLM's ``SpecDecodeMetadata``, for a step in which no request
    verifies drafts: one logits row per request, from the hidden state at ``logits_indices``."""

    num_draft_tokens: list
    max_spec_len: int
    bonus_logits_indices: torch.Tensor
    logits_indices: torch.Tensor

    @classmethod
    def of(cls, logits_indices: torch.Tensor) -> "DraftlessStep":
        num_reqs = int(logits_indices.shape[0])
        rows = torch.arange(num_reqs, device=logits_indices.device)
        return cls([0] * num_reqs, 0, rows, logits_indices)


class StepRows(NamedTuple):
    """A step's logits rows by request (read-only): ``counts[r]`` rows from ``starts[r]``, and the per-row repeat of
    per-request settings."""

    counts: np.ndarray
    starts: np.ndarray
    per_row: "PerRow"


#: Step rows kept by their drafts' counts: the usual step repeats its counts (and keeps the counts' upload).
_STEP_ROWS: Dict[tuple, StepRows] = {}
MAX_KEPT_STEP_ROWS = 64


def step_rows(num_draft_tokens: Sequence[int], device: torch.device) -> StepRows:
    """:class:`StepRows` of a step whose requests scheduled ``num_draft_tokens`` drafts each (one row more each)."""
    key = (tuple(num_draft_tokens), device)
    rows = _STEP_ROWS.get(key)
    if rows is None:
        counts = np.asarray(key[0], dtype=np.int64).reshape(-1) + 1
        starts = np.zeros_like(counts)
        np.cumsum(counts[:-1], out=starts[1:])
        counts.setflags(write=False)
        starts.setflags(write=False)
        rows = keep(_STEP_ROWS, key, StepRows(counts, starts, PerRow(counts, device)), MAX_KEPT_STEP_ROWS)
    return rows


class PerRow:
    """Per-request settings ``[num_reqs, ...]`` repeated for each of a request's ``counts[r]`` logits rows; the
    counts go to the device once, on first use (an all-greedy step needs no per-row settings)."""

    def __init__(self, counts: np.ndarray, device: torch.device):
        self.counts, self.device = counts, device
        self.num_rows = int(counts.sum())
        self._on_device: Optional[torch.Tensor] = None

    def __call__(self, t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if t is None:
            return None
        if self._on_device is None:
            self._on_device = _to_device(np.array(self.counts), self.device)  # (a writable copy for torch)
        # The host knows the output size: no device sync to count it.
        return t[: self.counts.shape[0]].repeat_interleave(self._on_device, dim=0, output_size=self.num_rows)


class DDTreeRejectionSampler(nn.Module):
    def __init__(self, runner):
        super().__init__()
        self._runner = weakref.ref(runner)

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        runner = self._runner()
        plan = runner._ddtree_plan if runner is not None else None
        num_reqs = len(metadata.num_draft_tokens)
        width = metadata.max_spec_len + 1
        counts, starts, per_row = step_rows(metadata.num_draft_tokens, logits.device)
        # min_tokens from the runner's counts: vLLM's processor drops a request early under asynchronous scheduling.
        min_tokens = runner.ddtree_min_tokens_pending(num_reqs, counts) if runner is not None else []
        sample_logits = self._constrained(
            logits, plan, sampling_metadata, per_row, starts, counts, num_reqs, min_tokens
        )
        min_p = None
        walks = plan is not None and runner.ddtree_device_accepts(plan)
        every_request = walks and plan.every_request(num_reqs)
        greedy_out = None
        if every_request and sampling_metadata.all_greedy:
            # The tokens go straight where the step's walk graph reads them (one copy launch fewer).
            greedy_out = runner.ddtree_walk_target(plan, width, int(logits.shape[0]))
        for processor in _processors(sampling_metadata, "argmax_invariant"):
            if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
                min_p = per_row(_to_device(processor.min_p_cpu[:num_reqs], logits.device))
        tokens = sample_rows(
            sample_logits,
            per_row(sampling_metadata.temperature),
            per_row(sampling_metadata.top_k),
            per_row(sampling_metadata.top_p),
            generators=sampling_metadata.generators,
            # (Per request, for seeded requests only: ~0.5 us a request of numpy scalars otherwise spent every step.)
            row_ranges=list(zip(starts.tolist(), counts.tolist())) if sampling_metadata.generators else None,
            all_greedy=sampling_metadata.all_greedy,
            min_p=min_p,
            # Seeded requests' noise by position (``seeded_noise``), each tree's vectors bounded by the drafter's depth.
            row_positions=_sampled_positions(runner, metadata) if sampling_metadata.generators else None,
            max_depth=plan.draft_depth if plan is not None and sampling_metadata.generators else None,
            greedy_out=greedy_out,
        )
        result = walked = None
        if walks:
            # Walked on the device: no wait here; the commit and the drafter are queued behind the verification.
            # Every request verifying a tree, its logits rows are its nodes, in order: the tokens as they are.
            walked = runner.ddtree_accept_on_device(
                plan, tokens if every_request else tokens[plan.logit_rows_gpu], width
            )
            if every_request:
                # The chain rows are the walk's, whole. A copy (one launch where filling them took five): the walk
                # graph's next replay rewrites its output, and vLLM still reads these rows then (the next step's
                # inputs, the copy to the host).
                out = walked["output_tokens"].clone()
            else:
                out = _rows_of_requests_without_trees(tokens, metadata, num_reqs, width)
                out[plan.batch_index_gpu] = walked["output_tokens"]
            runner.ddtree_output_to_host(out)
        elif plan is not None:
            out = _rows_of_requests_without_trees(tokens, metadata, num_reqs, width)
            # The step's first wait for the GPU (the verify's tail): its own profiler range.
            with record_function_or_nullcontext("ddtree: wait for the target's tokens"):
                node_tokens = tokens[plan.logit_rows_gpu].cpu().numpy()
            out[plan.batch_index_gpu] = runner.ddtree_accept(plan, node_tokens, width)["output_tokens"]
            result = runner._ddtree_accept
        else:
            out = _rows_of_requests_without_trees(tokens, metadata, num_reqs, width)
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            # Each request's last row (vLLM's ``bonus_logits_indices``), known on the host: no device read.
            last_rows = starts + counts - 1
            logprobs = self._logprobs(
                runner, plan, result, walked, metadata, logits, out, last_rows, sampling_metadata.max_num_logprobs
            )
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

    @staticmethod
    def _constrained(logits, plan, sampling_metadata, per_row, starts, counts, num_reqs, min_tokens):
        """``logits`` with the request's constraints at every node, in vLLM's order: allowed_token_ids (a
        per-request mask), bad words (over each node's own history: committed output plus its root path),
        logit_bias (per-request additive), min_tokens (stop tokens masked at nodes whose depth is below what
        the request still needs), then penalties over each node's own history. A copy when any applies: the
        raw rows stay for logprobs (vLLM's raw modes)."""
        allowed_only = sampling_metadata.allowed_token_ids_mask
        bad_words = {r: words for r, words in (sampling_metadata.bad_words_token_ids or {}).items() if r < num_reqs}
        bias = _logit_bias_entries(sampling_metadata, starts, counts, num_reqs)
        stop_rows, stop_tokens = stop_token_rows(plan, starts, min_tokens)
        penalties = not sampling_metadata.no_penalties
        if allowed_only is None and not bad_words and bias is None and not stop_rows.shape[0] and not penalties:
            return logits
        # fp32 like vLLM's sampler: its CUDA penalty op needs the logits in the penalties' dtype.
        constrained = logits.to(torch.float32, copy=True)
        device = logits.device
        if allowed_only is not None:
            constrained.masked_fill_(per_row(allowed_only), float("-inf"))
        outputs = None
        if bad_words or penalties:
            outputs = row_output_tokens(plan, sampling_metadata.output_token_ids, counts)
        if bad_words:
            from vllm.v1.sample.ops.bad_words import apply_bad_words

            by_row = {int(starts[r]) + k: words for r, words in bad_words.items() for k in range(int(counts[r]))}
            apply_bad_words(constrained, by_row, outputs)
        if bias is not None:
            rows, tokens, values = (_to_device(a, device) for a in bias)
            constrained.index_put_((rows, tokens), values.to(constrained.dtype), accumulate=True)
        if stop_rows.shape[0]:
            # The value made on the device: indexing with a Python float copies it there with a blocking copy.
            stops = (_to_device(stop_rows, device), _to_device(stop_tokens, device))
            constrained.index_put_(stops, constrained.new_full((), float("-inf")))
        if penalties:
            _apply_penalties(constrained, sampling_metadata, per_row, outputs)
        return constrained

    @staticmethod
    def _logprobs(runner, plan, result, walked, metadata, logits, out, last_rows_host, max_num_logprobs):
        """vLLM's ``LogprobsTensors`` for ``out`` (``[num_reqs * width]`` entries, rejected ones discarded by
        vLLM's ``parse_output``), from the raw logits row each token was sampled from (found on the device when
        the trees were walked there: ``walked``); ``last_rows_host``: each request's last logits row."""
        num_reqs, width = out.shape
        if walked is not None:
            last_rows = metadata.bonus_logits_indices[:num_reqs].to(logits.device)
            trees = plan.device_trees
            rows = device_accept.emitted_logit_rows(
                trees.node_offsets, plan.logit_rows_gpu, plan.batch_index_gpu, walked, last_rows, width
            ).reshape(-1)
        else:
            accepted = result.accepted if result is not None else None
            rows = emitted_logit_rows(plan, accepted, last_rows_host[:num_reqs], width)
            rows = _to_device(rows.reshape(-1), logits.device)
        chosen = logits[rows].to(torch.float32)
        sampler = runner.sampler
        if sampler.logprobs_mode not in RAW_LOGPROBS_MODES:
            raise RuntimeError(
                f"DDTree serves logprobs modes {RAW_LOGPROBS_MODES}, got {sampler.logprobs_mode!r} "
                "(refused at start-up; this is a bug)"
            )
        values = chosen if sampler.logprobs_mode == "raw_logits" else sampler.compute_logprobs(chosen)
        tokens = out.reshape(-1).to(torch.int64).clamp(min=0)  # -1 (discarded later) gathers token 0
        return sampler.gather_logprobs(values, max_num_logprobs, tokens)
