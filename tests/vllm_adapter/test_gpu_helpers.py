"""The helpers the GPU harnesses share (they run only on a GPU; their pure parts are checked here)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from ddtree.vllm.tiny_models import engine_kwargs_for, spec_metrics  # noqa: E402


def test_spec_metrics_reads_vllm_counters_and_never_raises():
    metrics = [
        SimpleNamespace(name="vllm:spec_decode_num_drafts_total", value=10),
        SimpleNamespace(name="vllm:spec_decode_num_draft_tokens_total", value=640),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_total", value=12),
        SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", value=None, values=[8, 3, 1]),
        SimpleNamespace(name="vllm:num_requests_running", value=2),
        SimpleNamespace(name="vllm:num_preemptions_total", value=3),
        SimpleNamespace(name="vllm:prefix_cache_queries_total", value=1200),
        SimpleNamespace(name="vllm:prefix_cache_hits_total", value=448),
    ]
    out = spec_metrics(SimpleNamespace(get_metrics=lambda: metrics))
    assert out == {
        "drafts": 10.0,
        "draft_tokens": 640.0,
        "accepted": 12.0,
        "per_pos": [8.0, 3.0, 1.0],
        "preemptions": 3.0,
        "prefix_cache_queries": 1200.0,
        "prefix_cache_hits": 448.0,
    }

    def broken():
        raise RuntimeError("stats logging disabled")

    failed = spec_metrics(SimpleNamespace(get_metrics=broken))
    assert failed["drafts"] == 0.0 and "stats logging disabled" in failed["error"]


@pytest.mark.parametrize(
    "architecture, expected",
    [
        ("Qwen3ForCausalLM", {}),
        ("Qwen3NextForCausalLM", {"additional_config": {"gdn_prefill_backend": "triton"}}),
        (
            "Qwen3_5ForConditionalGeneration",
            {"additional_config": {"gdn_prefill_backend": "triton"}, "language_model_only": True},
        ),
    ],
)
def test_engine_arguments_follow_the_target_architecture(tmp_path, architecture, expected):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    assert engine_kwargs_for(str(tmp_path)) == expected


def test_tiny_qwen3_next_routes_every_token_to_the_chosen_number_of_experts(tmp_path):
    from ddtree.vllm.tiny_models import write_qwen3_next_target

    write_qwen3_next_target(str(tmp_path / "all"), experts_per_token=4)
    with open(tmp_path / "all" / "config.json") as handle:
        config = json.load(handle)
    assert config["num_experts_per_tok"] == 4 and config["num_experts"] == 4
    with pytest.raises(ValueError, match="experts_per_token must be 1..4"):
        write_qwen3_next_target(str(tmp_path / "bad"), experts_per_token=5)


def _fp32_reference():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    import fp32_reference

    return fp32_reference


def _harness():
    _fp32_reference()  # (the GPU scripts' folder on the path)
    import vllm_ddtree_e2e

    return vllm_ddtree_e2e


def test_fp32_reference_constrains_logits_like_vllms_sampler(monkeypatch):
    """The oracle that judges GPU outputs applies each scenario's settings as vLLM does: its penalties equal
    vLLM's ``apply_all_penalties``, its bias and min_tokens mask equal the processors' arithmetic."""
    import torch
    import vllm.v1.sample.ops.penalties as penalties
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    monkeypatch.setattr(penalties, "PIN_MEMORY", False)  # a CUDA build of torch on a machine without a GPU
    ref = _fp32_reference()
    vocab = 16
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(3)) * 4
    prompt, output = [1, 4, 4, 9], [4, 7, 7, 7, 2]
    settings = ref.CONSTRAINED_SCENARIOS["penalties"]
    want = apply_all_penalties(
        logits[None].clone(),
        torch.tensor([prompt]),
        torch.tensor([settings["presence_penalty"]]),
        torch.tensor([settings["frequency_penalty"]]),
        torch.tensor([settings["repetition_penalty"]]),
        [output],
    )[0]
    assert torch.allclose(ref.constrain(logits, prompt, output, settings), want, atol=1e-6)

    bias = ref.constrain(logits, prompt, output, {"logit_bias": {5: 4.0, 9: -6.0}})
    assert bias[5] == logits[5] + 4.0 and bias[9] == logits[9] - 6.0 and torch.equal(bias[:5], logits[:5])
    held = ref.constrain(logits, prompt, output, {"stop": [2, 3], "min_tokens": 6})  # 5 outputs < 6
    assert torch.isinf(held[[2, 3]]).all() and torch.equal(held[4:], logits[4:])
    free = ref.constrain(logits, prompt, output, {"stop": [2, 3], "min_tokens": 5})
    assert torch.equal(free, logits)


def test_fp32_reference_classifies_divergences_by_the_references_gap():
    ref = _fp32_reference()
    reference, gaps = [5, 6, 7, 8], [1.0, 0.01, 2.0, 0.5]
    assert ref.classify([5, 6, 7, 8], reference, gaps, 0.05) == ("equal", None, None)
    assert ref.classify([5, 6], reference, gaps, 0.05) == ("equal", None, None)  # shorter: max_tokens
    assert ref.classify([5, 9, 1], reference, gaps, 0.05) == ("near-tie", 1, 0.01)
    assert ref.classify([5, 6, 3], reference, gaps, 0.05) == ("real", 2, 2.0)
    assert ref.classify([5, 6, 7, 8, 2], reference, gaps, 0.05) == ("real", 4, None)  # ran past a stop
    lines, counts, widest = ref.judge(
        {
            "e": {"scenarios": {"batch1": {"rows": [{"tokens": [5, 9]}, {"tokens": [5]}]}}},
            "plain": {"scenarios": {"batch1": {"rows": [{"tokens": [5, 6, 3]}, {"tokens": [5, 6, 7, 8]}]}}},
        },
        {("batch1", 0): (reference, gaps), ("batch1", 1): (reference, gaps)},
        0.05,
    )
    assert counts == {"e": {"batch1": (1, 1, 0)}, "plain": {"batch1": (1, 0, 1)}} and "req 0" in lines[0]
    assert widest == {"e": 0.01, "plain": 2.0}
    assert '{"e": true}' in ref.noise_verdict(widest, ["e", "plain"])[1]
    assert '{"e": false}' in ref.noise_verdict({"e": 2.5, "plain-tp2": 2.0}, ["e", "plain-tp2"])[1]
    assert '{"e": false}' in ref.noise_verdict({"e": 0.01}, ["e", "plain"])[1]  # plain never diverged: noise 0
    assert "no plain engine" in ref.noise_verdict({"e": 0.01}, ["e"])[0]


def test_fp32_reference_judges_second_turns_only_where_the_first_answer_was_the_references():
    """shared_prefix's third round continues the reference's own first answers (``second_turn``); an engine whose
    first answer differs was asked another question there: its row is reported, not judged."""
    ref = _fp32_reference()
    n = ref.SHARED_PREFIX_REQUESTS
    first = [[100 + i, 1, 2] for i in range(n)]
    reference = {("shared_prefix", i): ([40 + i, 41], [1.0, 1.0]) for i in range(n)}
    asked = []

    def greedy(prompt, length):
        asked.append(prompt)
        return [9] * (length + 2), [1.0] * (length + 2)

    assert ref.SECOND_TURN_ROUNDS["shared_prefix"] == (n, 2 * n)
    ref.second_turn_references(reference, "shared_prefix", first, 2 * n, {2 * n: 3, 2 * n + 1: 2}, greedy)
    assert asked == [[100, 1, 2, 40, 41, 5, 6, 7], [101, 1, 2, 41, 41, 5, 6, 7]]
    assert reference[("shared_prefix", 2 * n)] == ([9, 9, 9], [1.0, 1.0, 1.0], 0)
    assert ("shared_prefix", 2 * n + 2) not in reference  # no engine row there: nothing asked

    def rows(first_answer, third):
        out = [{"tokens": [40 + i, 41]} for i in range(2 * n)] + [{"tokens": third}, {"tokens": [9, 9]}]
        out[0] = {"tokens": first_answer}
        return {"scenarios": {"shared_prefix": {"rows": out}}}

    same, other = rows([40, 41], [9, 9, 1]), rows([40, 77], [9, 9, 9])
    lines, counts, _ = ref.judge({"same": same, "other": other}, reference, 0.05)
    # Judged: the first round's n rows (the repeats have no reference here) and the third round's two rows.
    assert counts["same"]["shared_prefix"] == (n + 1, 0, 1)  # the third round's first row leaves the reference
    # Its first answer to prompt 0 differs (real); its second turn to it is not judged; the other one is, equal.
    assert counts["other"]["shared_prefix"] == (n - 1 + 1, 0, 1)
    assert any("other/shared_prefix: req 16: not judged" in line for line in lines)


def test_min_p_check_needs_logprobs_and_flags_a_token_below_the_floor():
    import math
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import MIN_P, min_p_respected

    at_floor = math.log(MIN_P)
    assert min_p_respected([{"top": [-1.0, -0.5], "logprobs": [-1.0, -0.5 + at_floor]}])
    assert not min_p_respected([{"top": [-1.0, -0.5], "logprobs": [-1.0, -0.6 + at_floor]}])
    assert not min_p_respected([{"top": None, "logprobs": None}])  # nothing to judge is not a pass
    assert not min_p_respected([{"top": [-1.0], "logprobs": [None]}])


def test_fp32_reference_replays_the_settings_a_run_kept():
    ref = _fp32_reference()
    ran = {
        "a": {"scenarios": {"logit_bias": {"settings": {"logit_bias": {"5": 1.0}}}}},
        "b": {"scenarios": {"logit_bias": {"settings": {"logit_bias": {"5": 1.0}}}, "batch1": {}}},
    }
    assert ref.scenario_settings("logit_bias", ran, {}) == {"logit_bias": {"5": 1.0}}
    assert ref.scenario_settings("logit_bias", ran, {"logit_bias": {"x": 1}}) == {"x": 1}  # an override wins
    assert ref.scenario_settings("batch1", ran, {}) == {}
    with pytest.raises(SystemExit, match="pass --scenario-settings"):
        ref.scenario_settings("penalties", ran, {})  # a constrained scenario that kept nothing
    ran["b"]["scenarios"]["logit_bias"]["settings"] = {"logit_bias": {"5": 2.0}}
    with pytest.raises(SystemExit, match="different settings"):
        ref.scenario_settings("logit_bias", ran, {})


def test_harness_runs_the_fp32_judge_on_its_own_results(tmp_path):
    """``--fp32-reference``: after the engines, the harness judges its JSON on CPU and logs the verdict line."""
    import io
    import sys
    import time
    from pathlib import Path

    import torch
    from ddtree.engine.target import load_causal_lm

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    import fp32_reference
    from vllm_ddtree_e2e import judge_against_fp32, prompts

    pair = Path(__file__).resolve().parents[1] / "fixtures" / "models"
    given = json.loads((pair / "prompts.json").read_text())
    model = load_causal_lm(str(pair / "target"), torch.float32).eval()
    want, _ = fp32_reference.greedy_reference(model, prompts(4096, given)["batch1"][0], 3, {})
    rows = {"plain": [want], "ddtree64": [want[:2] + [(want[2] + 1) % 4096]]}  # ddtree leaves it at position 2
    results = {name: {"scenarios": {"batch1": {"rows": [{"tokens": r} for r in toks]}}} for name, toks in rows.items()}
    (tmp_path / "vllm_ddtree_e2e.json").write_text(json.dumps({"results": results}))
    args = SimpleNamespace(model=str(pair), out=str(tmp_path), gap_tol=0.05, deadline=600)
    log = io.StringIO()
    judge_against_fp32(args, time.time(), log)
    report = (tmp_path / "fp32_reference.txt").read_text()
    assert "ddtree64/batch1: req 0: leaves the reference at 2" in report
    assert "rc 0" in log.getvalue() and '"ddtree64": false' in log.getvalue()
    judge_against_fp32(SimpleNamespace(**{**vars(args), "model": "tiny-qwen3"}), time.time(), log)
    assert "needs a pair directory" in log.getvalue()
    # A record's gzipped JSON judges the same.
    import gzip
    import subprocess

    with gzip.open(tmp_path / "kept.json.gz", "wt") as f:
        f.write((tmp_path / "vllm_ddtree_e2e.json").read_text())
    script = Path(fp32_reference.__file__)
    command = [sys.executable, str(script), "--model", str(pair), "--results", str(tmp_path / "kept.json.gz")]
    subprocess.run(command + ["--out", str(tmp_path / "from_gz.txt")], check=True, capture_output=True)
    judged = (tmp_path / "from_gz.txt").read_text()
    assert (
        judged.split("\n", 1)[1] == report.split("\n", 1)[1] and "kept.json.gz" in judged
    )  # (the first line names it)


def test_fp32_reference_judges_the_benchs_kept_outputs(tmp_path):
    """--bench: each engine's outputs (the pair's prompts cycled to the batch size) against the fp32 greedy
    reference; a token changed where the reference is sure is a real divergence."""
    import torch
    from ddtree.engine.target import load_causal_lm

    ref = _fp32_reference()
    with open("tests/fixtures/models/prompts.json") as f:
        prompts = json.load(f)["batch32"][:2]
    model = load_causal_lm("tests/fixtures/models/target", torch.float32).eval()
    greedy = [ref.greedy_reference(model, p, 6, {}) for p in prompts]
    exact = [tokens for tokens, _ in greedy]
    sure = max(range(6), key=lambda i: greedy[1][1][i])  # the reference's widest gap in row 1
    wrong = [list(exact[0]), list(exact[1])]
    wrong[1][sure] = (wrong[1][sure] + 1) % 1000
    (tmp_path / "outputs_good_b2.json").write_text(json.dumps(exact))
    (tmp_path / "outputs_bad_b2.json").write_text(json.dumps(wrong))
    (tmp_path / "unrelated.json").write_text("{}")
    found = ref.bench_outputs([str(tmp_path)])
    assert set(found) == {"good", "bad"} and set(found["good"]) == {2}
    lines = ref.judge_bench(model, prompts, found, 0.05)
    good = next(line for line in lines if line.startswith("good"))
    bad = next(line for line in lines if line.startswith("bad"))
    assert good.split()[1:5] == ["2", "2", "0", "0"]
    assert bad.split()[1:5] == ["2", "1", "0", "1"] and f"(1, {sure}," in bad


def test_harness_fails_a_scenario_that_did_not_exercise_its_trees():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import scenario_exercised

    counts = dict(trees=12, partial_trees=0, verify_steps=12, full_graph_steps=9)
    assert scenario_exercised("batch1", counts)[0] is True
    note = "FULL-graph steps 9/12, device-planned 0 (subset steps 0), mixed steps walked by a graph 0 of 0 beside"
    assert note in scenario_exercised("batch1", counts)[1]
    more = dict(counts, device_plan_steps=7, device_plan_subset_steps=2, mixed_walk_graph_steps=3)
    assert (
        "device-planned 7 (subset steps 2), mixed steps walked by a graph 3 of 0 beside a prefill;"
        in scenario_exercised("batch1", more)[1]
    )
    assert "declined" not in scenario_exercised("batch1", more)[1]
    declined = dict(more, **{"declined: near max_model_len": 4, "declined: top-K not kept": 0})
    assert "device plan declined {'near max_model_len': 4};" in scenario_exercised("batch1", declined)[1]
    assert scenario_exercised("near_max", counts)[0] is False  # no cut tree: plain decoding near the end
    assert scenario_exercised("near_max", dict(counts, partial_trees=3))[0] is True
    assert scenario_exercised("batch32", dict(counts, trees=0))[0] is False
    assert scenario_exercised("batch32", None) is None
    # one_token_prompts: the padded first decodes verified filler trees (none: vLLM did not pad, nothing tested).
    assert scenario_exercised("one_token_prompts", dict(counts, filler_trees=0))[0] is False
    assert scenario_exercised("one_token_prompts", dict(counts, filler_trees=2))[0] is True
    assert scenario_exercised("one_token_prompts", dict(counts, filler_trees=0), schedule=True)[0] is True
    # arrivals: some verify step ran beside a prefill, else no request arrived beside trees (also in an eager engine,
    # where no step is a FULL graph's).
    assert scenario_exercised("arrivals", dict(counts, full_graph_steps=0))[0] is False
    assert scenario_exercised("arrivals", dict(counts, prefill_beside_trees_steps=5))[0] is True
    assert (
        "mixed steps walked by a graph 3 of 5 beside a prefill;"
        in scenario_exercised("arrivals", dict(more, prefill_beside_trees_steps=5))[1]
    )


class _FakeEngine:
    """vLLM's LLMEngine as the arrivals scenario drives it: a request finishes ``steps[rid]`` engine steps after it
    was added; each step reports the requests that finished in it, and records which requests were running."""

    def __init__(self, steps):
        self.steps, self.left, self.log = steps, {}, []

    def add_request(self, rid, prompt, params):
        self.left[rid] = self.steps[rid]

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        self.log.append(sorted(self.left))
        outs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            if not self.left[rid]:
                del self.left[rid]
                outs.append(SimpleNamespace(request_id=rid, finished=True))
        return outs


def test_the_arrivals_scenario_adds_each_short_request_once_the_last_has_finished_and_the_long_ones_ran_alone():
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import run_arrivals

    steps = {"long-0": 30, "long-1": 30, "s0": 3, "s1": 4, "s2": 2}
    engine = _FakeEngine(steps)
    longs = [("long-0", "p", "lp"), ("long-1", "p", "lp")]
    shorts = [("s0", "p", "sp"), ("s1", "p", "sp"), ("s2", "p", "sp")]
    finished, arrived = run_arrivals(engine, longs, shorts, quiet_steps=2)
    assert set(finished) == set(steps)
    # 2 quiet steps, then each 2 steps after the last one finished; both long requests running at each arrival.
    assert arrived == {"s0": (2, 2), "s1": (7, 2), "s2": (13, 2)}
    for step, running in enumerate(engine.log):  # every arrival's steps beside both long requests, alone
        assert len([r for r in running if r.startswith("s")]) <= 1, (step, running)
    assert engine.log[2] == ["long-0", "long-1", "s0"] and engine.log[5] == ["long-0", "long-1"]
    # Long requests that finish first: the short ones still arrive, one at a time, and the scenario ends.
    engine = _FakeEngine(dict(steps, **{"long-0": 3, "long-1": 3}))
    finished, arrived = run_arrivals(engine, longs, shorts, quiet_steps=2)
    assert set(finished) == set(steps) and list(arrived) == ["s0", "s1", "s2"]
    assert [running for _, running in arrived.values()] == [2, 0, 0]  # (recorded: the later ones arrived alone)
    with pytest.raises(RuntimeError, match="did not finish in 5 engine steps"):
        run_arrivals(_FakeEngine(steps), longs, shorts, max_steps=5)


def test_one_token_prompts_queue_behind_a_full_batch_of_longer_ones():
    """The scenario's one-token prompts come after batch32's 32 prompts (max_num_seqs), so each is admitted while
    longer requests decode; the fp32 judge replays the same rows."""
    from fp32_reference import PROMPT_SETS, scenario_prompts
    from vllm_ddtree_e2e import ONE_TOKEN_PROMPTS, prompts

    P = prompts(1000)
    rows = scenario_prompts("one_token_prompts", P)
    assert PROMPT_SETS["one_token_prompts"] == "one_token" and rows == P["one_token"]
    assert rows[:32] == P["batch32"] and len(rows) == 32 + ONE_TOKEN_PROMPTS
    assert all(len(p) == 1 for p in rows[32:]) and [p[0] for p in rows[32:]] == [p[0] for p in P["batch32"][:8]]
    assert len(P["max_tokens"]) == 32 and min(P["max_tokens"]) < max(P["max_tokens"])  # some finish early


def test_harness_fails_an_engine_whose_switched_path_did_not_run():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import ENGINES, switched_paths_exercised

    late = ENGINES["ddtree64-late"]["env"]
    ran = dict(device_accept_steps=40, late_tree_steps=40, early_output_steps=38)
    assert switched_paths_exercised(late, ran) == [
        ("device_accept_steps", True),
        ("late_tree_steps", True),
        ("early_output_steps", True),
    ]
    assert ("late_tree_steps", False) in switched_paths_exercised(late, dict(ran, late_tree_steps=0))
    assert switched_paths_exercised(ENGINES["ddtree64-device"]["env"], {}) == [("device_accept_steps", False)]
    assert switched_paths_exercised(ENGINES["ddtree64"].get("env", {}), {}) == []
    synchronous = dict(ran, async_scheduling=False)  # the switch was set but the engine ran synchronously
    assert ("async_scheduling", False) in switched_paths_exercised(ENGINES["ddtree64-async"]["env"], synchronous)
    # Launch ahead set to `always` (gated although the drafter has landed) must show gated steps.
    assert ("early_launch_steps", False) in switched_paths_exercised(ENGINES["ddtree64-async-host-plan"]["env"], ran)
    # The default engine must have turned the device plan on at start-up and run it.
    default = ENGINES["ddtree64-async"]["env"]
    checks = dict(switched_paths_exercised(default, dict(ran, device_plan="on", device_plan_steps=30)))
    assert checks["device_plan_on"] is True and checks["device_plan_steps"] is True
    checks = dict(switched_paths_exercised(default, dict(ran, device_plan="off: needs late trees")))
    assert checks["device_plan_on"] is False and checks["device_plan_steps"] is False
    assert "device_plan_on" not in dict(switched_paths_exercised(ENGINES["ddtree64-async-host-plan"]["env"], ran))
    assert "device_plan_on" not in dict(switched_paths_exercised(ENGINES["ddtree64-async-lazy"]["env"], ran))
    assert "device_plan_on" not in dict(switched_paths_exercised(default, ran, full_graphs=False))  # (--eager)
    # Commits reading the walk's paths in place must have run (counted) in the engine that sets them on.
    inplace = ENGINES["ddtree64-async"]["env"]
    assert ("commit_in_place_steps", False) in switched_paths_exercised(inplace, ran)
    assert ("commit_in_place_steps", True) in switched_paths_exercised(inplace, dict(ran, commit_in_place_steps=30))
    # DDTREE_PRECAPTURE=all: the sizes and the commits captured at start-up must both show.
    everything = ENGINES["ddtree64-async-precapture-all"]["env"]
    checks = dict(switched_paths_exercised(everything, dict(ran, precaptured_sizes=32, precaptured_commits=0)))
    assert checks["precaptured_sizes"] is True and checks["precaptured_commits"] is False
    assert ("precaptured_commits", True) in switched_paths_exercised(everything, dict(ran, precaptured_commits=32))
    # DDTREE_DEVICE_PLAN: device-planned steps, steps that uploaded nothing, and its graphs captured at start-up.
    device_plan = ENGINES["ddtree64-async-device-plan"]["env"]
    shown = dict(ran, device_plan_steps=40, device_plan_resumed_steps=35, precaptured_device_plans=32)
    checks = dict(switched_paths_exercised(device_plan, shown))
    assert [checks[k] for k in ("device_plan_steps", "device_plan_resumed_steps", "precaptured_device_plans")] == [
        True, True, True,
    ]  # fmt: skip
    checks = dict(switched_paths_exercised(device_plan, dict(shown, device_plan_resumed_steps=0)))
    assert checks["device_plan_resumed_steps"] is False
    lazy = dict(device_plan, DDTREE_PRECAPTURE="0")
    assert "precaptured_device_plans" not in dict(switched_paths_exercised(lazy, shown))
    # DDTREE_SLIDING_DRAFTER: drafter passes whose sliding-window layers got their own metadata.
    sliding = ENGINES["ddtree64-async-sliding-drafter"]["env"]
    assert ("sliding_drafter_steps", False) in switched_paths_exercised(sliding, ran)
    assert ("sliding_drafter_steps", True) in switched_paths_exercised(sliding, dict(ran, sliding_drafter_steps=9))


def test_the_sliding_drafter_engine_runs_a_copy_of_the_drafter_with_the_released_layer_kinds(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import sliding_drafter_copy

    pair = Path(__file__).resolve().parents[1] / "fixtures" / "models" / "drafter"
    out = sliding_drafter_copy(str(pair), 8, str(tmp_path / "sliding"))
    config = json.loads((Path(out) / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"] and config["sliding_window"] == 8
    assert config["use_sliding_window"] is True
    assert json.loads((pair / "config.json").read_text()).get("layer_types") == ["full_attention"] * 2  # untouched


def test_harness_fails_an_engine_whose_statistics_lost_device_walked_steps():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import statistics_complete

    assert statistics_complete(dict(device_accept_steps=50, stats_lost_steps=0)) == [("stats_lost_steps", True)]
    assert statistics_complete(dict(device_accept_steps=50, stats_lost_steps=2)) == [("stats_lost_steps", False)]
    assert statistics_complete(dict(device_accept_steps=0, stats_lost_steps=0)) == []  # the host walk: no ring


def test_harness_fails_an_engine_whose_device_walk_replayed_no_graph():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import step_graphs_exercised

    ran = dict(full_graph_steps=40, device_accept_steps=50, walk_graph_steps=35, walk_target_in_place_steps=30)
    assert step_graphs_exercised({}, ran) == [("walk_graph_steps", True), ("walk_target_in_place_steps", True)]
    assert step_graphs_exercised({}, dict(ran, walk_graph_steps=0))[0] == ("walk_graph_steps", False)
    # The sampler's greedy tokens never written where the graph reads them: the walks copied every step.
    assert step_graphs_exercised({}, dict(ran, walk_target_in_place_steps=0))[1] == (
        "walk_target_in_place_steps",
        False,
    )
    # Only sampled scenarios ran (t1, min_p): no all-greedy step to write in place.
    only_sampled = step_graphs_exercised({}, dict(ran, walk_target_in_place_steps=0), greedy_ran=False)
    assert only_sampled == [("walk_graph_steps", True)]
    assert step_graphs_exercised({"DDTREE_STEP_GRAPHS": "0"}, dict(ran, walk_graph_steps=0)) == []
    assert step_graphs_exercised({}, dict(ran, device_accept_steps=0, walk_graph_steps=0)) == []  # the host walk
    assert step_graphs_exercised({}, dict(ran, full_graph_steps=2, walk_graph_steps=0)) == []  # too few to replay


def test_harness_fails_a_schedule_whose_smaller_trees_replayed_no_full_graph():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import ENGINES, schedule_graphs_exercised

    spec = ENGINES["ddtree64to16"]["spec"]
    # As read back from the child's JSON: string keys.
    ran = {"steps_by_budget": {"16": 30, "64": 50}, "full_graph_steps_by_tree_tokens": {"17": 28, "65": 40}}
    assert schedule_graphs_exercised(spec, ran) == [("full_graph_steps_of_budget_16", True)]
    piecewise = dict(ran, full_graph_steps_by_tree_tokens={"65": 40})
    assert schedule_graphs_exercised(spec, piecewise) == [("full_graph_steps_of_budget_16", False)]
    assert schedule_graphs_exercised(spec, dict(ran, steps_by_budget={"64": 50})) == []  # budget 16 never used
    assert schedule_graphs_exercised(ENGINES["ddtree64"]["spec"], ran) == []
    # auto: its candidates' graphs, and at least one decision (keeping the largest budget is a decision too).
    auto = dict(ran, auto_budget={"candidates": [16, 32, 64], "decisions": 3, "probes": 1})
    auto_spec = ENGINES["ddtree-auto"]["spec"]
    assert schedule_graphs_exercised(auto_spec, auto) == [
        ("full_graph_steps_of_budget_16", True),
        ("auto_budget_decisions", True),
        ("auto_budget_probes", True),
    ]
    undecided = dict(auto, auto_budget={"candidates": [16, 32, 64], "decisions": 0}, steps_by_budget={"64": 9})
    assert schedule_graphs_exercised(auto_spec, undecided) == [
        ("auto_budget_decisions", False),
        ("auto_budget_probes", False),
    ]


def test_harness_keeps_the_finished_scenarios_of_a_child_that_died(tmp_path):
    import io
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import load_partial_results, partial_results_path

    log = io.StringIO()
    assert load_partial_results(str(tmp_path), "ddtree64", log) is None  # nothing finished: nothing kept
    finished = {"engine": "ddtree64", "init_s": 1.0, "scenarios": {"batch1": {"rows": []}}, "errors": {}}
    Path(partial_results_path(str(tmp_path), "ddtree64")).write_text(json.dumps(finished))
    kept = load_partial_results(str(tmp_path), "ddtree64", log)
    assert list(kept["scenarios"]) == ["batch1"] and "died or timed out" in kept["errors"]["child"]
    assert "kept 1 finished scenarios" in log.getvalue()


def test_the_harness_reuses_chosen_engines_of_an_earlier_run_gzipped_or_not(tmp_path):
    import gzip
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import reused_results

    earlier = {"results": {"plain": {"scenarios": 1}, "ddtree64": {"scenarios": 2}}}
    plain, packed = tmp_path / "e2e.json", tmp_path / "e2e.json.gz"
    plain.write_text(json.dumps(earlier))
    with gzip.open(packed, "wt") as f:
        json.dump(earlier, f)
    assert reused_results(str(plain), ["ddtree64-async"]) == earlier["results"]
    assert reused_results(f"{packed}:plain", ["ddtree64-async"]) == {"plain": {"scenarios": 1}}
    assert reused_results(str(packed), ["ddtree64"]) == {"plain": {"scenarios": 1}}  # this run runs ddtree64 itself
    with pytest.raises(SystemExit, match=r"no results for \['dflash'\]"):
        reused_results(f"{packed}:plain,dflash", [])


def test_several_reused_runs_merge_scenario_by_scenario_the_later_run_winning(tmp_path):
    """An old run's plain (every scenario, near_max of version 1) joined by a new run of plain on near_max alone:
    the merged plain has the old batch1, the new near_max, and the new run's other fields."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import SCENARIO_VERSIONS, merged_reuse

    old = {"init_s": 1, "scenarios": {"batch1": {"rows": [1]}, "stop": {"rows": [2]}, "near_max": {"rows": [3]}}}
    new = {"init_s": 2, "scenarios": {"near_max": {"rows": [4], "version": SCENARIO_VERSIONS["near_max"]}}}
    first, second = tmp_path / "old.json", tmp_path / "new.json"
    first.write_text(json.dumps({"results": {"plain": old, "ddtree64": old}}))
    second.write_text(json.dumps({"results": {"plain": new}}))
    merged = merged_reuse([f"{first}:plain", str(second)], ["ddtree-auto"])
    assert list(merged) == ["plain"] and merged["plain"]["init_s"] == 2
    scenarios = merged["plain"]["scenarios"]
    assert scenarios["batch1"] == {"rows": [1]} and scenarios["near_max"]["rows"] == [4] and "stop" in scenarios
    assert merged_reuse([str(second), f"{first}:plain"], [])["plain"]["scenarios"]["near_max"]["rows"] == [4]


def test_results_of_an_older_near_max_are_neither_reused_nor_judged(tmp_path):
    """near_max version 2 leaves 120 tokens of room (whole trees, then cut ones); a version-1 run (20 tokens, no
    version recorded) had another prompt: its near_max rows are dropped, its other scenarios kept."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import MAX_MODEL_LEN, NEAR_MAX_ROOM, SCENARIO_VERSIONS, prompts, reused_results

    old = {"scenarios": {"batch1": {"rows": []}, "near_max": {"rows": [{"tokens": [1] * 19}]}}}
    new = {"scenarios": {"near_max": {"rows": [], "version": SCENARIO_VERSIONS["near_max"]}}}
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps({"results": {"plain": old, "ddtree64": new}}))
    reused = reused_results(str(path), [])
    assert list(reused["plain"]["scenarios"]) == ["batch1"] and list(reused["ddtree64"]["scenarios"]) == ["near_max"]
    assert len(prompts(4096)["near_max"]) == MAX_MODEL_LEN - NEAR_MAX_ROOM
    pair = {"batch32": [[5, 6]] * 32, "near_max": list(range(2, 1006))}
    assert prompts(4096, pair)["near_max"] == list(range(2, 2 + MAX_MODEL_LEN - NEAR_MAX_ROOM))


def test_every_engine_of_the_gpu_scripts_sets_known_switches_to_known_values():
    """A misspelt switch in a GPU engine would run the default path and waste the device time spent on it."""
    import sys
    from pathlib import Path

    from ddtree.vllm import config

    root = Path(__file__).resolve().parents[2]
    sys.path.insert(0, str(root / "tests" / "gpu"))
    sys.path.insert(0, str(root / "benches"))
    import bench_qwen36_shape
    from vllm_ddtree_e2e import ENGINES as E2E_ENGINES

    switches = {v for k, v in vars(config).items() if k.endswith("_ENV") and v.startswith("DDTREE_")}
    engines = {f"e2e {name}": e.get("env", {}) for name, e in E2E_ENGINES.items()}
    engines.update({f"27B {name}": (e or {}).get("env", {}) for name, e in bench_qwen36_shape.ENGINES.items()})
    assert len(engines) > 20
    for name, env in engines.items():
        assert set(env) <= switches, (name, set(env) - switches)
        known = {switch: ("0", "1") for switch in switches}
        known[config.LAUNCH_AHEAD_ENV] = tuple(config.LAUNCH_AHEAD_MODES)
        known[config.PRECAPTURE_ENV] = config.PRECAPTURE_MODES
        assert all(value in known[switch] for switch, value in env.items()), (name, env)


def test_the_harness_starts_engines_side_by_side_and_keeps_each_ones_results(tmp_path, monkeypatch):
    """``--concurrent-starts 2`` (and the default, every engine up to four): both engines get the gate and a fixed KV
    cache, their results are kept in order, and an engine left without time before the deadline is reported as
    skipped (fake engines; no GPU)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    import vllm_ddtree_e2e as harness

    fake = tmp_path / "engine.py"
    fake.write_text(
        "import json, sys\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from engine_turns import wait_for_turn\n"
        "name, args = sys.argv[2], sys.argv[3:]\n"
        "gate = args[args.index('--gate') + 1]\n"
        "assert args[args.index('--kv-cache-gib') + 1] == '4.0'\n"
        "wait_for_turn(gate, name)\n"
        "print('RESULT-JSON ' + json.dumps({'engine': name, 'init_s': 1.0, 'scenarios': {}, 'errors': {}}))\n"
    )
    benches = str(Path(harness.__file__).resolve().parents[2] / "benches")
    real = harness.engine_command

    def command(args, name, gate):
        return [sys.executable, str(fake), benches, name] + real(args, name, gate)[3:]

    monkeypatch.setattr(harness, "engine_command", command)
    pair = Path(__file__).resolve().parents[1] / "fixtures" / "models"
    argv = ["vllm_ddtree_e2e.py", "--model", str(pair), "--out", str(tmp_path / "out"), "--engines", "plain,ddtree16"]
    monkeypatch.setattr(sys, "argv", argv + ["--concurrent-starts", "2", "--deadline", "120"])
    harness.main()
    saved = json.loads((tmp_path / "out" / "vllm_ddtree_e2e.json").read_text())
    assert list(saved["results"]) == ["plain", "ddtree16"]
    monkeypatch.setattr(sys, "argv", argv + ["--concurrent-starts", "2", "--deadline", "30"])  # < 45 s: none start
    harness.main()
    logged = (tmp_path / "out" / "vllm_ddtree_e2e.log").read_text()
    assert "plain: SKIPPED" in logged and "ddtree16: SKIPPED" in logged
    # Without --concurrent-starts the harness starts its engines side by side (the fake insists on the gate).
    monkeypatch.setattr(sys, "argv", argv + ["--deadline", "120"])
    harness.main()
    saved = json.loads((tmp_path / "out" / "vllm_ddtree_e2e.json").read_text())
    assert list(saved["results"]) == ["plain", "ddtree16"] and not any(r["errors"] for r in saved["results"].values())


def test_shared_prefix_prompts_share_exactly_their_head_and_the_scenario_must_hit_the_cache():
    """The shared_prefix scenario's prompts: one head of ``shared`` tokens, each prompt its own after it (also from
    prompts shorter than the head); an engine with prefix caching passes only with hits, one without is not judged."""
    from vllm_ddtree_e2e import ENGINES, prefix_cache_exercised, prefix_caching_arg, shared_prefix_prompts

    given = [list(range(100, 190)), list(range(200, 230)), list(range(300, 400))]
    out = shared_prefix_prompts(given, 64, 8)
    assert len(out) == 8 and all(p[:64] == out[0][:64] for p in out)
    assert out[0][:64] == list(range(100, 164))
    assert len({tuple(p[64:]) for p in out}) == 8  # every prompt differs after the head
    assert all(len(p) > 64 for p in out)
    short = shared_prefix_prompts([[1, 2, 3]], 10, 2)
    assert short[0][:10] == [1, 2, 3, 1, 2, 3, 1, 2, 3, 1]

    def rows(first, later):  # 8 first answers, then 16 repeats and second turns, with their cached tokens
        return [{"cached_tokens": first}] * 8 + [{"cached_tokens": n} for n in later]

    assert prefix_cache_exercised(ENGINES["plain"], rows(0, [0] * 16)) is None
    assert prefix_cache_exercised(ENGINES["ddtree64-apc"], rows(0, [0] * 16))[0] is False
    assert prefix_cache_exercised(ENGINES["ddtree64-apc"], rows(48, [64] * 15 + [0]))[0] is False  # one missed
    assert prefix_cache_exercised(ENGINES["ddtree64-apc"], rows(48, []))[0] is False  # nothing after the first round
    passed, note = prefix_cache_exercised(ENGINES["ddtree64-apc"], rows(0, [64] * 8 + [96] * 8))
    assert passed and "hits in 16 of 16 later requests (1280 tokens)" in note
    assert "env" not in ENGINES["ddtree64-apc"]  # prefix caching as a user who sets nothing gets it
    assert prefix_caching_arg(ENGINES["ddtree64-apc"]) is None and prefix_caching_arg(ENGINES["plain-apc"]) is True
    assert prefix_caching_arg(ENGINES["ddtree64"]) is False  # the other engines turn it off


def test_second_turns_start_below_a_state_block_and_must_hit_past_their_first_prompt():
    """Hybrid targets' second_turns scenario: first prompts shorter than a state block (so a hit past them is a
    state block that decoding wrote), distinct; an engine caching hybrid prefixes passes only when every second turn
    read more cached tokens than its first prompt held; other engines are not judged there, nor by shared_prefix."""
    from vllm_ddtree_e2e import (
        ENGINES,
        SECOND_TURN_PROMPT,
        SECOND_TURN_REQUESTS,
        SWITCH_COUNTERS,
        prefix_cache_exercised,
        second_turn_prompts,
        state_cache_exercised,
    )

    out = second_turn_prompts([list(range(100, 130)), list(range(200, 300))], SECOND_TURN_REQUESTS)
    assert len(out) == SECOND_TURN_REQUESTS and all(len(p) == SECOND_TURN_PROMPT < 144 for p in out)
    assert len({tuple(p) for p in out}) == SECOND_TURN_REQUESTS and out[0][30:32] == [100, 101]

    def rows(later):
        return [{"cached_tokens": 0}] * SECOND_TURN_REQUESTS + [{"cached_tokens": n} for n in later]

    hybrid = ENGINES["ddtree64-async-hpc"]
    assert state_cache_exercised(ENGINES["ddtree64-async"], rows([0] * 8)) is None
    assert state_cache_exercised(hybrid, rows([144] * 8))[0] is True
    assert state_cache_exercised(hybrid, rows([144] * 7 + [96]))[0] is False  # a hit within the first prompt
    assert state_cache_exercised(hybrid, rows([]))[0] is False
    assert prefix_cache_exercised(hybrid, rows([0] * 16)) is None  # (shared_prefix's 64 shared tokens: no block)
    assert hybrid["env"]["DDTREE_HYBRID_PREFIX_CACHING"] == "1" and hybrid["prefix_caching"] is True
    assert ENGINES["ddtree64-late-hpc"]["env"]["DDTREE_ASYNC_SCHEDULING"] == "0"
    assert SWITCH_COUNTERS["DDTREE_HYBRID_PREFIX_CACHING"] == ("boundary_commit_trees", "boundary_commit_steps")


def test_harness_fails_scenarios_that_raised_and_those_that_ran_after():
    """A scenario that raised has no rows: it must fail the verdict, not be missing from it; and what the engine
    emitted after a step raised half-way is not evidence either way."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import engine_error_checks

    res = {
        "errors": {"min_tokens": "Traceback ...", "ddtree_summary": "Traceback ..."},
        "scenarios": {"stop": {"rows": []}, "logit_bias": {"rows": [], "after_error_in": "min_tokens"}},
    }
    assert engine_error_checks("dd", res) == {"dd/min_tokens/ran": False, "dd/logit_bias/clean_engine": False}
    assert engine_error_checks("dd", {"errors": {}, "scenarios": {"stop": {"rows": []}}}) == {}


def test_a_scenario_that_raised_leaves_no_request_in_the_engine():
    """The next scenario's ``generate`` would otherwise finish them among its own rows (c4ff208's logit_bias
    scenario returned 16 rows for its 8 requests)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import abort_left_over

    aborted = []
    engine = SimpleNamespace(
        output_processor=SimpleNamespace(request_states={"7": None, "8": None}), abort_request=aborted.extend
    )
    assert "aborted 2 requests" in abort_left_over(SimpleNamespace(llm_engine=engine))
    assert aborted == ["7", "8"]
    assert "could not abort" in abort_left_over(SimpleNamespace())


def test_harness_holds_the_host_plan_to_the_device_plans_tokens():
    """``X-host-plan`` against ``X`` (the default, device-planned): token for token, no tolerance."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import ENGINES, identical_outputs

    assert "ddtree64-async" in ENGINES and ENGINES["ddtree64-async-host-plan"]["env"]["DDTREE_DEVICE_PLAN"] == "0"
    rows = [{"tokens": [1, 2, 3], "gaps": [0.5] * 3}, {"tokens": [4, 5]}]
    assert identical_outputs(rows, [{"tokens": [1, 2, 3]}, {"tokens": [4, 5]}])
    assert not identical_outputs(rows, [{"tokens": [1, 2, 3]}, {"tokens": [4, 6]}])
    assert not identical_outputs(rows, rows[:1])


def test_fp32_reference_replays_the_structured_rows_under_their_regexes():
    """The judge's greedy reference under a row's regex (a kept setting, row r under regex r mod n) is what the
    reference engine decodes one token at a time under the same grammar, ended by the stop token; without the
    setting the scenario is not judged blind."""
    pytest.importorskip("xgrammar")
    import torch

    from ddtree.engine import GenerationConfig, GrammarConstraint, SpeculativeEngine
    from ddtree.engine.pair_demo import load_pair_prompts
    from ddtree.engine.target import load_causal_lm, require_supported_transformers

    try:  # (vLLM 0.33 pins transformers < 5.21, below what the reference engine drives)
        require_supported_transformers()
    except RuntimeError as why:
        pytest.skip(str(why))

    ref, harness = _fp32_reference(), _harness()
    pair = Path(__file__).resolve().parents[1] / "fixtures" / "models"
    target = str(pair / "target")
    model = load_causal_lm(target, torch.float32).eval()
    engine = SpeculativeEngine(model)
    settings = {"regexes": list(harness.STRUCTURED_REGEXES), "stop": [0]}
    grammar_of = ref.row_grammars(settings, target, engine.target.vocab_size)
    prompts = load_pair_prompts(str(pair))["prompts"][:2]
    for r, prompt in enumerate(prompts):
        tokens, gaps = ref.greedy_reference(model, prompt, 64, settings, grammar_of(r))
        expected = engine.generate(
            [prompt],
            GenerationConfig(
                mode="ar", max_new_tokens=64, stop_token_ids=[0], constraints=[GrammarConstraint(grammar_of(r))]
            ),
        )[0]
        assert tokens == expected.output_ids and tokens[-1] == 0 and len(gaps) == len(tokens)
    assert ref.row_grammars({"stop": [0]}, target, engine.target.vocab_size) is None
    with pytest.raises(SystemExit, match="pass --scenario-settings"):
        ref.scenario_settings("structured", {"a": {"scenarios": {"structured": {}}}}, {})


def test_the_structured_scenario_must_show_the_tree_masks_ran():
    harness = _harness()

    assert harness.tree_masks_ran({"grammar_tree_steps": 12, "grammar_trees": 30})
    assert not harness.tree_masks_ran({"grammar_tree_steps": 0, "grammar_trees": 0})
    assert not harness.tree_masks_ran({})  # a summary from before the counters: not evidence


def test_engines_with_the_default_subsets_must_show_subset_steps_and_the_no_subsets_engine_need_not():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "gpu"))
    from vllm_ddtree_e2e import ENGINES, switched_paths_exercised

    ran = {"device_plan_steps": 9, "device_plan_resumed_steps": 5, "precaptured_device_plans": 1, "device_plan": "on"}
    ran.update(async_scheduling=True, late_tree_steps=9, device_accept_steps=9)  # (DDTREE_ASYNC_SCHEDULING=1's)
    ran.update(commit_in_place_steps=9, precaptured_sizes=4)  # (the default engine's explicit switches)
    for name in ("ddtree64-async", "ddtree64-async-device-plan"):  # the default device plan, and it set explicitly
        env = ENGINES[name]["env"]
        assert "DDTREE_DEVICE_PLAN_SUBSETS" not in env
        assert ("device_plan_subset_steps", False) in switched_paths_exercised(env, ran), name
    env = ENGINES["ddtree64-async-device-plan"]["env"]
    assert ("precaptured_subset_plans", False) in switched_paths_exercised(env, ran)
    off = ENGINES["ddtree64-async-no-subsets"]["env"]
    assert off["DDTREE_DEVICE_PLAN"] == "1" and off["DDTREE_DEVICE_PLAN_SUBSETS"] == "0"
    assert all(passed for _, passed in switched_paths_exercised(off, ran))
    ran.update(device_plan_subset_steps=2, precaptured_subset_plans=3)
    for name in ("ddtree64-async", "ddtree64-async-device-plan"):
        assert all(passed for _, passed in switched_paths_exercised(ENGINES[name]["env"], ran)), name
