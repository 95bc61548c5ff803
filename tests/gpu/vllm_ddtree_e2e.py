"""GPU end-to-end check of the DDTree vLLM adapter (not collected by pytest: run it directly).

    python tests/gpu/vllm_ddtree_e2e.py [--out DIR] [--model tiny-qwen3|tiny-qwen3-next|tiny-qwen3-next-all-experts|DIR]
                                        [--engines ...]

Builds a tiny random target (attention-only Qwen3, or hybrid Qwen3-Next with
Gated-DeltaNet and MoE layers) and a random DFlash drafter -- or takes a model
pair from DIR (``DIR/target``, ``DIR/drafter``, prompts from ``DIR/prompts.json``
when present: ``{"batch32": [[ids]...], "near_max": [ids]}``) -- then runs, each
engine in its own subprocess (a crash or hang of one does not hide the others):

  plain       vLLM greedy, no speculation (TRITON_ATTN, logprobs=2 for top-2 gaps)
  dflash      vLLM's own DFlash chain, 15 draft tokens
  ddtree16    method "ddtree", budget 16 (ddtree64 likewise): the defaults (with one GPU vLLM's asynchronous
              scheduling, the tree walk on the device, trees built at the next verification)
  ddtree256   method "ddtree", budget 256 (= vocab: every first-level candidate is in the tree)
  ddtree63, ddtree255  budgets 2^k - 1, the recommended ones (trees of whole 16-row kernel blocks)
  ddtree64-preempt  budget 64 with a KV cache small enough to force preemption (ddtree64-async-preempt: the same
                    with DDTREE_ASYNC_SCHEDULING=1 set explicitly)
  ddtree64to16 a budget schedule: 64 below 8 drafting requests, 16 from 8 on (each in FULL graphs of its trees)
  ddtree64-host     budget 64 with the tree walk on the host and trees built at proposal (both switches 0)
  ddtree64-device   budget 64 with the tree walk on the device only (DDTREE_LATE_TREES=0)
  ddtree64-late     the device walk plus trees built at the next verification, synchronous scheduling
  ddtree64-async    the TP-1 default: vLLM's asynchronous scheduling (DDTREE_ASYNC_SCHEDULING=1), steady steps'
                    trees built on the GPU (the device plan, on by default: the run must show it)
  ddtree64-async-topk-graphs  ddtree64-async with DDTREE_TOPK_GRAPHS=1 (the drafter's top-K as CUDA graphs)
  ddtree64-async-device-plan  ddtree64-async with DDTREE_DEVICE_PLAN=1 (steady steps' trees built on the GPU, as
                    the default does where it can, set so the run must show it)
  ddtree64-async-host-plan  ddtree64-async with DDTREE_DEVICE_PLAN=0 (every step's trees built on the host), FULL
                    steps' forwards queued before their trees (DDTREE_LAUNCH_AHEAD=always: the pair's drafter
                    lands before the host reaches the step, where the default does not gate); run beside
                    ddtree64-async, its outputs must equal that engine's token for token (abort's apart)
  ddtree64-async-sliding-drafter  ddtree64-async with the drafter's layers made sliding-window (8) but the last,
                    under DDTREE_SLIDING_DRAFTER=1 (the released Qwen3.6-27B drafter's layer kinds)
  ddtree64-async-precapture-all  ddtree64-async with DDTREE_PRECAPTURE=all (the commit's graphs at start-up too)
  ddtree64-async-lazy  ddtree64-async with DDTREE_PRECAPTURE=0 (placement and walk graphs captured at each size's
                    first step, not at start-up)
  ddtree64-async-copies  ddtree64-async with DDTREE_COMMIT_IN_PLACE=0 (commit graphs copy the walk's paths; the
                    default reads them in place)
  ddtree64to16-async the schedule under vLLM's asynchronous scheduling (its scheduler places each budget in drafts)
  ddtree-auto       ddtree_budget "auto" (candidates 15, 31, 63), each batch size's budget chosen live
  plain-apc, ddtree64-apc  vLLM's prefix caching on (vLLM's default and ddtree's for attention-only targets:
                    --model tiny-qwen3; plain-apc asks for it, ddtree64-apc leaves it unset; the other engines turn
                    it off), checked against plain without it, and required
                    to hit the prefix cache in the shared_prefix scenario
  plain-hpc, ddtree64-async-hpc, ddtree64-late-hpc  prefix caching with a hybrid target (vLLM's mamba cache mode
                    "align"; --model the trained pair or tiny-qwen3-next): vLLM's own, and ddtree's under
                    DDTREE_HYBRID_PREFIX_CACHING=1 (asynchronous, synchronous), required to start second turns
                    from state blocks that tree steps wrote (second_turns) and to run boundary commits;
                    ddtree64-async-hpc-preempt the asynchronous one on 40 blocks (batch32, preemption required)

Scenarios per engine: batch 1 (3 prompts one at a time), batch 16 (the first 16
prompts of batch 32, 48 tokens each), batch 32 (mixed prompt lengths and max_tokens), a prompt 120 tokens below
max_model_len decoded to its end (whole trees, then trees cut to what still fits), one_token_prompts (batch 32's
prompts, then 8 one-token prompts queued behind them: admitted beside decoding requests, their first decodes are
padded by vLLM with placeholders no proposal stands behind, which must verify filler trees), stop tokens that end
requests mid-tree, the same stop tokens held back by min_tokens, greedy under a logit_bias and under penalties, requests aborted
mid-tree (survivors and a later batch must be
unaffected), temperature 1 with per-request seeds (run twice, then once more with the first request alone for a few
steps and the rest arriving beside its trees: all three must agree), and shared_prefix: 8 prompts that share
their first SHARED_PREFIX tokens, sent together, then again, then as a second turn that appends each one's first
answer and a few new tokens (with prefix caching: hits on blocks whose K/V trees wrote and moved); and, where the
target is a hybrid, second_turns: 8 prompts of 96 tokens decoded for 240, then second turns that append each
answer (with hybrid prefix caching: hits on state blocks that tree steps wrote); and, where the
pair has a tokenizer (the trained pair), structured: 8 greedy requests under two regexes (words; a JSON object)
(DDTREE_STRUCTURED_OUTPUTS=1 for every ddtree engine), each ended by its grammar, compared with plain's (the fp32
judge replays each row under its regex: the settings kept with the outputs say which).

Checks: greedy outputs equal plain's, a divergence allowed only where plain's
top-2 logprob gap is below --gap-tol (counted and reported); ddtree's logprobs
of its emitted tokens within --logprob-tol of plain's; ddtree's mean
acceptance length >= dflash's; seeded temperature-1 outputs reproducible.
Everything goes to DIR/vllm_ddtree_e2e.log and DIR/vllm_ddtree_e2e.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
from engine_turns import add_arguments as add_turn_arguments  # noqa: E402
from engine_turns import engine_arguments, kv_cache_kwargs, memory_share, new_gate, run_in_turns  # noqa: E402
from engine_turns import wait_for_turn  # noqa: E402

WORK = "/tmp/ddtree_e2e"
MAX_MODEL_LEN = 1024
#: The near_max scenario's room below max_model_len: its request verifies whole trees first, then trees the
#: scheduler cuts to what still fits (with 20 tokens of room, as before version 2, only one or two trees at all).
NEAR_MAX_ROOM = 120
#: Scenarios whose prompts or lengths changed, by version: results of another version are not reused or judged.
SCENARIO_VERSIONS = {"near_max": 2}
MAX_TOKENS = 48
STOP_TOKENS = list(range(2, 12))
MIN_P = 0.3
#: Greedy scenarios whose sampling settings change the argmax (``fp32_reference.py`` replays them): the stop
#: scenario's ten stop tokens (~4% of a 256-token vocabulary each step) end most requests inside an accepted
#: path; min_tokens holds them back for 24 tokens (tree nodes mask them by depth); a bias that flips some
#: argmaxes and penalties that count each node's own history must reach every node.
CONSTRAINED_SCENARIOS = {
    "stop": dict(stop=STOP_TOKENS),
    "min_tokens": dict(stop=STOP_TOKENS, min_tokens=24),
    # Small biases that flip an argmax now and then, and bans of 22 common tokens that every node must see.
    "logit_bias": dict(logit_bias={5: 4.0, 7: 2.5, 9: -6.0, **{t: -100.0 for t in range(10, 32)}}),
    "penalties": dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.3),
}


SAMPLED_SCENARIOS = ("t1", "min_p")  # not compared token by token with plain

#: The structured scenario's grammars (a model pair with a tokenizer only: vLLM needs one for structured outputs):
#: greedy requests, each ended by its grammar: a few words, and a short JSON object written as a regex (a JSON schema
#: under vLLM's default free whitespace lets the trained pair indent for as long as it may: greedy decoding there
#: emits a newline and spaces without end, on the reference engine).
STRUCTURED_REGEXES = (r"[a-z]{1,8}( [a-z]{1,8}){2,4}\.", r'\{"name": "[a-z_]{1,16}", "count": [0-9]{1,4}\}')
STRUCTURED_MAX_TOKENS = 96


def has_tokenizer(target: str) -> bool:
    """Whether the target directory holds a tokenizer (the trained pair's does; the tiny random models have none)."""
    return any(os.path.exists(os.path.join(target, name)) for name in ("tokenizer.json", "tokenizer_config.json"))


def min_p_respected(rows, slack: float = 1e-3) -> bool:
    """Every emitted token's raw logprob is at most ``-log(MIN_P)`` below its row's top (False without logprobs)."""
    import math

    pairs = [(c, t) for r in rows if r.get("top") for c, t in zip(r["logprobs"], r["top"])]
    floor = math.log(MIN_P) - slack
    return bool(pairs) and all(c is not None and c - t >= floor for c, t in pairs)


def log(msg, fh=None):
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    if fh is not None:
        fh.write(line + "\n")
        fh.flush()


def prompts(vocab, given=None, seed=0):
    """Random token prompts (or ``given``: a pair's own prompts), the same for every engine."""
    import random

    rnd = random.Random(seed)
    lens = [rnd.randint(4, 300) for _ in range(32)]
    lens[3] = 1  # a one-token prompt
    batch32 = [[rnd.randrange(2, vocab - 1) for _ in range(n)] for n in lens]
    # Drawn at version 1's length, so that the draws after it (max_tokens) stay what earlier runs used.
    near_max = [rnd.randrange(2, vocab - 1) for _ in range(MAX_MODEL_LEN - 20)][: MAX_MODEL_LEN - NEAR_MAX_ROOM]
    if given:
        batch32 = [list(p) for p in given["batch32"]][:32]
        near_max = list(given["near_max"])[: MAX_MODEL_LEN - NEAR_MAX_ROOM]
    max_tokens = [rnd.randint(17, 64) for _ in range(32)]
    return dict(
        batch1=batch32[:3],
        batch32=batch32,
        max_tokens=max_tokens,
        near_max=near_max,
        stop=batch32[:8],
        t1=batch32[8:16],
        one_token=one_token_prompt_set(batch32),
    )


#: The one_token_prompts scenario's one-token prompts, after batch32's 32 (which fill max_num_seqs): each waits until
#: a longer request finishes, so it is admitted while the others decode, and vLLM pads its first decode (its only
#: prompt token) to a whole tree of placeholders, which the drafter never proposed for.
ONE_TOKEN_PROMPTS = 8


def one_token_prompt_set(batch32):
    """The one_token_prompts scenario's prompts: batch32's, then the first token of each of its first
    ``ONE_TOKEN_PROMPTS``."""
    return [list(p) for p in batch32] + [[p[0]] for p in batch32[:ONE_TOKEN_PROMPTS]]


def is_gdn_target(target: str) -> bool:
    """Whether the target is a hybrid with Gated DeltaNet layers (its prefixes cache per state block)."""
    from ddtree.vllm.config import GDN_ARCHITECTURES

    return model_info(target)[0] in GDN_ARCHITECTURES


def model_info(target):
    """(architecture, vocab size) from the target's config.json."""
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    text = cfg.get("text_config", cfg)
    return cfg["architectures"][0], int(text["vocab_size"])


def ddtree_spec(budget) -> dict:
    """The speculative config of a ddtree engine: the drafter's 15 positions and ``budget`` (a number, a schedule by
    batch size, or "auto")."""
    return {"method": "ddtree", "num_speculative_tokens": 15, "ddtree_budget": budget}


def async_ddtree(budget=64, **switches) -> dict:
    """A ddtree engine under vLLM's asynchronous scheduling (the TP-1 default, set explicitly so the run must show
    it) with the DDTREE_* ``switches`` given."""
    return dict(spec=ddtree_spec(budget), env={"DDTREE_ASYNC_SCHEDULING": "1", **switches})


ENGINES = {
    "plain": dict(spec=None),
    "dflash": dict(spec={"method": "dflash", "num_speculative_tokens": 15}),
    "ddtree16": dict(spec=ddtree_spec(16)),
    "ddtree64": dict(spec=ddtree_spec(64)),
    # Tensor parallelism over 2 GPUs: compared with plain (TP 1) and with the same engine at TP 1.
    "ddtree64-tp2": dict(spec=ddtree_spec(64), tp=2),
    "plain-tp2": dict(spec=None, tp=2),
    "ddtree256": dict(spec=ddtree_spec(256)),
    # Budgets 2^k - 1 (the recommended ones): trees of whole 16-row kernel blocks, no partly filled last block.
    "ddtree63": dict(spec=ddtree_spec(63)),
    "ddtree255": dict(spec=ddtree_spec(255)),
    # A budget schedule: 64 below 8 drafting requests, 16 from 8 on, each budget in FULL graphs of its own trees.
    "ddtree64to16": dict(spec=ddtree_spec({"1": 64, "8": 16})),
    # ddtree_budget "auto" (candidates 15, 31, 63): each batch size's budget chosen live, changing mid-run.
    "ddtree-auto": dict(spec=ddtree_spec("auto")),
    # The host paths the TP-1 defaults replaced (the tree walk on the host, trees built at proposal).
    "ddtree64-host": dict(
        spec=ddtree_spec(64),
        env={"DDTREE_DEVICE_ACCEPT": "0", "DDTREE_LATE_TREES": "0"},
    ),
    # The tree walk on the device, trees built at proposal.
    "ddtree64-device": dict(
        spec=ddtree_spec(64),
        env={"DDTREE_DEVICE_ACCEPT": "1", "DDTREE_LATE_TREES": "0"},
    ),
    # ... and the trees built at the next verification (vLLM schedules placeholder drafts), synchronously: the TP-1
    # default before asynchronous scheduling became it.
    "ddtree64-late": dict(
        spec=ddtree_spec(64),
        env={"DDTREE_DEVICE_ACCEPT": "1", "DDTREE_LATE_TREES": "1", "DDTREE_ASYNC_SCHEDULING": "0"},
    ),
    # 160 blocks held 16,384 tokens of the pair's cache (attention blocks of 144 tokens sized to the GDN state's
    # page) and batch 32 never preempted (2026-12-02); 40 blocks hold ~4,096, under batch 32's ~7,500.
    # vLLM's asynchronous scheduling (the TP-1 default, set explicitly): the trees arrive after vLLM's metadata builds,
    # steady steps' built on the device (the device plan's default, auto: the harness checks that it ran). The
    # commit reading a replayed walk's paths in place and the start-up captures of the placement and walk graphs
    # are defaults; set here so the run must show them.
    "ddtree64-async": async_ddtree(DDTREE_COMMIT_IN_PLACE="1", DDTREE_PRECAPTURE="1"),
    # ... with the drafter's top-K replayed as CUDA graphs (DDTREE_TOPK_GRAPHS=1, experimental).
    "ddtree64-async-topk-graphs": async_ddtree(DDTREE_TOPK_GRAPHS="1"),
    # ... with steady steps' trees built and laid out on the GPU, set explicitly (DDTREE_DEVICE_PLAN=1: what the
    # default, auto, does where the engine allows it; the run must show device-planned steps).
    "ddtree64-async-device-plan": async_ddtree(DDTREE_DEVICE_PLAN="1"),
    # ... with steps of some of a proposal's requests in any order (after a request ends) left to the host plan
    # (DDTREE_DEVICE_PLAN_SUBSETS=0; on by default since gpu-h100-e2e-subsets-0cecefa).
    "ddtree64-async-no-subsets": async_ddtree(DDTREE_DEVICE_PLAN="1", DDTREE_DEVICE_PLAN_SUBSETS="0"),
    # ... with the walk of a step with a prefill beside the trees replayed as a graph too, set explicitly so that the
    # run must show replays (the default since gpu-h100-e2e-arrivals-b5124aa; DDTREE_MIXED_WALK_GRAPHS=0 walks op by op).
    "ddtree64-async-mixed-walk-graphs": async_ddtree(DDTREE_MIXED_WALK_GRAPHS="1"),
    # ... with such steps walked op by op (DDTREE_MIXED_WALK_GRAPHS=0; still the path of cut trees and mixed sizes).
    "ddtree64-async-op-walk": async_ddtree(DDTREE_MIXED_WALK_GRAPHS="0"),
    # ... with every step's trees built on the host (DDTREE_DEVICE_PLAN=0, the default before 9e8b443's record),
    # and FULL steps' forwards queued before their trees on every such step (DDTREE_LAUNCH_AHEAD=always: the pair's
    # drafter lands before the host reaches the step, where the default does not gate).
    "ddtree64-async-host-plan": async_ddtree(
        DDTREE_DEVICE_PLAN="0", DDTREE_LAUNCH_AHEAD="always", DDTREE_COMMIT_IN_PLACE="1", DDTREE_PRECAPTURE="1"
    ),
    # ... with the pair's drafter made to mix sliding-window (8 positions) and full-attention layers, as the released
    # Qwen3.6-27B drafter does (DDTREE_SLIDING_DRAFTER=1, experimental): exact outputs, and an acceptance that shows
    # the window applied: ddtree's reference engine (fp32, CPU) accepts 2.78 tokens a step with this drafter on
    # batch16's prompts and 3.48 with the pair's own, 0.80 of it (cpu-sliding-reference-5eb816c): run it beside
    # ddtree64-async and compare the ratio.
    "ddtree64-async-sliding-drafter": dict(async_ddtree(DDTREE_SLIDING_DRAFTER="1"), sliding_window=8),
    # ... with the commit's graphs (GDN commit with the K/V moves) captured at start-up too (DDTREE_PRECAPTURE=all).
    "ddtree64-async-precapture-all": async_ddtree(DDTREE_PRECAPTURE="all"),
    # ... with the placement and walk graphs captured at each size's first step instead (DDTREE_PRECAPTURE=0).
    "ddtree64-async-lazy": async_ddtree(DDTREE_PRECAPTURE="0"),
    # ... with the commit graphs copying the walk's paths, the K/V moved apart (DDTREE_COMMIT_IN_PLACE=0).
    "ddtree64-async-copies": async_ddtree(DDTREE_COMMIT_IN_PLACE="0"),
    # ... with a budget schedule (vLLM's asynchronous scheduler places each step's budget in drafts).
    "ddtree64to16-async": async_ddtree({"1": 64, "8": 16}),
    # vLLM's prefix caching (on by vLLM's default for attention-only targets, ddtree's too; the other engines turn
    # it off); ddtree refuses it for hybrid targets: run these with --model tiny-qwen3. plain-apc asks for it;
    # ddtree64-apc leaves it unset ("default"), so the run shows what a user who sets nothing gets.
    "plain-apc": dict(spec=None, prefix_caching=True),
    "ddtree64-apc": dict(spec=ddtree_spec(64), prefix_caching="default"),
    # Prefix caching with a hybrid target (vLLM's mamba cache mode "align"): run these with a hybrid target (the
    # trained pair, tiny-qwen3-next). plain-hpc is vLLM's own align mode (no speculation); the ddtree engines cache
    # hybrid prefixes under DDTREE_HYBRID_PREFIX_CACHING=1 (boundary commits), asynchronously and synchronously. Their
    # second_turns requests must start from state blocks that tree steps wrote.
    "plain-hpc": dict(spec=None, prefix_caching=True, hybrid_prefix=True),
    "ddtree64-async-hpc": dict(async_ddtree(DDTREE_HYBRID_PREFIX_CACHING="1"), prefix_caching=True, hybrid_prefix=True),
    "ddtree64-late-hpc": dict(
        spec=ddtree_spec(64),
        env={"DDTREE_HYBRID_PREFIX_CACHING": "1", "DDTREE_ASYNC_SCHEDULING": "0"},
        prefix_caching=True,
        hybrid_prefix=True,
    ),
    # ... and preempted (vLLM frees a preempted request's state blocks; it resumes from the cache's).
    "ddtree64-async-hpc-preempt": dict(
        async_ddtree(DDTREE_HYBRID_PREFIX_CACHING="1"),
        prefix_caching=True,
        hybrid_prefix=True,
        num_gpu_blocks_override=40,
        only=("batch32",),
    ),
    "ddtree64-preempt": dict(
        spec=ddtree_spec(64),
        num_gpu_blocks_override=40,
        only=("batch32",),
    ),
    # Preemption under asynchronous scheduling (it takes effect a step late there), with the default device plan
    # (a resumed request's first step is planned on the host, the steps after it on the device).
    "ddtree64-async-preempt": dict(
        async_ddtree(),
        num_gpu_blocks_override=40,
        only=("batch32",),
    ),
}


# ---------------------------------------------------------------------------------------------
# Child: one engine, all scenarios, JSON on stdout (last line).
#: Engines started side by side when ``--concurrent-starts`` is not given (the 27B-free tiny and pair engines fit
#: one H200 several times over with the fixed KV cache that side-by-side starts get).
SIDE_BY_SIDE = 4

#: Tokens the shared_prefix scenario's prompts share (4 of tiny-qwen3's 16-token blocks; its second turns share
#: their whole first prompt and answer, 100-270 tokens).
SHARED_PREFIX = 64
#: Its requests per round (three rounds: the prompts, the same again, the second turns).
SHARED_PREFIX_REQUESTS = 8


#: The arrivals scenario: requests that decode long (their trees verified step after step) while short requests
#: arrive one at a time, each once the last has finished and the long ones have verified trees alone for
#: ``ARRIVAL_QUIET_STEPS`` steps: every arrival's prefill runs beside the same number of trees of one size, so that
#: with ``DDTREE_MIXED_WALK_GRAPHS`` its walk replays one graph from the second arrival on (the harness's other
#: scenarios submit their requests together: at most a mixed step or two, each a first run).
ARRIVALS_LONG, ARRIVALS_SHORT = 4, 6
ARRIVALS_LONG_TOKENS, ARRIVALS_SHORT_TOKENS = 6 * MAX_TOKENS, 12
ARRIVAL_QUIET_STEPS = 2


def run_arrivals(engine, long_requests, short_requests, quiet_steps: int = ARRIVAL_QUIET_STEPS, max_steps=100_000):
    """Drives ``engine`` (vLLM's ``LLMEngine``: ``add_request``, ``step``, ``has_unfinished_requests``) through the
    arrivals scenario: ``long_requests`` (``(id, prompt, params)`` each) added at once, then ``short_requests`` one
    at a time, each after ``quiet_steps`` steps without a short request (the one before it finished). Returns the
    finished outputs by id and, by short request, ``(the step it was first in, long requests still running)``."""
    for rid, prompt, params in long_requests:
        engine.add_request(rid, prompt, params)
    waiting, finished, arrived = list(short_requests), {}, {}
    last, quiet = None, 0
    for step in range(max_steps):
        if not waiting and not engine.has_unfinished_requests():
            return finished, arrived
        alone = last is None or last in finished  # (no short request in this step)
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        quiet = quiet + 1 if alone else 0
        if waiting and quiet >= quiet_steps:
            last, prompt, params = waiting.pop(0)
            engine.add_request(last, prompt, params)
            running = sum(rid not in finished for rid, _, _ in long_requests)
            arrived[last], quiet = (step + 1, running), 0
    raise RuntimeError(f"the arrivals scenario did not finish in {max_steps} engine steps")


def second_turn(prompt, answer):
    """The shared_prefix scenario's third round: a prompt, its first answer and three new tokens."""
    return list(prompt) + list(answer) + [5, 6, 7]


def shared_prefix_prompts(prompts, shared: int, count: int):
    """``count`` prompts that share their first ``shared`` tokens (the first prompt's, cycled if it is shorter) and
    differ after them (each one's own tail: prompt ``i`` without its first ``shared`` tokens, at least 8 tokens)."""
    head = [prompts[0][i % len(prompts[0])] for i in range(shared)]
    out = []
    for i in range(count):
        own = prompts[(i + 1) % len(prompts)]
        tail = own[shared:] if len(own) >= shared + 8 else own[-8:]
        out.append(head + list(tail) + [i % 97 + 3])  # the last token makes every prompt its own
    return out


def prefix_caching_arg(conf):
    """The engine's ``enable_prefix_caching``: its ``prefix_caching`` (off when not given), None for ``"default"``
    (left to vLLM and the adapter, as a user who sets nothing)."""
    value = conf.get("prefix_caching", False)
    return None if value == "default" else value


#: The second_turns scenario (hybrid targets): first prompts shorter than a state block (144 tokens for the
#: harness's hybrids: tiny-qwen3-next, the trained pair), decoded past two block ends, then second turns that append
#: each answer. A second turn's cache hit then ends inside the first turn's answer: its state block was written by
#: tree steps (a boundary commit, or a commit whose path ended at the block's end), not by a prefill.
SECOND_TURN_PROMPT = 96
SECOND_TURN_FIRST_TOKENS = 240
SECOND_TURN_REQUESTS = 8


def second_turn_prompts(prompts, count: int):
    """``count`` first-turn prompts of ``SECOND_TURN_PROMPT`` tokens (prompt ``i`` cycled, then a token of its own)."""
    out = []
    for i in range(count):
        own = prompts[i % len(prompts)]
        out.append([own[j % len(own)] for j in range(SECOND_TURN_PROMPT - 1)] + [i % 97 + 3])
    return out


def state_cache_exercised(conf, rows):
    """``(passed, note)`` for an engine caching a hybrid target's prefixes in the second_turns scenario: every second
    turn (rows ``SECOND_TURN_REQUESTS`` on) read more cached tokens than its first prompt held, so from a state block
    that decoding wrote (None: the engine does not cache hybrid prefixes)."""
    if not conf.get("hybrid_prefix"):
        return None
    later = rows[SECOND_TURN_REQUESTS:]
    cached = [r.get("cached_tokens", 0) for r in later]
    passed = bool(later) and all(c > SECOND_TURN_PROMPT for c in cached)
    return passed, f"second turns' cached tokens {cached} (first prompts {SECOND_TURN_PROMPT}); "


def prefix_cache_exercised(conf, rows):
    """``(passed, note)`` for an engine with prefix caching in the shared_prefix scenario: its repeated and
    second-turn requests (rows 8 on) must have read prompt tokens from the cache (None: the engine runs without
    prefix caching). Counted from each request's own ``num_cached_tokens``: vLLM's prefix-cache counters stopped
    moving after the first scenario in ``gpu-h200-pair-2b9ceeb`` (0 queries in every later one, hits or not)."""
    if not conf.get("prefix_caching") or conf.get("hybrid_prefix"):
        # (A hybrid target's state blocks hold 144 tokens, more than these prompts share: second_turns checks them.)
        return None
    later = rows[SHARED_PREFIX_REQUESTS:]
    hit = sum(1 for r in later if r.get("cached_tokens", 0) > 0)
    tokens = sum(r.get("cached_tokens", 0) for r in later)
    return bool(later) and hit == len(
        later
    ), f"prefix-cache hits in {hit} of {len(later)} later requests ({tokens} tokens); "


def diff_metrics(after, before):
    counters = ("drafts", "draft_tokens", "accepted", "preemptions", "prefix_cache_queries", "prefix_cache_hits")
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in counters}
    d["mean_acceptance_length"] = 1.0 + d["accepted"] / d["drafts"] if d["drafts"] else None
    pa, pb = after.get("per_pos", []), before.get("per_pos", [])
    if pa and d["drafts"]:
        pb = pb + [0.0] * (len(pa) - len(pb))
        d["acceptance_per_depth"] = [round((a - b) / d["drafts"], 4) for a, b in zip(pa, pb)][:16]
    return d


def sliding_drafter_copy(drafter: str, window: int, out: str) -> str:
    """``drafter`` with every layer but the last a sliding-window one of ``window`` positions (the released
    Qwen3.6-27B drafter's layer kinds), written to ``out``. Its weights were not trained so: acceptance falls, the
    outputs must not change."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(drafter, out)
    path = os.path.join(out, "config.json")
    with open(path) as handle:
        config = json.load(handle)
    layers = int(config["num_hidden_layers"])
    if layers < 2:
        raise ValueError(f"{drafter}: a drafter of {layers} layer cannot mix sliding-window and full attention")
    kinds = ["sliding_attention"] * (layers - 1) + ["full_attention"]
    config.update(layer_types=kinds, sliding_window=window, use_sliding_window=True)
    with open(path, "w") as handle:
        json.dump(config, handle)
    return out


def run_child(
    name, target, drafter, only_scenarios=(), eager=False, partial_path=None, gate="", concurrent=1, kv_cache_gib=0.0
):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from ddtree.vllm.tiny_models import spec_metrics

    conf = ENGINES[name]
    if conf.get("sliding_window"):
        drafter = sliding_drafter_copy(drafter, conf["sliding_window"], os.path.join(WORK, f"drafter-{name}"))
    spec = dict(conf["spec"], model=drafter) if conf["spec"] else None
    kw = dict(
        model=target,
        # A tokenizer where the pair has one: structured outputs need it (token-id prompts, no detokenizing).
        skip_tokenizer_init=not has_tokenizer(target),
        dtype="bfloat16",
        enforce_eager=eager,
        max_model_len=MAX_MODEL_LEN,
        max_num_seqs=32,
        max_num_batched_tokens=16384,
        gpu_memory_utilization=memory_share(0.35, concurrent),
        seed=0,
        disable_log_stats=False,
        enable_prefix_caching=prefix_caching_arg(conf),
    )
    from ddtree.vllm.tiny_models import engine_kwargs_for

    kw.update(engine_kwargs_for(target))
    _, vocab = model_info(target)
    if spec is None or spec["method"] != "ddtree":
        kw["attention_backend"] = "TRITON_ATTN"  # numerically closest to DDTree's Triton tree kernel
    if spec is not None:
        kw["speculative_config"] = spec
    if conf.get("tp", 1) > 1:
        kw["tensor_parallel_size"] = conf["tp"]
    if "num_gpu_blocks_override" in conf:
        kw["num_gpu_blocks_override"] = conf["num_gpu_blocks_override"]
    kw.update(kv_cache_kwargs(kv_cache_gib))
    t0 = time.time()
    llm = LLM(**kw)
    if gate:
        wait_for_turn(gate, name)
    res = {
        "engine": name,
        "init_s": round(time.time() - t0, 1),
        "scenarios": {},
        "errors": {},
        "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode),
    }
    given = None
    prompt_file = os.path.join(os.path.dirname(target), "prompts.json")
    if os.path.exists(prompt_file):
        with open(prompt_file) as f:
            given = json.load(f)
    P = prompts(vocab, given)
    # plain's top-2 gaps judge divergences; ddtree's own logprobs are checked against plain's.
    want_logprobs = name.startswith(("plain", "ddtree"))

    def greedy(max_tokens, stop=None, **extra):
        return SamplingParams(
            temperature=0.0,
            max_tokens=max_tokens,
            ignore_eos=True,
            detokenize=False,
            logprobs=2 if want_logprobs else None,
            stop_token_ids=stop,
            **extra,
        )

    def collect(outs):
        rows = []
        for o in outs:
            c = o.outputs[0]
            gaps = chosen = top = None
            if c.logprobs:
                gaps, chosen, top = [], [], []
                for token, step in zip(c.token_ids, c.logprobs):
                    vals = sorted((lp.logprob for lp in step.values()), reverse=True)
                    gaps.append(vals[0] - vals[1] if len(vals) > 1 else 99.0)
                    chosen.append(step[token].logprob if token in step else None)
                    top.append(vals[0])
            rows.append(
                {
                    "tokens": list(c.token_ids),
                    "gaps": gaps,
                    "logprobs": chosen,
                    "top": top,
                    "finish": c.finish_reason,
                    "cached_tokens": o.num_cached_tokens or 0,  # the request's prompt tokens read from the cache
                }
            )
        return rows

    is_ddtree = spec is not None and spec["method"] == "ddtree"

    def tree_counts(engine):
        summary = engine.collective_rpc("ddtree_summary")[0]
        return {
            k: summary.get(k, 0)
            for k in (
                "trees",
                "partial_trees",
                "filler_trees",
                "fresh_state_trees",
                "verify_steps",
                "full_graph_steps",
                # How many of a scenario's steps the device plan served: requests that finish or arrive change the
                # step's requests, and such a step is planned on the host (the pair bench's lockstep groups rarely
                # do; served traffic does all the time), unless it is some of the last proposal's requests (subset
                # steps, DDTREE_DEVICE_PLAN_SUBSETS).
                "device_plan_steps",
                "device_plan_subset_steps",
                # Steps with a prefill beside the trees whose walk replayed a graph (DDTREE_MIXED_WALK_GRAPHS).
                "mixed_walk_graph_steps",
                # Verify steps with a prefill's tokens beside the trees (the arrivals scenario must show some).
                "prefill_beside_trees_steps",
            )
        } | {  # the steps the device plan turned down, one counter a reason ("declined: near max_model_len", ...)
            f"declined: {reason}": count for reason, count in summary.get("device_plan_declined_steps", {}).items()
        }

    def scenario(sname, fn):
        if conf.get("only") and sname not in conf["only"]:
            return
        if only_scenarios and sname not in only_scenarios:
            return
        before = spec_metrics(llm)
        trees_before = tree_counts(llm) if is_ddtree else None
        t = time.time()
        earlier_error = next(iter(res["errors"]), None)
        try:
            rows, ntok = fn()
            dt = time.time() - t
            res["scenarios"][sname] = {
                "rows": rows,
                "seconds": round(dt, 3),
                "tokens": ntok,
                "tokens_per_s": round(ntok / dt, 1) if dt else None,
                "spec": diff_metrics(spec_metrics(llm), before),
            }
            if earlier_error is not None:  # the engine ran on from a step that raised: see engine_error_checks
                res["scenarios"][sname]["after_error_in"] = earlier_error
            if is_ddtree:  # what the scenario verified: trees, cut trees, steps that replayed FULL graphs
                after = tree_counts(llm)
                res["scenarios"][sname]["trees"] = {k: after[k] - trees_before.get(k, 0) for k in after}
            if sname in CONSTRAINED_SCENARIOS:  # what fp32_reference.py replays, kept with the outputs
                res["scenarios"][sname]["settings"] = CONSTRAINED_SCENARIOS[sname]
            elif sname == "structured":  # row r under regex r mod 2, ended by the stop token
                eos = llm.get_tokenizer().eos_token_id
                res["scenarios"][sname]["settings"] = {"regexes": list(STRUCTURED_REGEXES), "stop": [eos]}
            if sname in SCENARIO_VERSIONS:
                res["scenarios"][sname]["version"] = SCENARIO_VERSIONS[sname]
        except Exception:
            res["errors"][sname] = traceback.format_exc()[-4000:] + abort_left_over(llm)
        if partial_path:  # what finished so far, for the parent when this child dies
            with open(partial_path, "w") as f:
                json.dump(res, f)

    def b1():
        rows = []
        for p in P["batch1"]:
            rows += collect(llm.generate([TokensPrompt(prompt_token_ids=p)], greedy(MAX_TOKENS), use_tqdm=False))
        return rows, sum(len(r["tokens"]) for r in rows)

    def b16():
        rows = collect(
            llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in P["batch32"][:16]], greedy(MAX_TOKENS), use_tqdm=False
            )
        )
        return rows, sum(len(r["tokens"]) for r in rows)

    def b32():
        params = [greedy(m) for m in P["max_tokens"]]
        rows = collect(llm.generate([TokensPrompt(prompt_token_ids=p) for p in P["batch32"]], params, use_tqdm=False))
        return rows, sum(len(r["tokens"]) for r in rows)

    def one_token_prompts():
        # batch32's own lengths (17-64 tokens), so that some finish early and the one-token prompts queued behind
        # them are admitted beside running requests.
        params = [greedy(m) for m in P["max_tokens"]] + [greedy(MAX_TOKENS)] * ONE_TOKEN_PROMPTS
        rows = collect(llm.generate([TokensPrompt(prompt_token_ids=p) for p in P["one_token"]], params, use_tqdm=False))
        return rows, sum(len(r["tokens"]) for r in rows)

    def near_max():
        params = greedy(NEAR_MAX_ROOM - 1)  # up to max_model_len - 1
        rows = collect(llm.generate([TokensPrompt(prompt_token_ids=P["near_max"])], params, use_tqdm=False))
        return rows, len(rows[0]["tokens"])

    def constrained(sname):
        params = greedy(MAX_TOKENS, **CONSTRAINED_SCENARIOS[sname])
        rows = collect(llm.generate([TokensPrompt(prompt_token_ids=p) for p in P["stop"]], params, use_tqdm=False))
        return rows, sum(len(r["tokens"]) for r in rows)

    def min_p():
        # Sampled, so not comparable token by token: every emitted token must keep min_p of its row's top
        # probability (the raw logprobs are the row's, temperature 1 leaves them as they are).
        params = [
            SamplingParams(
                temperature=1.0,
                min_p=MIN_P,
                seed=200 + i,
                max_tokens=MAX_TOKENS,
                ignore_eos=True,
                detokenize=False,
                logprobs=2,
            )
            for i in range(len(P["stop"]))
        ]
        rows = collect(llm.generate([TokensPrompt(prompt_token_ids=p) for p in P["stop"]], params, use_tqdm=False))
        return rows, sum(len(r["tokens"]) for r in rows)

    def t1():
        params = [
            SamplingParams(
                temperature=1.0, top_p=0.95, top_k=50, seed=100 + i, max_tokens=32, ignore_eos=True, detokenize=False
            )
            for i in range(len(P["t1"]))
        ]
        reqs = [TokensPrompt(prompt_token_ids=p) for p in P["t1"]]
        a = collect(llm.generate(reqs, params, use_tqdm=False))
        b = collect(llm.generate(reqs, params, use_tqdm=False))
        c = staggered(reqs, params)
        rows = [
            {
                "tokens": x["tokens"],
                "repeat_equal": x["tokens"] == y["tokens"],
                "staggered_equal": x["tokens"] == z["tokens"],
            }
            for x, y, z in zip(a, b, c)
        ]
        return rows, 3 * sum(len(r["tokens"]) for r in rows)

    def staggered(reqs, params):
        # The same seeded requests, the first alone for a few steps (its trees verified) and then the rest: their
        # first tokens are sampled beside a tree, where together they were sampled in a step without drafts.
        engine = llm.llm_engine
        ids = [f"staggered-{i}-{time.monotonic_ns()}" for i in range(len(reqs))]
        engine.add_request(ids[0], reqs[0], params[0])
        finished = {}
        for step in range(100_000):
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            if step == 3:
                for rid, req, param in zip(ids[1:], reqs[1:], params[1:]):
                    engine.add_request(rid, req, param)
            if step > 3 and not engine.has_unfinished_requests():
                break
        return [{"tokens": collect([finished[rid]])[0]["tokens"]} for rid in ids]

    def arrivals():
        # Rows in prompt order: the long requests' (batch32's first prompts), then the short ones' (the next).
        tag = time.monotonic_ns()
        prompts = [TokensPrompt(prompt_token_ids=p) for p in P["batch32"][: ARRIVALS_LONG + ARRIVALS_SHORT]]
        ids = [f"arrivals-{i}-{tag}" for i in range(len(prompts))]
        long_params, short_params = greedy(ARRIVALS_LONG_TOKENS), greedy(ARRIVALS_SHORT_TOKENS)
        requests = [
            (rid, p, long_params if i < ARRIVALS_LONG else short_params) for i, (rid, p) in enumerate(zip(ids, prompts))
        ]
        finished, arrived = run_arrivals(llm.llm_engine, requests[:ARRIVALS_LONG], requests[ARRIVALS_LONG:])
        rows = [collect([finished[rid]])[0] for rid in ids]
        # (the step each short request arrived at, and the long requests then running: ARRIVALS_LONG when it held)
        rows[0]["arrivals"] = [list(arrived[rid]) for rid in ids[ARRIVALS_LONG:]]
        return rows, sum(len(r["tokens"]) for r in rows)

    at_abort = {}

    def abort():
        # 16 requests in flight; after 3 engine steps (trees mid-verification) every other one is
        # aborted. The survivors must finish exactly as they would have, and the engine must serve
        # a fresh batch afterwards. Aborted rows are recorded empty.
        engine = llm.llm_engine
        trees_at_start = tree_counts(llm)["trees"] if is_ddtree else 0
        ids = [f"abort-{i}" for i in range(16)]
        for rid, p in zip(ids, P["batch32"][:16]):
            engine.add_request(rid, TokensPrompt(prompt_token_ids=p), greedy(MAX_TOKENS))
        finished, steps = {}, 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
            steps += 1
            if steps == 3:
                if is_ddtree:  # the abort must land while trees are being verified, not during prefill
                    at_abort["trees"] = tree_counts(llm)["trees"] - trees_at_start
                engine.abort_request(ids[::2])
        rows = [
            collect([finished[rid]])[0] if rid in finished and i % 2 else {"tokens": [], "gaps": [], "aborted": True}
            for i, rid in enumerate(ids)
        ]
        rows += collect(
            llm.generate(
                [TokensPrompt(prompt_token_ids=p) for p in P["batch32"][16:20]], greedy(MAX_TOKENS), use_tqdm=False
            )
        )
        if at_abort:
            rows[0]["trees_verified_before_abort"] = at_abort["trees"]
        return rows, sum(len(r["tokens"]) for r in rows)

    def shared_prefix():
        # Three rounds of 8 requests; rows in order (first answers, repeats, second turns). Every repeat and second
        # turn must read its shared blocks from the cache in engines with prefix caching (rows' "cached_tokens").
        first = shared_prefix_prompts(P["batch32"], SHARED_PREFIX, SHARED_PREFIX_REQUESTS)
        reqs = [TokensPrompt(prompt_token_ids=p) for p in first]
        rows = collect(llm.generate(reqs, greedy(MAX_TOKENS), use_tqdm=False))
        rows += collect(llm.generate(reqs, greedy(MAX_TOKENS), use_tqdm=False))
        second = [second_turn(p, r["tokens"]) for p, r in zip(first, rows)]
        rows += collect(
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in second], greedy(MAX_TOKENS), use_tqdm=False)
        )
        return rows, sum(len(r["tokens"]) for r in rows)

    def second_turns():
        # Hybrid targets: first turns decoded across state-block ends, then second turns that append each answer.
        first = second_turn_prompts(P["batch32"], SECOND_TURN_REQUESTS)
        reqs = [TokensPrompt(prompt_token_ids=p) for p in first]
        rows = collect(llm.generate(reqs, greedy(SECOND_TURN_FIRST_TOKENS), use_tqdm=False))
        second = [second_turn(p, r["tokens"]) for p, r in zip(first, rows)]
        rows += collect(
            llm.generate([TokensPrompt(prompt_token_ids=p) for p in second], greedy(MAX_TOKENS), use_tqdm=False)
        )
        return rows, sum(len(r["tokens"]) for r in rows)

    def structured():
        from vllm.sampling_params import StructuredOutputsParams

        grammars = [StructuredOutputsParams(regex=regex) for regex in STRUCTURED_REGEXES]
        params = [
            SamplingParams(
                temperature=0.0,
                max_tokens=STRUCTURED_MAX_TOKENS,
                detokenize=False,
                logprobs=2 if want_logprobs else None,
                structured_outputs=grammars[i % 2],
            )
            for i in range(len(P["stop"]))
        ]
        rows = collect(llm.generate([TokensPrompt(prompt_token_ids=p) for p in P["stop"]], params, use_tqdm=False))
        return rows, sum(len(r["tokens"]) for r in rows)

    scenarios = (
        ("batch1", b1),
        ("batch16", b16),
        ("batch32", b32),
        ("near_max", near_max),
        ("one_token_prompts", one_token_prompts),
        *((sname, functools.partial(constrained, sname)) for sname in CONSTRAINED_SCENARIOS),
        ("min_p", min_p),
        ("abort", abort),
        ("arrivals", arrivals),
        ("t1", t1),
        ("shared_prefix", shared_prefix),
        *((("second_turns", second_turns),) if is_gdn_target(target) else ()),
        # (with tensor parallelism a ddtree engine refuses structured outputs: the masks need one process)
        *((("structured", structured),) if has_tokenizer(target) and conf.get("tp", 1) == 1 else ()),
    )
    for sname, fn in scenarios:
        scenario(sname, fn)
    try:
        if spec is not None and spec["method"] == "ddtree":
            res["ddtree_summary"] = llm.collective_rpc("ddtree_summary")[0]
    except Exception:
        res["errors"]["ddtree_summary"] = traceback.format_exc()[-2000:]
    return res


# ---------------------------------------------------------------------------------------------
# Parent: models, children, comparisons.
def partial_results_path(out, name):
    return os.path.join(out, f"engine_{name}.partial.json")


def load_partial_results(out, name, fh):
    """The scenarios a child finished before it died or timed out (None: none)."""
    path = partial_results_path(out, name)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        res = json.load(f)
    res.setdefault("errors", {})["child"] = "the child process died or timed out; these are its finished scenarios"
    log(f"{name}: kept {len(res.get('scenarios', {}))} finished scenarios from {path}", fh)
    return res


def abort_left_over(llm) -> str:
    """Aborts the requests a scenario that raised left in the engine (``generate`` returns nothing of them, and a
    later scenario's call would finish them among its own rows), and says how many (later scenarios still do not
    count: ``engine_error_checks``)."""
    try:
        engine = llm.llm_engine
        left = list(engine.output_processor.request_states)
        if left:
            engine.abort_request(left)
        return f"\n(aborted {len(left)} requests the scenario left in the engine)"
    except Exception as error:  # noqa: BLE001 (the scenario's own error is the one reported)
        return f"\n(could not abort the requests left in the engine: {error!r})"


#: Entries of an engine's ``errors`` that are not scenarios.
NON_SCENARIO_ERRORS = ("ddtree_summary", "child")


def engine_error_checks(name: str, res: dict) -> dict:
    """Verdict entries for an engine's scenarios that raised (``NAME/SCENARIO/ran``) and for those that ran after
    one had (``NAME/SCENARIO/clean_engine``): both False. A scenario that raised has no rows to compare, so without
    the first it would be missing from the verdict rather than failed; and the engine goes on from a step that
    raised half-way, so what it emits after is not evidence of anything (on the H200 a device-planned engine whose
    min_tokens step raised then emitted banned tokens under logit_bias, ``gpu-h200-device-plan-c4ff208``)."""
    checks = {f"{name}/{sname}/ran": False for sname in res.get("errors", {}) if sname not in NON_SCENARIO_ERRORS}
    for sname, scenario in res.get("scenarios", {}).items():
        if scenario.get("after_error_in"):
            checks[f"{name}/{sname}/clean_engine"] = False
    return checks


def scenario_exercised(sname, trees, schedule=False):
    """``(passed, note)`` for a ddtree engine's scenario: did it verify what it is named for? None: no counts.

    Every scenario must verify trees; near_max must verify cut trees (requests near max_model_len get what
    still fits) -- a run that decoded one token per step there tested plain decoding, not trees; one_token_prompts
    must verify filler trees (the first decodes vLLM padded with placeholders no proposal stands behind), except
    with a budget ``schedule`` (or ``auto``), under which vLLM's asynchronous scheduler pads no first decode;
    arrivals must verify trees in steps beside a prefill.
    """
    if not trees:
        return None
    note = (
        f"trees {trees['trees']} (cut {trees['partial_trees']}, filler {trees.get('filler_trees', 0)}, fresh states "
        f"{trees.get('fresh_state_trees', 0)}), FULL-graph steps "
        f"{trees['full_graph_steps']}/{trees['verify_steps']}, device-planned {trees.get('device_plan_steps', 0)} "
        f"(subset steps {trees.get('device_plan_subset_steps', 0)}), mixed steps walked by a graph "
        f"{trees.get('mixed_walk_graph_steps', 0)} of {trees.get('prefill_beside_trees_steps', 0)} beside a prefill; "
    )
    declined = {k.split(": ", 1)[1]: n for k, n in trees.items() if k.startswith("declined: ") and n}
    if declined:
        note += f"device plan declined {declined}; "
    ok = trees["trees"] > 0 and (sname != "near_max" or trees["partial_trees"] > 0)
    ok = ok and (sname != "one_token_prompts" or schedule or trees.get("filler_trees", 0) > 0)
    # arrivals: prefills beside trees, not every request decoding alone or together.
    ok = ok and (sname != "arrivals" or trees.get("prefill_beside_trees_steps", 0) > 0)
    return ok, note


#: The adapter's switches and the counters that show their path ran (the engine's summary over all scenarios).
SWITCH_COUNTERS = {
    "DDTREE_DEVICE_ACCEPT": ("device_accept_steps",),
    "DDTREE_LATE_TREES": ("late_tree_steps", "early_output_steps"),
    "DDTREE_ASYNC_SCHEDULING": ("async_scheduling", "late_tree_steps", "device_accept_steps"),
    "DDTREE_LAUNCH_AHEAD": ("early_launch_steps",),
    "DDTREE_COMMIT_IN_PLACE": ("commit_in_place_steps",),
    "DDTREE_PRECAPTURE": ("precaptured_sizes",),
    "DDTREE_TOPK_GRAPHS": ("topk_graph_steps",),
    "DDTREE_DEVICE_PLAN": ("device_plan_steps", "device_plan_resumed_steps"),
    "DDTREE_MIXED_WALK_GRAPHS": ("mixed_walk_graph_steps",),
    "DDTREE_SLIDING_DRAFTER": ("sliding_drafter_steps",),
    "DDTREE_HYBRID_PREFIX_CACHING": ("boundary_commit_trees", "boundary_commit_steps"),
}


def tree_masks_ran(summary) -> bool:
    """Whether the engine's grammar rows came from its trees (patch 12a) in some step: the structured scenario's
    requests verified trees under masks of their own, not vLLM's chain rows."""
    return (summary.get("grammar_tree_steps") or 0) > 0 and (summary.get("grammar_trees") or 0) > 0


def schedule_graphs_exercised(spec, summary):
    """``[(counter, passed)]``: every smaller budget of a budget schedule (or of ``auto``'s candidates) that verified
    trees also replayed FULL graphs of its own trees (``budget + 1`` tokens each; the pair's trees fill their
    budget); ``auto`` also decided at least once (its choice may rightly stay the largest budget) and probed a
    smaller budget (a change of budget mid-run)."""
    budget = (spec or {}).get("ddtree_budget")
    auto = summary.get("auto_budget") if budget == "auto" else None
    if isinstance(budget, dict):
        budgets = {int(b) for b in budget.values()}
    elif auto:
        budgets = {int(b) for b in auto["candidates"]}
    else:
        return []
    used = {int(b): n for b, n in summary.get("steps_by_budget", {}).items()}
    full = {int(t): n for t, n in summary.get("full_graph_steps_by_tree_tokens", {}).items()}
    checks = [
        (f"full_graph_steps_of_budget_{b}", full.get(b + 1, 0) > 0)
        for b in sorted(budgets)
        if b < max(budgets) and used.get(b, 0) > 0
    ]
    if auto:
        # Its first probe (one window of the largest candidate and the next smaller in turns) changes the budget
        # mid-run under whatever scheduling the engine runs: the switch itself is exercised.
        checks += [
            ("auto_budget_decisions", auto.get("decisions", 0) > 0),
            ("auto_budget_probes", auto.get("probes", 0) > 0),
        ]
    return checks


def step_graphs_exercised(env, summary, greedy_ran: bool = True):
    """``[(counter, passed)]``: with the step graphs on (the default), an engine that walked FULL steps on the device
    replayed walk graphs (each shape's first walk runs eagerly, so a few FULL steps are needed), and, when a greedy
    scenario ran (``greedy_ran``: one outside ``SAMPLED_SCENARIOS``), on some of them the sampler wrote its tokens
    where the graph reads them."""
    if env.get("DDTREE_STEP_GRAPHS", "1") != "1" or summary.get("full_graph_steps", 0) < 4:
        return []
    if not summary.get("device_accept_steps", 0):
        return []
    checks = [("walk_graph_steps", summary.get("walk_graph_steps", 0) > 0)]
    if greedy_ran:
        checks.append(("walk_target_in_place_steps", summary.get("walk_target_in_place_steps", 0) > 0))
    return checks


def statistics_complete(summary):
    """``[(counter, passed)]``: an engine that walked trees on the device counted every such step in its statistics
    (none left out because its slot of the statistics' ring held another step's paths)."""
    if not summary.get("device_accept_steps", 0):
        return []
    return [("stats_lost_steps", summary.get("stats_lost_steps", 0) == 0)]


def switched_paths_exercised(env, summary, full_graphs: bool = True):
    """``[(counter, passed)]``: an engine run with a switch on must show that the switch's path ran; the default
    device plan too where the engine ran FULL CUDA graphs (``full_graphs``; without them it stays off)."""
    checks = [
        (counter, summary.get(counter, 0) > 0)
        for switch, counters in SWITCH_COUNTERS.items()
        if env.get(switch) in ("1", "always", "all")
        for counter in counters
    ]
    if env.get("DDTREE_PRECAPTURE") == "all":  # the commit's graphs at start-up too
        checks.append(("precaptured_commits", summary.get("precaptured_commits", 0) > 0))
    if env.get("DDTREE_DEVICE_PLAN") == "1" and env.get("DDTREE_PRECAPTURE", "1") != "0":
        # The device plan's graphs are captured at start-up with the placement's (the default precapture).
        checks.append(("precaptured_device_plans", summary.get("precaptured_device_plans", 0) > 0))
        if subsets_on(env):  # ... and the subset layout's with them
            checks.append(("precaptured_subset_plans", summary.get("precaptured_subset_plans", 0) > 0))
    default_plan = "DDTREE_DEVICE_PLAN" not in env and env.get("DDTREE_PRECAPTURE") != "0"
    if env.get("DDTREE_ASYNC_SCHEDULING") == "1" and default_plan and full_graphs:
        # The default (auto) turns the device plan on for every such engine of the harness (one GPU, budgets of at
        # most 127, the start-up precapture that checks its kernels): start-up must have said "on", and steps must
        # have run it, not fallen back to the host plan.
        checks.append(("device_plan_on", summary.get("device_plan") == "on"))
        checks.append(("device_plan_steps", summary.get("device_plan_steps", 0) > 0))
    plan_on = env.get("DDTREE_DEVICE_PLAN") == "1" or (env.get("DDTREE_ASYNC_SCHEDULING") == "1" and default_plan)
    if plan_on and full_graphs and subsets_on(env):
        # (On by default: every multi-request scenario has requests that end before others.)
        checks.append(("device_plan_subset_steps", summary.get("device_plan_subset_steps", 0) > 0))
    return checks


def subsets_on(env) -> bool:
    """Whether an engine's device plan also takes the step after a request ends (DDTREE_DEVICE_PLAN_SUBSETS, on by
    default)."""
    return env.get("DDTREE_DEVICE_PLAN_SUBSETS", "1") == "1"


def identical_outputs(rows, other_rows) -> bool:
    """Whether two engines' rows of one scenario hold the same requests' same tokens."""
    return len(rows) == len(other_rows) and all(a["tokens"] == b["tokens"] for a, b in zip(rows, other_rows))


def compare(ref_rows, rows, gap_tol):
    """(identical, tie_divergences, real_divergences, details)"""
    same = tie = real = 0
    details = []
    for i, (r, x) in enumerate(zip(ref_rows, rows)):
        a, b = r["tokens"], x["tokens"]
        n = min(len(a), len(b))
        k = next((j for j in range(n) if a[j] != b[j]), None)
        if k is None and len(a) == len(b):
            same += 1
            continue
        if k is None:
            real += 1
            details.append(
                f"req {i}: lengths differ {len(a)} vs {len(b)} (finish {r.get('finish')} vs {x.get('finish')})"
            )
            continue
        gap = r["gaps"][k] if r.get("gaps") and k < len(r["gaps"]) else None
        if gap is not None and gap < gap_tol:
            tie += 1
            details.append(f"req {i}: diverges at {k} where plain's top-2 gap is {gap:.4f} (< {gap_tol}: near-tie)")
        else:
            real += 1
            details.append(f"req {i}: diverges at {k}, top-2 gap {gap}: plain {a[k : k + 5]} vs {b[k : k + 5]}")
    return same, tie, real, details


def logprob_difference(ref_rows, rows):
    """Largest |logprob of the emitted token| difference where both emitted the same tokens so far (None: no
    logprobs to compare)."""
    worst = None
    for r, x in zip(ref_rows, rows):
        a, b = r.get("logprobs"), x.get("logprobs")
        if not a or not b:
            continue
        for ta, tb, la, lb in zip(r["tokens"], x["tokens"], a, b):
            if ta != tb:
                break
            if la is not None and lb is not None:
                worst = max(worst or 0.0, abs(la - lb))
    return worst


def with_plain_gaps(rows, plain_scenario):
    """``rows`` with plain's top-2 gaps, kept only up to where the row first departs from plain's output."""
    out = []
    for i, row in enumerate(rows):
        gaps = None
        if plain_scenario and i < len(plain_scenario["rows"]) and plain_scenario["rows"][i].get("gaps"):
            p = plain_scenario["rows"][i]
            agree = next(
                (j for j, (a, b) in enumerate(zip(p["tokens"], row["tokens"])) if a != b),
                min(len(p["tokens"]), len(row["tokens"])),
            )
            gaps = p["gaps"][: agree + 1]
        out.append(dict(row, gaps=gaps))
    return out


def current_scenarios(result: dict) -> dict:
    """An engine's results without the scenarios of another version than this harness's
    (:data:`SCENARIO_VERSIONS`; a scenario without a version is version 1)."""
    scenarios = result.get("scenarios")
    if not isinstance(scenarios, dict):
        return result
    kept = {
        name: res
        for name, res in scenarios.items()
        if not isinstance(res, dict) or res.get("version", 1) == SCENARIO_VERSIONS.get(name, 1)
    }
    return dict(result, scenarios=kept)


def reused_results(spec: str, running) -> dict:
    """The engines' results of an earlier run, ``PATH[:ENGINE,...]`` (PATH a .json or .json.gz), without the
    engines this run runs itself, and without scenarios of another version (:func:`current_scenarios`)."""
    import gzip

    path, _, wanted = spec.partition(":")
    with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
        earlier = json.load(f)["results"]
    names = wanted.split(",") if wanted else list(earlier)
    missing = [n for n in names if n not in earlier]
    if missing:
        raise SystemExit(f"--reuse {spec}: no results for {missing} (it has {sorted(earlier)})")
    return {n: current_scenarios(earlier[n]) for n in names if n not in running}


def merged_reuse(specs, running) -> dict:
    """:func:`reused_results` of several earlier runs, in order: an engine's scenarios from a later run replace
    the same scenarios of an earlier one (the rest of its result, e.g. ``init_s``, is the later run's)."""
    merged: dict = {}
    for spec in specs:
        for name, res in reused_results(spec, running).items():
            scenarios = dict((merged.get(name) or {}).get("scenarios") or {})
            scenarios.update(res.get("scenarios") or {})
            merged[name] = dict(res, scenarios=scenarios)
    return merged


def engine_command(args, name: str, gate: str) -> list:
    """The command line of one engine's subprocess (``gate``: engines started side by side)."""
    command = [sys.executable, os.path.abspath(__file__), "--child", name, "--out", args.out, "--model", args.model]
    command += ["--scenarios", args.scenarios, "--concurrent-starts", str(args.concurrent_starts)]
    return command + (["--eager"] if args.eager else []) + engine_arguments(gate)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/ddtree_e2e_out"))
    ap.add_argument("--gap-tol", type=float, default=0.05)
    ap.add_argument(
        "--logprob-tol",
        type=float,
        default=0.15,
        help="largest |logprob| difference of ddtree's emitted tokens from plain's (bf16 logits of "
        "magnitude 8-16 are 0.0625 apart)",
    )
    ap.add_argument("--child", default=None)
    ap.add_argument(
        "--timeout",
        type=int,
        default=300,
        help="per engine; under CUDA graphs a cold start (torch.compile, capture) took 130-180 s with the "
        "pair on an H200, a warm compile cache about a minute less",
    )
    ap.add_argument("--deadline", type=int, default=450, help="seconds for the whole run (engines left are skipped)")
    add_turn_arguments(ap)
    # The harness times nothing: its engines start side by side by default (up to SIDE_BY_SIDE), each engine's
    # scenarios still alone on the GPU. One after the other, three pair engines' cold starts (~190 s each under
    # CUDA graphs) outran a 550 s device call in gpu-h200-pair-2b9ceeb.
    ap.set_defaults(concurrent_starts=0)
    ap.add_argument("--engines", default="plain,dflash,ddtree16,ddtree256,ddtree64-preempt")
    ap.add_argument("--scenarios", default="", help="comma-separated subset of the scenarios (default: all)")
    ap.add_argument(
        "--reuse",
        action="append",
        default=[],
        help="vllm_ddtree_e2e.json (or .json.gz) of an earlier run on the same model, optionally followed by "
        "':ENGINE,ENGINE' to take only those: its engines' results join this run's (e.g. plain and ddtree64 at TP 1, "
        "reused by a later ddtree64-tp2 run; benches/results/gpu-h200-e2e-034348c/vllm_ddtree_e2e.json.gz:plain). "
        "Repeatable: a later file's scenarios replace an earlier one's, engine by engine (e.g. an old run's plain "
        "joined by a new run of plain on one changed scenario)",
    )
    ap.add_argument(
        "--model",
        default="tiny-qwen3",
        help="tiny-qwen3, tiny-qwen3-next (2 of 4 experts per token), tiny-qwen3-next-all-experts "
        "(4 of 4: no routing flips), or a directory with a pair",
    )
    ap.add_argument(
        "--eager",
        action="store_true",
        help="every engine in eager mode (default: CUDA graphs, vLLM's default; ddtree engines run PIECEWISE)",
    )
    ap.add_argument(
        "--fp32-reference",
        action="store_true",
        help="afterwards judge every greedy output against the pair's target in fp32 on CPU "
        "(fp32_reference.py; pair directories only)",
    )
    args = ap.parse_args()
    if not args.concurrent_starts:
        args.concurrent_starts = min(SIDE_BY_SIDE, len(args.engines.split(",")))
    root = args.model if os.path.isdir(args.model) else os.path.join(WORK, args.model)
    target, drafter = os.path.join(root, "target"), os.path.join(root, "drafter")
    if args.child:
        res = run_child(
            args.child,
            target,
            drafter,
            [x for x in args.scenarios.split(",") if x],
            args.eager,
            partial_results_path(args.out, args.child),
            args.gate,
            args.concurrent_starts,
            args.kv_cache_gib,
        )
        print("RESULT-JSON " + json.dumps(res), flush=True)
        return

    os.makedirs(args.out, exist_ok=True)
    fh = open(os.path.join(args.out, "vllm_ddtree_e2e.log"), "w")
    log(f"python {sys.version.split()[0]}; out {args.out}", fh)
    try:
        import torch
        import vllm

        import ddtree

        log(
            f"vllm {vllm.__version__} torch {torch.__version__} ddtree {ddtree.__version__} cuda {torch.cuda.is_available()}",
            fh,
        )
    except Exception:
        log("import failure:\n" + traceback.format_exc(), fh)
    from ddtree.vllm.tiny_models import write_drafter, write_qwen3_next_target, write_target

    t = time.time()
    writers = {
        "tiny-qwen3": write_target,
        "tiny-qwen3-next": write_qwen3_next_target,
        "tiny-qwen3-next-all-experts": lambda path: write_qwen3_next_target(path, experts_per_token=4),
    }
    if args.model in writers:
        spec = writers[args.model](target)
        write_drafter(drafter, spec)
        log(f"wrote {args.model} target {spec} and drafter in {time.time() - t:.1f}s", fh)
    log(f"model {args.model}: target {model_info(target)}", fh)

    results = {}
    if args.reuse:
        # A file an earlier job should have written but did not (killed at its limit): this run's engines still run
        # (the fp32 judge needs no plain), and the verdict lacks what that file would have given.
        absent = [spec for spec in args.reuse if not os.path.exists(spec.partition(":")[0])]
        for spec in absent:
            log(f"--reuse {spec}: no such file; its engines' results are missing from this run's verdict", fh)
        results = merged_reuse([spec for spec in args.reuse if spec not in absent], args.engines.split(","))
        reused = {name: sorted(res.get("scenarios") or {}) for name, res in results.items()}
        log(f"reused from {args.reuse} (scenarios of this harness's versions): {reused}", fh)
    started = time.time()
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_USE_V2_MODEL_RUNNER="0", PYTHONUNBUFFERED="1")
    # Structured outputs are served by every ddtree engine here (experimental, off by default): the structured
    # scenario runs where the pair has a tokenizer.
    env.setdefault("DDTREE_STRUCTURED_OUTPUTS", "1")
    # Triton keeps its autotuning results on disk, so an engine after the first skips the autotuning of vLLM's GDN
    # kernels (each engine's profiling run took 74-81 s on an H200, for dflash as for ddtree).
    env.setdefault("TRITON_CACHE_AUTOTUNING", "1")
    gate = new_gate(args.out, args.concurrent_starts)
    jobs = []
    for name in args.engines.split(","):
        child_env = dict(env, **ENGINES.get(name, {}).get("env", {}))
        jobs.append((name, engine_command(args, name, gate), os.path.join(args.out, f"engine_{name}.log"), child_env))
    turns = run_in_turns(jobs, gate, args.concurrent_starts, args.timeout, deadline=started + args.deadline)
    for turn in turns:
        name, child_log = turn.name, os.path.join(args.out, f"engine_{turn.name}.log")
        if turn.outcome == "skipped":
            log(f"{name}: SKIPPED, less than 45s left of the {args.deadline}s deadline", fh)
            continue
        if turn.outcome == "timeout":
            log(f"{name}: TIMEOUT (see {child_log})", fh)
            log(open(child_log).read()[-3000:], fh)
            partial = load_partial_results(args.out, name, fh)
            if partial is not None:
                results[name] = partial
            continue
        line = next((x for x in turn.stdout.splitlines() if x.startswith("RESULT-JSON ")), None)
        if line is None:
            tail = open(child_log).read()[-3000:]
            log(f"{name}: no result (rc {turn.returncode}); stderr tail:\n{tail}", fh)
            res = load_partial_results(args.out, name, fh)
            if res is None:
                continue
        else:
            res = json.loads(line[len("RESULT-JSON ") :])
        results[name] = res
        # Kept as each engine finishes: a run killed from outside (a device call's time limit) keeps them.
        with open(os.path.join(args.out, "vllm_ddtree_e2e.json"), "w") as partial:
            json.dump({"results": results, "verdict": None, "partial": True}, partial)
        log(f"{name}: init {res['init_s']}s, errors {list(res['errors'])}", fh)
        for sname, err in res["errors"].items():
            log(f"  {name}/{sname} FAILED:\n{err}", fh)

    # ---- report ----
    verdict = {}
    plain = results.get("plain")
    log("=" * 100, fh)
    log(f"{'engine':<18}{'scenario':<10}{'tok/s':>10}{'mean acc len':>14}{'same':>6}{'tie':>5}{'real':>6}  notes", fh)
    for name, res in results.items():
        verdict.update(engine_error_checks(name, res))
        for sname, sc in res["scenarios"].items():
            spec_m = sc.get("spec") or {}
            mal = spec_m.get("mean_acceptance_length")
            same = tie = real = "-"
            notes = f"after {sc['after_error_in']} raised; " if sc.get("after_error_in") else ""
            if plain and name != "plain" and sname in plain["scenarios"] and sname not in SAMPLED_SCENARIOS:
                same, tie, real, details = compare(plain["scenarios"][sname]["rows"], sc["rows"], args.gap_tol)
                verdict[f"{name}/{sname}"] = real == 0
                diff = logprob_difference(plain["scenarios"][sname]["rows"], sc["rows"])
                if diff is not None:
                    notes += f"logprob diff vs plain {diff:.4f}; "
                    verdict[f"{name}/{sname}/logprobs"] = diff <= args.logprob_tol
                for d in details:
                    log(f"    {name}/{sname}: {d}", fh)
            base = results.get(name[: -len("-tp2")]) if name.endswith("-tp2") else None
            if base and sname in base["scenarios"] and sname not in SAMPLED_SCENARIOS:
                ref = with_plain_gaps(base["scenarios"][sname]["rows"], (plain or {}).get("scenarios", {}).get(sname))
                b_same, b_tie, b_real, b_details = compare(ref, sc["rows"], args.gap_tol)
                notes += f"vs TP1 {name[:-4]}: same {b_same} tie {b_tie} real {b_real}; "
                for d in b_details:
                    log(f"    {name}/{sname} vs TP1: {d}", fh)
                verdict[f"{name}/{sname}=tp1"] = b_real == 0
            same_tp = results.get("plain-tp2") if name.endswith("-tp2") and name != "plain-tp2" else None
            if same_tp and sname in same_tp["scenarios"] and sname not in SAMPLED_SCENARIOS:
                # Against plain vLLM at the same TP: the same all-reduce order, so only ddtree's own differences.
                t_same, t_tie, t_real, t_details = compare(
                    same_tp["scenarios"][sname]["rows"], sc["rows"], args.gap_tol
                )
                notes += f"vs plain-tp2: same {t_same} tie {t_tie} real {t_real}; "
                for d in t_details:
                    log(f"    {name}/{sname} vs plain-tp2: {d}", fh)
                verdict[f"{name}/{sname}=plain-tp2"] = t_real == 0
            twin = results.get(name[: -len("-host-plan")]) if name.endswith("-host-plan") else None
            if twin and sname in twin["scenarios"] and sname != "abort":
                # The same trees planned on the device and on the host verify the same tokens with the same kernels
                # in the same batches: the outputs must be identical, token for token, seeded sampling included (no
                # tolerance). Not abort's: when its aborts land depends on the engine's speed, and so its batches.
                same_outputs = identical_outputs(twin["scenarios"][sname]["rows"], sc["rows"])
                notes += f"identical to {name[: -len('-host-plan')]}: {same_outputs}; "
                verdict[f"{name}/{sname}=device-plan"] = same_outputs
            if sname == "structured":
                # Each request ended by its grammar (the stop token forced once the grammar is complete); a token
                # the grammar refused would have ended it with an error instead.
                ok = bool(sc["rows"]) and all(r["finish"] == "stop" for r in sc["rows"])
                notes += f"every request ended by its grammar: {ok}; "
                verdict[f"{name}/structured/ended_by_grammar"] = ok
            if sname == "min_p":
                ok = min_p_respected(sc["rows"])
                notes += f"every token within min_p of its row's top: {ok}; "
                verdict[f"{name}/min_p"] = ok
            if sname == "t1":
                ok = all(r.get("repeat_equal") for r in sc["rows"])
                staggered_ok = all(r.get("staggered_equal") for r in sc["rows"])
                notes += f"seeded repeat equal: {ok}; staggered arrivals equal: {staggered_ok}"
                if name.startswith("ddtree"):
                    verdict[f"{name}/t1-repeat"] = ok
                    # A seeded request's tokens whatever steps they fall in (gpu-h200-device-plan-c4ff208's serve
                    # run: a first token beside trees differed from one in a step without drafts).
                    verdict[f"{name}/t1-staggered"] = staggered_ok
            if name.endswith("-preempt"):
                preempted = (spec_m.get("preemptions") or 0) > 0
                verdict[f"{name}/{sname}/preempted"] = preempted
                notes += f"preemptions {spec_m.get('preemptions')}; "
            if sname == "abort" and name.startswith("ddtree") and sc["rows"]:
                before_abort = sc["rows"][0].get("trees_verified_before_abort")
                if before_abort is not None:
                    verdict[f"{name}/abort/mid-tree"] = before_abort > 0
                    notes += f"trees verified before the abort {before_abort}; "
            if sname == "shared_prefix":
                cached = prefix_cache_exercised(ENGINES.get(name, {}), sc["rows"])
                if cached is not None:
                    verdict[f"{name}/shared_prefix/prefix_cache_hits"] = cached[0]
                    notes += cached[1]
            if sname == "second_turns":
                cached = state_cache_exercised(ENGINES.get(name, {}), sc["rows"])
                if cached is not None:
                    verdict[f"{name}/second_turns/state_cache_hits"] = cached[0]
                    notes += cached[1]
            budget = (ENGINES.get(name, {}).get("spec") or {}).get("ddtree_budget")
            exercised = scenario_exercised(
                sname, sc.get("trees"), schedule=isinstance(budget, dict) or budget == "auto"
            )
            if exercised is not None:
                verdict[f"{name}/{sname}/exercised"] = exercised[0]
                notes += exercised[1]
            if spec_m.get("acceptance_per_depth"):
                notes += f" per-depth {spec_m['acceptance_per_depth'][:6]}"
            mal_s = f"{mal:.3f}" if isinstance(mal, float) else "-"
            log(
                f"{name:<18}{sname:<10}{str(sc.get('tokens_per_s')):>10}{mal_s:>14}{same:>6}{tie:>5}{real:>6}  {notes}",
                fh,
            )
        if res.get("ddtree_summary"):
            log(f"{name} ddtree summary: {res['ddtree_summary']}", fh)
            full_graphs = "FULL" in str(res.get("cudagraph_mode", ""))  # (not under --eager or PIECEWISE only)
            for counter, passed in switched_paths_exercised(
                ENGINES.get(name, {}).get("env", {}), res["ddtree_summary"], full_graphs
            ):
                verdict[f"{name}/{counter}"] = passed
            greedy_ran = any(s not in SAMPLED_SCENARIOS for s in res.get("scenarios", {}))
            env = ENGINES.get(name, {}).get("env", {})
            for counter, passed in step_graphs_exercised(env, res["ddtree_summary"], greedy_ran):
                verdict[f"{name}/{counter}"] = passed
            for counter, passed in statistics_complete(res["ddtree_summary"]):
                verdict[f"{name}/{counter}"] = passed
            for counter, passed in schedule_graphs_exercised(ENGINES.get(name, {}).get("spec"), res["ddtree_summary"]):
                verdict[f"{name}/{counter}"] = passed
            if "structured" in res.get("scenarios", {}):
                verdict[f"{name}/structured/tree_masks"] = tree_masks_ran(res["ddtree_summary"])

    def mal(name):
        sc = results.get(name, {}).get("scenarios", {}).get("batch32", {})
        return (sc.get("spec") or {}).get("mean_acceptance_length")

    if mal("dflash") is not None:
        for name in results:
            if name.startswith("ddtree") and mal(name) is not None:
                verdict[f"{name}/acceptance>=dflash"] = mal(name) >= mal("dflash")
                log(f"mean acceptance length batch32: {name} {mal(name):.3f} vs dflash {mal('dflash'):.3f}", fh)
    missing = [n for n in args.engines.split(",") if n not in results]
    log(f"missing engines: {missing}", fh)
    log("VERDICT: " + json.dumps(verdict), fh)
    passed = verdict and all(verdict.values()) and not missing
    # The greedy checks hold an engine to plain vLLM's outputs up to bf16 near-ties (--gap-tol); a divergence past
    # that is judged against the target's fp32 outputs (--fp32-reference, or fp32_reference.py afterwards).
    judged = " (the fp32 reference decides the greedy checks)" if not passed and args.fp32_reference else ""
    if not passed and not args.fp32_reference:
        judged = " (greedy checks by the bf16-gap rule only: run fp32_reference.py on this JSON to judge them)"
    log(("ALL-PASS" if passed else "NOT-ALL-PASS") + judged, fh)
    json.dump({"results": results, "verdict": verdict}, open(os.path.join(args.out, "vllm_ddtree_e2e.json"), "w"))
    if args.fp32_reference:
        judge_against_fp32(args, started, fh)
    fh.close()


def judge_against_fp32(args, started: float, fh) -> None:
    """Runs ``fp32_reference.py`` on this run's JSON (CPU), within what is left of ``--deadline``."""
    if not os.path.isdir(args.model):
        log("fp32 reference: needs a pair directory (--model DIR), skipped", fh)
        return
    left = args.deadline - (time.time() - started)
    if left < 30:
        log(f"fp32 reference: skipped, {left:.0f}s left of the deadline", fh)
        return
    out = os.path.join(args.out, "fp32_reference.txt")
    cmd = [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp32_reference.py"),
        "--model",
        args.model,
        "--results",
        os.path.join(args.out, "vllm_ddtree_e2e.json"),
        "--gap-tol",
        str(args.gap_tol),
        "--out",
        out,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=left)
        tail = proc.stdout.strip().splitlines()[-1:] if proc.returncode == 0 else proc.stderr[-2000:].splitlines()
        log(f"fp32 reference (rc {proc.returncode}, {out}): " + " ".join(tail), fh)
    except subprocess.TimeoutExpired:
        log(f"fp32 reference: not finished within {left:.0f}s", fh)


if __name__ == "__main__":
    main()
