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

import numpy as np
import torch
import torch.nn as nn
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from ddtree.vllm.node_sampling import sample_rows
from ddtree.vllm.step import accept, emitted_logit_rows, row_output_tokens, stop_token_rows

#: Logits elements per chunk of rows when applying penalties (vLLM counts every row's tokens over the whole
#: vocabulary in int64): ~512 MB at a time.
PENALTY_CHUNK_ELEMENTS = 1 << 26

#: vLLM's logprobs modes this sampler serves: the target's own distribution at each node. The processed
#: modes (after temperature, top-k, top-p) are refused at start-up (``ddtree.vllm.config.check_target``).
RAW_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")


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
        logits[lo:hi] = apply_all_penalties(logits[lo:hi], prompts[lo:hi], presence[lo:hi], frequency[lo:hi],
                                            repetition[lo:hi], outputs[lo:hi])


class DDTreeRejectionSampler(nn.Module):
    def __init__(self, runner):
        super().__init__()
        self._runner = weakref.ref(runner)

    def forward(self, metadata, draft_probs, logits, sampling_metadata) -> SamplerOutput:
        runner = self._runner()
        plan = runner._ddtree_plan if runner is not None else None
        num_reqs = len(metadata.num_draft_tokens)
        width = metadata.max_spec_len + 1
        counts = np.asarray(metadata.num_draft_tokens, dtype=np.int64) + 1
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
        rows_per_req = torch.from_numpy(counts).to(logits.device)

        def per_row(t):
            if t is None:
                return None
            return t[:num_reqs].repeat_interleave(rows_per_req, dim=0)

        sample_logits = self._constrained(logits, plan, sampling_metadata, per_row, starts, counts, num_reqs)
        min_p = None
        for processor in _processors(sampling_metadata, "argmax_invariant"):
            if isinstance(processor, MinPLogitsProcessor) and processor.min_p_count:
                min_p = per_row(torch.from_numpy(processor.min_p_cpu[:num_reqs].copy()).to(logits.device))
        tokens = sample_rows(
            sample_logits,
            per_row(sampling_metadata.temperature),
            per_row(sampling_metadata.top_k),
            per_row(sampling_metadata.top_p),
            generators=sampling_metadata.generators,
            row_ranges=[(int(s), int(c)) for s, c in zip(starts, counts)],
            all_greedy=sampling_metadata.all_greedy,
            min_p=min_p,
        )
        out = torch.full((num_reqs, width), -1, dtype=torch.int32, device=logits.device)
        # Requests without a tree (no drafts, or the dummy run) emit their last row's token.
        out[:, 0] = tokens[metadata.bonus_logits_indices].to(torch.int32)
        result = None
        if plan is not None:
            node_tokens = tokens[plan.logit_rows_gpu].cpu().numpy()
            with runner.ddtree_stats.timed("accept"):
                result = accept(plan, node_tokens, width)
            out[plan.batch_index_gpu] = torch.from_numpy(result.output_tokens).to(logits.device, torch.int32)
            runner._ddtree_accept = result
        logprobs = None
        if sampling_metadata.max_num_logprobs is not None:
            logprobs = self._logprobs(runner, plan, result, metadata, logits, out, sampling_metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=out, logprobs_tensors=logprobs)

    @staticmethod
    def _constrained(logits, plan, sampling_metadata, per_row, starts, counts, num_reqs):
        """``logits`` with the request's constraints at every node, in vLLM's order: allowed_token_ids (a
        per-request mask), bad words (over each node's own history: committed output plus its root path),
        logit_bias (per-request additive), min_tokens (stop tokens masked at nodes whose depth is below what
        the request still needs), then penalties over each node's own history. The raw rows stay for logprobs
        (vLLM's raw modes)."""
        allowed_only = sampling_metadata.allowed_token_ids_mask
        constrained = logits if allowed_only is None else logits.masked_fill(per_row(allowed_only), float("-inf"))
        bad_words = {r: words for r, words in (sampling_metadata.bad_words_token_ids or {}).items() if r < num_reqs}
        outputs = None
        if bad_words or not sampling_metadata.no_penalties:
            outputs = row_output_tokens(plan, sampling_metadata.output_token_ids, counts)
        if bad_words:
            from vllm.v1.sample.ops.bad_words import apply_bad_words

            constrained = constrained.clone() if constrained is logits else constrained
            by_row = {int(starts[r]) + k: words for r, words in bad_words.items() for k in range(int(counts[r]))}
            apply_bad_words(constrained, by_row, outputs)
        pending, bias_rows, bias_tokens, bias_values = [], [], [], []
        for processor in _processors(sampling_metadata, "non_argmax_invariant"):
            if isinstance(processor, LogitBiasLogitsProcessor):
                for index, biases in processor.biases.items():
                    if index < num_reqs and biases:
                        rows = np.arange(starts[index], starts[index] + counts[index], dtype=np.int64)
                        bias_rows.append(np.repeat(rows, len(biases)))
                        bias_tokens.append(np.tile(np.fromiter(biases.keys(), np.int64, len(biases)), rows.shape[0]))
                        bias_values.append(np.tile(np.fromiter(biases.values(), np.float32, len(biases)), rows.shape[0]))
            elif isinstance(processor, MinTokensLogitsProcessor):
                pending += [(index, min_tokens - len(output), stops)
                            for index, (min_tokens, output, stops) in processor.min_toks.items() if index < num_reqs]
        if bias_rows:
            constrained = constrained.clone() if constrained is logits else constrained
            index = (torch.from_numpy(np.concatenate(bias_rows)).to(logits.device),
                     torch.from_numpy(np.concatenate(bias_tokens)).to(logits.device))
            constrained.index_put_(index, torch.from_numpy(np.concatenate(bias_values)).to(logits.device, logits.dtype),
                                   accumulate=True)
        rows, stop_tokens = stop_token_rows(plan, starts, pending)
        if rows.shape[0]:
            constrained = constrained.clone() if constrained is logits else constrained
            constrained[torch.from_numpy(rows).to(logits.device), torch.from_numpy(stop_tokens).to(logits.device)] = (
                float("-inf"))
        if not sampling_metadata.no_penalties:
            constrained = constrained.clone() if constrained is logits else constrained
            _apply_penalties(constrained, sampling_metadata, per_row, outputs)
        return constrained

    @staticmethod
    def _logprobs(runner, plan, result, metadata, logits, out, max_num_logprobs):
        """vLLM's ``LogprobsTensors`` for ``out`` (``[num_reqs * width]`` entries, rejected ones discarded by
        vLLM's ``parse_output``), from the raw logits row each token was sampled from."""
        num_reqs, width = out.shape
        last_rows = metadata.bonus_logits_indices.cpu().numpy()[:num_reqs]
        rows = emitted_logit_rows(plan, result.accepted if result is not None else None, last_rows, width)
        chosen = logits[torch.from_numpy(rows.reshape(-1)).to(logits.device)].to(torch.float32)
        sampler = runner.sampler
        if sampler.logprobs_mode not in RAW_LOGPROBS_MODES:
            raise RuntimeError(f"DDTree serves logprobs modes {RAW_LOGPROBS_MODES}, got {sampler.logprobs_mode!r} "
                               "(refused at start-up; this is a bug)")
        values = chosen if sampler.logprobs_mode == "raw_logits" else sampler.compute_logprobs(chosen)
        tokens = out.reshape(-1).to(torch.int64).clamp(min=0)  # -1 (discarded later) gathers token 0
        return sampler.gather_logprobs(values, max_num_logprobs, tokens)
