"""Judge GPU greedy outputs against an fp32 reference of the same model, on CPU.

    python tests/gpu/fp32_reference.py --model tests/fixtures/models --results RUN/vllm_ddtree_e2e.json \
        [--results MORE.json ...] [--scenarios batch16,penalties] [--gap-tol 0.05] [--out report.md]
    python tests/gpu/fp32_reference.py --model tests/fixtures/models --bench RUN1 [--bench RUN2 ...]

``--bench`` judges the greedy outputs ``benches/bench_vllm_ddtree.py`` keeps (``outputs_<engine>_b<batch>.json``,
the pair's ``batch32`` prompts cycled to the batch size, greedy, no stop) the same way.

``vllm_ddtree_e2e.py`` judges a divergence from plain vLLM by plain's own top-2 gap there. That gap is the
raw bf16 one: under penalties or a logit bias the choice is made on other logits, and plain vLLM is itself
one bf16 computation among several. This replays every greedy scenario of the harness with the pair's
target in fp32 (transformers, CPU), applies the scenario's sampling settings exactly as vLLM's sampler does
(logit bias and min_tokens, then repetition/presence/frequency penalties), and records the top-2 gap of
the logits each token was chosen from. An engine's output (plain vLLM's included) then counts as

* equal: the reference's tokens, for as long as the engine's output runs;
* near-tie: it first leaves the reference where the reference's own top-2 gap is below ``--gap-tol``;
* real: it leaves it anywhere else.

A correct engine in bf16 has no real divergence; where it has one, plain vLLM's behaviour there says
whether the engine or the bf16 arithmetic is to blame.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vllm_ddtree_e2e import (  # noqa: E402
    CONSTRAINED_SCENARIOS,
    SECOND_TURN_REQUESTS,
    SHARED_PREFIX,
    SHARED_PREFIX_REQUESTS,
    current_scenarios,
    prompts,
    second_turn,
    second_turn_prompts,
    shared_prefix_prompts,
)

#: Scenarios replayed (the harness's greedy ones); each maps to its prompt set.
PROMPT_SETS = {
    "batch1": "batch1",
    "batch16": "batch32",
    "batch32": "batch32",
    "arrivals": "batch32",  # (its rows: batch32's first prompts, in order, greedy to each row's length)
    "near_max": None,
    "one_token_prompts": "one_token",
    **{name: "stop" for name in CONSTRAINED_SCENARIOS},
    # Each row under one of the harness's regexes (its kept settings say which, row by row), ended by the stop token.
    "structured": "stop",
    # Its first two rounds from the pair's prompts; the third (second turns) from the reference's own first answers,
    # judged for an engine whose first answer is the reference's (``shared_prefix_references``).
    "shared_prefix": "shared_prefix",
    # (hybrid targets) Its first round from the pair's prompts, its second turns like shared_prefix's third round.
    "second_turns": "second_turns",
}

#: Scenarios whose later rows continue the reference's own first answers: (first rows, first row of the turns).
SECOND_TURN_ROUNDS = {
    "shared_prefix": (SHARED_PREFIX_REQUESTS, 2 * SHARED_PREFIX_REQUESTS),
    "second_turns": (SECOND_TURN_REQUESTS, SECOND_TURN_REQUESTS),
}


def constrain(logits, prompt: Sequence[int], output: Sequence[int], settings: dict):
    """The logits vLLM's sampler chooses from after ``output``, for a request with ``settings`` (the
    harness's keyword arguments): logit bias and min_tokens (its logits processors), then penalties."""
    import torch

    logits = logits.clone()
    for token, bias in (settings.get("logit_bias") or {}).items():
        logits[int(token)] += bias
    if len(output) < settings.get("min_tokens", 0):
        logits[list(settings.get("stop") or [])] = float("-inf")
    repetition = settings.get("repetition_penalty", 1.0)
    if repetition != 1.0:
        seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
        picked = logits[seen]
        logits[seen] = torch.where(picked > 0, picked / repetition, picked * repetition)
    if output:
        counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=logits.shape[0]).to(logits.dtype)
        logits -= settings.get("frequency_penalty", 0.0) * counts
        logits -= settings.get("presence_penalty", 0.0) * (counts > 0).to(logits.dtype)
    return logits


def scenario_settings(sname: str, results: Dict[str, dict], overrides: dict) -> dict:
    """The sampling settings a scenario ran with: ``overrides`` first, else what the harness kept with the
    outputs (every engine must agree), else none (the unconstrained scenarios)."""
    if sname in overrides:
        return overrides[sname]
    kept = {
        json.dumps(res["scenarios"][sname]["settings"], sort_keys=True)
        for res in results.values()
        if "settings" in res.get("scenarios", {}).get(sname, {})
    }
    if len(kept) > 1:
        raise SystemExit(f"{sname}: the results ran with different settings {sorted(kept)}; judge them apart")
    if kept:
        return json.loads(kept.pop())
    if sname in CONSTRAINED_SCENARIOS or sname == "structured":
        raise SystemExit(f"{sname}: the results do not say which settings they ran with; pass --scenario-settings")
    return {}


def row_grammars(settings: dict, target: str, vocab: int):
    """For a scenario whose settings name ``regexes`` (the structured scenario's, row ``r`` under regex ``r mod n``):
    a function of the row giving its compiled grammar, over the target's tokenizer; None for other scenarios."""
    regexes = settings.get("regexes")
    if not regexes:
        return None
    import xgrammar
    from transformers import AutoTokenizer

    info = xgrammar.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(target), vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info)
    compiled = [compiler.compile_regex(regex) for regex in regexes]
    return lambda row: compiled[row % len(compiled)]


def greedy_reference(
    model, prompt: Sequence[int], length: int, settings: dict, grammar=None
) -> Tuple[List[int], List[float]]:
    """fp32 greedy tokens under ``settings`` (and ``grammar``, an xgrammar ``CompiledGrammar``: each token chosen
    among those it allows, as vLLM masks a structured request's logits) and the top-2 gap each was chosen with (among
    the allowed tokens); stops after a stop token. The prompt runs once; each later token is one cached step."""
    import torch

    tokens: List[int] = []
    gaps: List[float] = []
    stops = set(settings.get("stop") or [])
    constraint = None
    if grammar is not None:
        from ddtree.engine.constraints import GrammarConstraint, masked_logits

        constraint = GrammarConstraint(grammar)
    if length <= 0:
        return tokens, gaps
    with torch.no_grad():
        out = model(torch.tensor([list(prompt)]), use_cache=True)
        while True:
            logits = constrain(out.logits[0, -1].float(), prompt, tokens, settings)
            if constraint is not None:
                logits = masked_logits(logits[None], constraint.node_masks([-1], []))[0]
            top = torch.topk(logits, 2)
            tokens.append(int(top.indices[0]))
            gaps.append(float(top.values[0] - top.values[1]))
            if constraint is not None:
                constraint.advance(tokens[-1:])
            if len(tokens) >= length or tokens[-1] in stops:
                return tokens, gaps
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)


def scenario_prompts(sname: str, P: dict) -> List[List[int]]:
    """The prompts of a scenario's rows that do not depend on an engine's output, in row order."""
    if sname == "shared_prefix":
        first = shared_prefix_prompts(P["batch32"], SHARED_PREFIX, SHARED_PREFIX_REQUESTS)
        return first + first
    if sname == "second_turns":
        return second_turn_prompts(P["batch32"], SECOND_TURN_REQUESTS)
    return P[PROMPT_SETS[sname]] if PROMPT_SETS[sname] else [P["near_max"]]


def second_turn_references(
    reference: dict, sname: str, first: Sequence[Sequence[int]], start: int, lengths: Dict[int, int], greedy
) -> None:
    """A scenario's second turns (shared_prefix's third round, second_turns' second): row ``start + i`` continues the
    reference's own first answer to ``first[i]`` (``second_turn``) for ``lengths[row]`` tokens (``greedy(prompt,
    length)``: tokens and gaps); kept with ``i``, whose engine row must equal that answer for the row to be judged
    (an engine that answered otherwise was asked something else)."""
    for i, prompt in enumerate(first):
        row, answer = start + i, reference.get((sname, i))
        if answer is None or row not in lengths:
            continue
        tokens, gaps = greedy(second_turn(prompt, answer[0]), lengths[row])
        reference[(sname, row)] = (tokens[: lengths[row]], gaps[: lengths[row]], i)


def classify(
    output: Sequence[int], reference: Sequence[int], gaps: Sequence[float], tol: float
) -> Tuple[str, Optional[int], Optional[float]]:
    """``(verdict, first differing position, reference gap there)``; verdict is equal / near-tie / real."""
    for i, (got, want) in enumerate(zip(output, reference)):
        if got != want:
            return ("near-tie" if gaps[i] < tol else "real"), i, gaps[i]
    if len(output) > len(reference):
        # The reference stopped on a stop token the engine did not produce at that position.
        return "real", len(reference), None
    return "equal", None, None


def judge(
    results: Dict[str, dict], reference: Dict[Tuple[str, int], Tuple[List[int], List[float]]], tol: float
) -> Tuple[List[str], Dict[str, Dict[str, Tuple[int, int, int]]], Dict[str, float]]:
    """Report lines, ``{engine: {scenario: (equal, near-tie, real)}}`` and each engine's widest reference gap
    at a divergence (``inf`` where it ran past a reference stop)."""
    lines, counts, widest = [], {}, {}
    for engine, res in results.items():
        for sname, sc in res.get("scenarios", {}).items():
            if sname not in PROMPT_SETS or not sc.get("rows"):
                continue
            tally = {"equal": 0, "near-tie": 0, "real": 0}
            for r, row in enumerate(sc["rows"]):
                if (sname, r) not in reference:
                    continue
                tokens, gaps, *asked = reference[(sname, r)]
                if asked and sc["rows"][asked[0]]["tokens"] != list(reference[(sname, asked[0])][0]):
                    lines.append(
                        f"    {engine}/{sname}: req {r}: not judged (its first answer was not the reference's)"
                    )
                    continue
                verdict, pos, gap = classify(row["tokens"], tokens, gaps, tol)
                tally[verdict] += 1
                if verdict != "equal":
                    widest[engine] = max(widest.get(engine, 0.0), float("inf") if gap is None else gap)
                    gap_text = "the reference stops there" if gap is None else f"reference gap {gap:.4f}"
                    lines.append(
                        f"    {engine}/{sname}: req {r}: leaves the reference at {pos} ({gap_text}): {verdict}"
                    )
            counts.setdefault(engine, {})[sname] = (tally["equal"], tally["near-tie"], tally["real"])
    return lines, counts, widest


def noise_verdict(widest: Dict[str, float], engines: Sequence[str]) -> List[str]:
    """Engines judged against plain vLLM's own bf16 noise: the widest reference gap at which a plain engine
    (``plain``, ``plain-tp2``) leaves the reference in the same results. An engine whose divergences are all
    at most that wide differs from the fp32 reference no more than vLLM without speculation does (``engines``:
    every judged engine; one that never diverges has width 0)."""
    plain = [widest.get(engine, 0.0) for engine in engines if engine.startswith("plain")]
    if not plain:
        return ["no plain engine in the results: no noise level to judge against"]
    noise = max(plain)
    verdict = {engine: widest.get(engine, 0.0) <= noise for engine in sorted(engines) if not engine.startswith("plain")}
    return [
        f"plain vLLM leaves the fp32 reference at reference gaps up to {noise:.4f}",
        "within that (divergences no wider than plain vLLM's own): " + json.dumps(verdict),
    ]


def bench_outputs(folders: Sequence[str]) -> Dict[str, Dict[int, List[List[int]]]]:
    """``{engine: {batch: outputs}}`` from the bench's ``outputs_<engine>_b<batch>.json`` files (later folders
    win)."""
    import glob
    import re

    found: Dict[str, Dict[int, List[List[int]]]] = {}
    for folder in folders:
        for path in sorted(glob.glob(os.path.join(folder, "outputs_*_b*.json"))):
            match = re.fullmatch(r"outputs_(.+)_b(\d+)\.json", os.path.basename(path))
            if match:
                with open(path) as f:
                    found.setdefault(match.group(1), {})[int(match.group(2))] = json.load(f)
    return found


def judge_bench(model, prompt_list: Sequence[Sequence[int]], found, tol: float) -> List[str]:
    """One line per engine and batch: equal / near-tie / real against the fp32 greedy reference."""
    cache: Dict[int, Tuple[List[int], List[float]]] = {}
    lines = [f"{'engine':<22}{'batch':>6}{'equal':>7}{'tie':>5}{'real':>6}  first divergences (row, position, gap)"]
    for engine, by_batch in sorted(found.items()):
        for batch, outputs in sorted(by_batch.items()):
            counts = {"equal": 0, "near-tie": 0, "real": 0}
            where = []
            for r, output in enumerate(outputs):
                i = r % len(prompt_list)
                if i not in cache or len(cache[i][0]) < len(output):
                    cache[i] = greedy_reference(model, prompt_list[i], len(output), {})
                verdict, position, gap = classify(output, *cache[i], tol)
                counts[verdict] += 1
                if position is not None:
                    where.append(f"({r}, {position}, {gap:.3f})" if gap is not None else f"({r}, {position})")
            lines.append(
                f"{engine:<22}{batch:>6}{counts['equal']:>7}{counts['near-tie']:>5}{counts['real']:>6}  "
                + " ".join(where)
            )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a pair directory (target/, prompts.json), as given to the harness")
    ap.add_argument("--results", action="append", default=[], help="vllm_ddtree_e2e.json (repeatable)")
    ap.add_argument(
        "--bench",
        action="append",
        default=[],
        help="a bench_vllm_ddtree.py output folder with outputs_<engine>_b<batch>.json (repeatable)",
    )
    ap.add_argument("--scenarios", default=",".join(PROMPT_SETS))
    ap.add_argument("--gap-tol", type=float, default=0.05)
    ap.add_argument(
        "--scenario-settings",
        help="JSON {scenario: settings} for results the harness wrote before it kept its settings",
    )
    ap.add_argument("--out", help="also write the report here")
    args = ap.parse_args()

    if not args.results and not args.bench:
        ap.error("give --results and/or --bench")
    import torch
    from ddtree.engine.target import load_causal_lm

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    given = None  # a tiny random model of the harness's (no prompts.json): the harness's own generated prompts
    if os.path.exists(os.path.join(args.model, "prompts.json")):
        with open(os.path.join(args.model, "prompts.json")) as f:
            given = json.load(f)
    target = os.path.join(args.model, "target")
    model = load_causal_lm(target, torch.float32).eval()
    if args.bench:
        if given is None:
            ap.error("--bench needs the pair's prompts.json in --model")
        lines = [
            f"fp32 reference of {target}; gap tolerance {args.gap_tol}; bench outputs {args.bench}",
            *judge_bench(model, given["batch32"], bench_outputs(args.bench), args.gap_tol),
        ]
        text = "\n".join(lines)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
        if not args.results:
            return 0
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    vocab = int(config.get("text_config", config)["vocab_size"])
    P = prompts(vocab, given)
    results: Dict[str, dict] = {}
    for path in args.results:  # a later file's scenarios replace an earlier one's, engine by engine
        with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:  # (records keep them gzipped)
            for engine, res in json.load(f)["results"].items():
                merged = results.setdefault(engine, {"scenarios": {}})
                merged["scenarios"].update(current_scenarios(res).get("scenarios", {}))  # this harness's prompts
    overrides = {}
    if args.scenario_settings:
        with open(args.scenario_settings) as f:
            overrides = json.load(f)
    wanted = [s for s in args.scenarios.split(",") if s]
    unknown = [s for s in wanted if s not in PROMPT_SETS]
    if unknown:
        ap.error(f"unknown scenarios {unknown}; known: {sorted(PROMPT_SETS)}")

    reference = {}
    cache: Dict[Tuple[str, int], Tuple[List[int], List[float]]] = {}
    for sname in wanted:
        if not any(sname in res.get("scenarios", {}) for res in results.values()):
            continue
        settings = scenario_settings(sname, results, overrides)
        grammar_of = row_grammars(settings, target, vocab)
        prompt_set = scenario_prompts(sname, P)
        for r, prompt in enumerate(prompt_set):
            grammar = grammar_of(r) if grammar_of else None
            regex = settings["regexes"][r % len(settings["regexes"])] if grammar_of else None
            key = json.dumps(dict(settings, regex=regex), sort_keys=True)
            rows = [
                res["scenarios"][sname]["rows"]
                for res in results.values()
                if sname in res.get("scenarios", {}) and len(res["scenarios"][sname].get("rows") or []) > r
            ]
            if not rows:
                continue
            length = max(len(row[r]["tokens"]) for row in rows)
            prompt_key = (key, tuple(prompt))
            if prompt_key not in cache or len(cache[prompt_key][0]) < length:
                cache[prompt_key] = greedy_reference(model, prompt, length, settings, grammar)
            tokens, gaps = cache[prompt_key]
            reference[(sname, r)] = (tokens[:length], gaps[:length])
        if sname in SECOND_TURN_ROUNDS:
            count, start = SECOND_TURN_ROUNDS[sname]
            rows = [res["scenarios"][sname].get("rows") or [] for res in results.values() if sname in res["scenarios"]]
            turns = range(start, start + count)
            lengths = {
                r: max(len(x[r]["tokens"]) for x in rows if len(x) > r) for r in turns if any(len(x) > r for x in rows)
            }
            first = prompt_set[:count]
            second_turn_references(
                reference, sname, first, start, lengths, lambda p, n: greedy_reference(model, p, n, settings)
            )

    lines, counts, widest = judge(results, reference, args.gap_tol)
    report = [
        f"fp32 reference of {target}; gap tolerance {args.gap_tol}; results {args.results}",
        *lines,
        "",
        f"{'engine':<16}{'scenario':<12}{'equal':>6}{'tie':>5}{'real':>6}",
    ]
    for engine, per in counts.items():
        for sname, (eq, tie, real) in per.items():
            report.append(f"{engine:<16}{sname:<12}{eq:>6}{tie:>5}{real:>6}")
    real_total = {e: sum(c[2] for c in per.values()) for e, per in counts.items()}
    report.append(f"real divergences by engine: {real_total}")
    report += noise_verdict(widest, list(counts))
    text = "\n".join(report)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
