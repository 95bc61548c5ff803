"""The model card (README.md beside the checkpoints) from the run's metrics dictionary."""

from __future__ import annotations

from typing import Dict, List

BUDGETS = (16, 32, 64, 128, 256)
#: The held-out chain tau a pair must reach unless the run names another (``--goal-chain-tau``): the first pair's.
CHAIN_TAU_GOAL = 2.5

#: Dotted paths into the metrics dictionary that the card must report.
REQUIRED = (
    "data.source",
    "data.files.train",
    "data.files.heldout",
    "data.tokens.train",
    "data.tokens.heldout",
    "data.vocab_size",
    "target.steps",
    "target.final_loss",
    "target.heldout.perplexity",
    "target.heldout.loss",
    "target.parameters",
    "drafter.steps",
    "drafter.final_loss",
    "drafter.parameters",
    "eval.prompts",
    "eval.new_tokens",
    "eval.modes.chain.tau",
    *(f"eval.modes.ddtree-{b}.tau" for b in BUDGETS),
    *(f"eval.modes.ddtree-{b}.ratio_to_chain" for b in BUDGETS),
    "eval.gpu_bf16.prompts_agreeing_128",
)


def lookup(metrics: Dict, path: str):
    node = metrics
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def missing_fields(metrics: Dict) -> List[str]:
    """Required entries absent from ``metrics`` (an empty list when the card is complete)."""
    return [path for path in REQUIRED if lookup(metrics, path) is None]


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "MISSING"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _optional(metrics: Dict, path: str, prefix: str) -> str:
    """``prefix + value`` for an entry that only some runs have; nothing (not MISSING) when absent."""
    value = lookup(metrics, path)
    return "" if value in (None, "", [], {}) else f"{prefix}{value}"


def _file_lines(files: Dict) -> List[str]:
    """One line per shipped file with its size, grouped by model directory."""
    if not files:
        return ["MISSING"]
    return [
        f"- `{sub}/{name}`: {size:,} bytes"
        for sub, names in sorted(files.items())
        for name, size in sorted(names.items())
    ]


def render(metrics: Dict) -> str:
    """Markdown model card. Absent numbers are printed as MISSING and listed at the end."""
    g = lambda path, digits=3: _fmt(lookup(metrics, path), digits)  # noqa: E731
    chain = lookup(metrics, "eval.modes.chain.tau")
    lines = [
        "# ddtree test pair: small Qwen3.5-hybrid target + DFlash drafter",
        "",
        "Trained by `python -m ddtree.training run` (ddtree/python/ddtree/training) so that acceptance numbers "
        "mean something. Not a useful language model: a few million parameters trained for minutes.",
        "",
        f"Command: `{g('command')}`  ",
        f"Seed {g('seed')}; device {g('device')}; torch {g('versions.torch')}, transformers "
        f"{g('versions.transformers')}; wall time {g('wall_seconds', 0)} s.",
        "",
        "## Data",
        f"- Source: CPython standard library sources and the documentation shipped with it (`.py`, `.txt`, `.rst`) "
        f"from `{g('data.source')}`.",
        f"- Split by sha256 of the relative path: {g('data.files.train')} train files "
        f"({g('data.tokens.train')} tokens), {g('data.files.heldout')} held-out files ({g('data.tokens.heldout')} "
        f"tokens). The tokenizer and both models saw only the train split.",
        f"- Tokenizer: byte-level BPE, vocabulary {g('data.vocab_size')}, trained on the train split; "
        "`<|endoftext|>` = 0 (document separator, EOS), `<|mask|>` = 1 (DFlash mask), `<|pad|>` = 2.",
        "",
        "## Target (`target/`)",
        f"- `Qwen3_5ForConditionalGeneration` layout (text weights only), {g('target.parameters')} parameters, "
        f"bf16 safetensors. {g('target.architecture')}",
        f"- {g('target.steps')} steps, batch {g('target.batch_size')} x {g('target.seq_len')} tokens, "
        f"peak LR {g('target.peak_lr')}, AdamW, bf16 autocast; {g('target.train_seconds', 0)} s.",
        f"- Train loss: first logged {g('target.first_loss')}, final {g('target.final_loss')} (nats/token).",
        f"- Held-out (fp32, bf16-rounded weights, {g('target.heldout.tokens')} tokens): loss "
        f"{g('target.heldout.loss')} nats, **perplexity {g('target.heldout.perplexity', 2)}**.",
        "",
        "## Drafter (`drafter/`)",
        f"- DFlash (`DFlashDraftModel`), {g('drafter.layers')} layers, block size {g('drafter.block_size')}, "
        f"context from target layers {g('drafter.target_layer_ids')}, {g('drafter.parameters')} parameters "
        "(shares the target's embedding and LM head).",
        f"- Frozen target, {g('drafter.anchors')} random anchors per sequence, CE on block positions 1..15 weighted "
        f"exp(-(k-1)/{g('drafter.gamma', 1)}); sequences: {g('drafter.raw_fraction', 2)} raw train text, the rest "
        f"{g('drafter.generated')} target greedy continuations of train prompts (prompt + continuation tokens: "
        f"{g('drafter.generated_shape')}); labels: {g('drafter.labels')} (target: the target's greedy next token).",
        f"- {g('drafter.steps')} steps, batch {g('drafter.batch_size')} x {g('drafter.seq_len')}; loss first "
        f"{g('drafter.first_loss')}, final {g('drafter.final_loss')}; teacher-forced chain tau over the random anchors of "
        f"the last training batches {g('drafter.final_tf_tau')} (training data, every anchor weighted alike: not the "
        f"engine's tau); held-out chain tau before the evaluation (teacher-forced on the target's greedy output, "
        f"walked as the engine's steps) {g('drafter.heldout_chain_tau')}; {g('drafter.train_seconds', 0)} s.",
        "",
        "## Acceptance on held-out prompts (ddtree.engine, temperature 0)",
        f"Engine on {g('eval.engine_device')} in fp32; {g('eval.prompts')} prompts of {g('eval.prompt_length')} tokens from distinct held-out files, "
        f"{g('eval.new_tokens')} new tokens each. tau = tokens per verification step (accepted drafts + bonus), "
        "pooled over all steps.",
        "",
        "| mode | tau | ratio to chain | steps | output = AR greedy |",
        "|---|---|---|---|---|",
        f"| DFlash chain (15 drafts) | {g('eval.modes.chain.tau')} | 1.000 | {g('eval.modes.chain.steps')} | "
        f"{g('eval.modes.chain.lossless')} |",
    ]
    for b in BUDGETS:
        key = f"eval.modes.ddtree-{b}"
        lines.append(
            f"| DDTree budget {b} | {g(key + '.tau')} | {g(key + '.ratio_to_chain')} | "
            f"{g(key + '.steps')} | {g(key + '.lossless')} |"
        )
    target_tau = metrics.get("goal_chain_tau", CHAIN_TAU_GOAL)  # the run's --goal-chain-tau
    goal = "MISSING" if chain is None else ("met" if chain >= target_tau else "NOT met")
    lines += [
        "",
        f"Goal chain tau >= {target_tau}: **{goal}**.",
        "",
        "## Greedy robustness (fp32 CPU vs bf16 GPU)",
        f"- bf16 on the GPU (transformers `generate`) reproduces the fp32 CPU greedy output for >= 128 tokens on "
        f"**{g('eval.gpu_bf16.prompts_agreeing_128')} of {g('eval.gpu_bf16.prompts')}** prompts; common prefix "
        f"per prompt: {g('eval.gpu_bf16.common_prefix')}.{_optional(metrics, 'eval.gpu_bf16.skipped', ' Skipped: ')}",
        f"- The engine's own greedy reference ({g('eval.engine_device')} fp32) equals the fp32 CPU greedy output "
        f"(transformers `generate`) for >= 128 tokens on {g('eval.engine_ar_vs_cpu_fp32.prompts_agreeing_128')} of "
        f"{g('eval.engine_ar_vs_cpu_fp32.prompts')} prompts.",
        f"- Top-1 minus top-2 logit along the fp32 greedy outputs: min {g('eval.margins.min')}, 1st percentile "
        f"{g('eval.margins.p01')}, median {g('eval.margins.median')}; {g('eval.margins.below_tenth')} of "
        f"{g('eval.margins.count')} positions below 0.1.",
        "",
        "## Files",
        *_file_lines(metrics.get("files") or {}),
    ]
    skipped, error = lookup(metrics, "eval.skipped"), lookup(metrics, "eval.error")
    if skipped:
        lines += ["", f"Evaluation skipped (time box): {', '.join(skipped)}."]
    if error:
        lines += ["", f"Evaluation error: {error}."]
    missing = missing_fields(metrics)
    if missing:
        lines += ["", "## Missing numbers", ", ".join(missing)]
    return "\n".join(lines) + "\n"
