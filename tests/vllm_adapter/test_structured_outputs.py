"""Structured outputs over trees (patch 12, ``ddtree.vllm.grammar``): through vLLM's own scheduler, grammar manager
and bitmask code, every tree node's logits row is masked by the grammar after the committed text and that node's
root path (the oracle: an xgrammar matcher forked per node); draft slots are never cut or counted invalid; and
admission serves what the masks cover, naming the rest."""

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

vllm = pytest.importorskip("vllm")
xgr = pytest.importorskip("xgrammar")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benches"))
import bench_grammar_masks as grammar_bench  # noqa: E402
import bench_plan_path as bench  # noqa: E402

from ddtree.vllm import grammar, patches  # noqa: E402
from ddtree.vllm.config import (  # noqa: E402
    STRUCTURED_OUTPUTS_ENV,
    structured_outputs_refusal,
    structured_outputs_start_up_warning,
)
from ddtree.vllm.step import PLACEHOLDER  # noqa: E402

# The bench runner's proposals draw tokens below 4 x top_k: a 32-token vocabulary, a third of it inside the grammar.
TOP_K = 8
VOCAB = ["a", "b", "c", "d", "ab", "ba", "cd", "dc", "aa", "bb", "cc", "dd", "x", "{", "}", '"', ":", ",", "0", "1",
         "2", "3", "e", "f", "g", "h", "i", "j", "k", "l", "m", "<eos>"]  # fmt: skip
EOS = len(VOCAB) - 1
LETTERS, END = [0, 4, 8], 12  # "a", "ab", "aa"; "x"
GRAMMAR = 'root ::= [abcd]+ "x"'


@pytest.fixture(scope="module")
def compiled():
    info = xgr.TokenizerInfo(VOCAB, stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info).compile_grammar(GRAMMAR)


@pytest.fixture(autouse=True)
def patched():
    patches.apply()  # vLLM's Scheduler wrapped as a ddtree engine gets it (other engines: vLLM's own code)
    grammar.publish_step(None)
    yield
    grammar.publish_step(None)


def _request(compiled, committed=(), structured=True):
    from vllm.v1.structured_output.backend_xgrammar import XgrammarGrammar

    # (vLLM's StructuredOutputRequest: its grammar, and no reasoning section: vLLM 0.33 reads the field directly)
    request_grammar = XgrammarGrammar(len(VOCAB), xgr.GrammarMatcher(compiled), compiled)
    state = SimpleNamespace(grammar=request_grammar, reasoning_ended=None)
    assert state.grammar.accept_tokens("committed", list(committed))  # as vLLM advances it
    return SimpleNamespace(
        use_structured_output=structured,
        structured_output_request=state if structured else None,
        is_prefill_chunk=False,
        spec_token_ids=[],
        is_finished=lambda: False,
    )


def _scheduler(requests, budget, ddtree=True):
    """vLLM's Scheduler and StructuredOutputManager with the attributes their grammar code reads."""
    return grammar_bench.scheduler_for(requests, budget, ddtree, len(VOCAB))


def _allowed(matcher, path) -> np.ndarray:
    """The oracle: the tokens the grammar allows after ``path`` (every token where the path leaves the grammar or
    ends it: such a row is never read by an accepted path, vLLM's rule after a grammar's end)."""
    fork = matcher.fork()
    if not all(fork.accept_token(int(t)) for t in path) or fork.is_terminated():
        return np.ones(len(VOCAB), dtype=bool)
    row = xgr.allocate_token_bitmask(1, len(VOCAB))
    fork.fill_next_token_bitmask(row, 0)
    return _bits(row[0])


def _bits(row) -> np.ndarray:
    words = np.asarray(row, dtype=np.int64) & 0xFFFFFFFF
    return np.array([(words[t // 32] >> (t % 32)) & 1 for t in range(len(VOCAB))], dtype=bool)


def _paths(parents, tokens):
    """Each node's draft tokens from the root (the root's own token is committed), in node order."""
    paths = [[]]
    for j in range(1, len(parents)):
        paths.append(paths[parents[j]] + [int(tokens[j - 1])])
    return paths


def _planned_step(batch=3, budget=15, seed=0, structured=True):
    """A runner's host-planned step of ``batch`` whole trees (the bench runner, no engine) and the scheduler output
    it was planned from; the trees published as ``execute_model`` publishes them."""
    runner = bench.build_runner(batch, budget, 4, TOP_K, conv_window=0)
    with bench.vllm_parts_stubbed():
        output = bench.defer_proposal(runner, np.random.default_rng(seed))
        output.num_scheduled_tokens = {req_id: budget + 1 for req_id in runner.req_ids}
        output.has_structured_output_requests = structured
        runner._prepare_inputs(output, np.full(batch, budget + 1))
        runner._preprocess(output, output.total_num_scheduled_tokens)
    runner._ddtree_publish_for_grammars(output)
    return runner, output


def _masked_logits(runner, output, grammar_output):
    """vLLM's own ``apply_grammar_bitmask`` onto the step's logits (one row per scheduled token: B + 1 a tree)."""
    from vllm.v1.structured_output import utils

    logits = torch.zeros((output.total_num_scheduled_tokens, len(VOCAB)), dtype=torch.float32)
    pinned, utils.PIN_MEMORY = utils.PIN_MEMORY, False  # (no CUDA here to pin host memory with)
    try:
        utils.apply_grammar_bitmask(output, grammar_output, SimpleNamespace(req_ids=runner.req_ids), logits)
    finally:
        utils.PIN_MEMORY = pinned
    return logits


def _node_rows(runner, r):
    """Request ``r``'s tree (parents, draft tokens) and the logits row of each of its nodes."""
    plan = runner._ddtree_plan
    trees = plan.host_trees()
    first, end = trees.node_offsets[r], trees.node_offsets[r + 1]
    parents = trees.parents[first:end]
    tokens = trees.tokens[trees.token_offsets[r] : trees.token_offsets[r + 1]]
    return parents, tokens, plan.logit_rows[plan.node_offsets[r] : plan.node_offsets[r] + (end - first)]


@pytest.mark.parametrize("seed, threads", [(0, False), (1, False), (2, True), (3, True)])
def test_every_tree_nodes_logits_row_is_masked_by_the_grammar_after_its_root_path(compiled, seed, threads, monkeypatch):
    """``threads``: the two structured requests' trees walked on the pool (as for a real vocabulary's wide rows)."""
    submitted = []
    pool = grammar._walk_pool()
    spy = SimpleNamespace(submit=lambda work: submitted.append(work) or pool.submit(work))
    monkeypatch.setattr(grammar, "_walk_pool", lambda: spy)
    monkeypatch.setattr(grammar, "POOL_MIN_WORDS", 1 if threads else 10**6)
    runner, output = _planned_step(seed=seed)
    requests = {
        "r0": _request(compiled, committed=[0]),  # "a" committed: letters or the end may follow
        "r1": _request(compiled, structured=False),
        "r2": _request(compiled),  # nothing committed: a letter first
    }
    scheduler = _scheduler(requests, runner.ddtree_cfg.budget)
    before = dataclasses.replace(grammar.STATS)
    out = scheduler.get_grammar_bitmask(output)
    assert out.structured_output_request_ids == ["r0", "r2"]
    assert out.grammar_bitmask.shape == (2 * 16, 1)  # 1 + budget rows each, vLLM's layout
    logits = _masked_logits(runner, output, out)
    informative = unmasked = 0
    for r, req_id in enumerate(runner.req_ids):
        parents, tokens, rows = _node_rows(runner, r)
        request = requests[req_id]
        for j, path in enumerate(_paths(parents, tokens)):
            allowed = torch.isfinite(logits[rows[j]]).numpy()
            if request.use_structured_output:
                expected = _allowed(request.structured_output_request.grammar.matcher, path)
                informative += j > 0 and not expected.all()
                unmasked += bool(expected.all())  # (no row of this grammar allows every token)
            else:
                expected = np.ones(len(VOCAB), dtype=bool)  # unconstrained request: untouched
            np.testing.assert_array_equal(allowed, expected, err_msg=f"{req_id} node {j} path {path}")
        if request.use_structured_output:  # the walk left the grammar where it was
            assert request.structured_output_request.grammar.matcher.fork().accept_token(0)
    assert informative > 0, "no node below a root had a grammar row of its own: the check saw only roots"
    assert len(submitted) == (2 if threads else 0)  # (one walk per structured request)
    stats = grammar.STATS
    assert (stats.steps - before.steps, stats.trees - before.trees, stats.nodes - before.nodes) == (1, 2, 32)
    assert stats.unmasked_nodes - before.unmasked_nodes == unmasked and stats.seconds > before.seconds


@st.composite
def mixed_steps(draw):
    """A step of 1-5 requests, each unconstrained or structured (some text committed), with no draft slot or a
    tree of ``n`` nodes in ``S >= n - 1`` slots (a cut tree's unused slots), random parents and tokens."""
    requests = []
    for _ in range(draw(st.integers(1, 5))):
        structured = draw(st.booleans())
        committed = draw(st.lists(st.sampled_from(LETTERS), max_size=3))
        slots = draw(st.integers(0, 12))
        nodes = draw(st.integers(1, slots + 1)) if slots else 0
        parents = [-1] + [draw(st.integers(0, j - 1)) for j in range(1, nodes)]
        tokens = draw(st.lists(st.integers(0, len(VOCAB) - 1), min_size=max(nodes - 1, 0), max_size=max(nodes - 1, 0)))
        requests.append((structured, committed, slots, parents, tokens))
    return requests


@settings(max_examples=40, deadline=None)
@given(step=mixed_steps())
def test_any_mix_of_trees_cut_trees_and_plain_rows_lands_on_the_right_logits_rows(compiled, step):
    """Through vLLM's own bitmask code and ``apply_grammar_bitmask``, in vLLM's logits layout (``1 + slots`` rows a
    request, in batch order): a tree node's row is its path's mask, a slot its tree left unused allows everything, a
    structured request without slots gets vLLM's own row, and an unconstrained request's rows stay untouched."""
    from ddtree.vllm.grammar import StepTrees

    ids = [f"q{i}" for i in range(len(step))]
    requests = {i: _request(compiled, committed, structured) for i, (structured, committed, *_) in zip(ids, step)}
    with_trees = [(i, p, t) for i, (_, _, slots, p, t) in zip(ids, step) if slots]
    output = SimpleNamespace(
        num_scheduled_tokens={i: 1 + slots for i, (_, _, slots, *_) in zip(ids, step)},
        scheduled_spec_decode_tokens={i: [PLACEHOLDER] * slots for i, (_, _, slots, *_) in zip(ids, step) if slots},
        has_structured_output_requests=any(structured for structured, *_ in step),
        total_num_scheduled_tokens=sum(1 + slots for _, _, slots, *_ in step),
    )
    trees = {i: (np.array(p), np.array(t, dtype=np.int64)) for i, p, t in with_trees}
    tree_ids = [i for i, *_ in with_trees]
    # As the runner does: a step without a tree publishes nothing.
    grammar.publish_step(StepTrees(output, tree_ids, lambda: grammar_bench._batch(trees, tree_ids)) if trees else None)
    out = _scheduler(requests, 12).get_grammar_bitmask(output)
    if not output.has_structured_output_requests:
        assert out is None
        return
    logits = _masked_logits(SimpleNamespace(req_ids=ids), output, out)
    row = 0
    for i, (structured, committed, slots, parents, tokens) in zip(ids, step):
        allowed = torch.isfinite(logits[row : row + 1 + slots]).numpy()
        matcher = requests[i].structured_output_request.grammar.matcher if structured else None
        paths = _paths(parents, tokens) if slots else [[]]
        for j in range(1 + slots):
            if not structured or j >= len(paths):
                expected = np.ones(len(VOCAB), dtype=bool)
            else:
                expected = _allowed(matcher, paths[j])
            np.testing.assert_array_equal(allowed[j], expected, err_msg=f"{i} row {j} of {1 + slots}")
        row += 1 + slots


def test_vllms_chain_rows_would_mask_the_nodes_wrongly(compiled):
    """The oracle tells the chain's rows apart: a non-ddtree scheduler on the same step gives rows that differ."""
    runner, output = _planned_step(seed=0)
    requests = {"r0": _request(compiled, committed=[0]), "r1": _request(compiled), "r2": _request(compiled)}
    chain = _scheduler(requests, runner.ddtree_cfg.budget, ddtree=False).get_grammar_bitmask(output)
    tree = _scheduler(requests, runner.ddtree_cfg.budget).get_grammar_bitmask(output)
    assert chain.grammar_bitmask.shape == tree.grammar_bitmask.shape
    assert not np.array_equal(chain.grammar_bitmask, tree.grammar_bitmask)


def test_a_cut_tree_gets_its_nodes_rows_and_all_allowed_rows_after_them(compiled):
    budget = 15
    runner = bench.build_runner(2, budget, 4, TOP_K, conv_window=0)
    with bench.vllm_parts_stubbed():
        output = bench.defer_proposal(runner, np.random.default_rng(3))
        output.scheduled_spec_decode_tokens["r0"] = [PLACEHOLDER] * (budget - 6)  # r0's tree cut to 10 nodes
        output.total_num_scheduled_tokens -= 6
        output.num_scheduled_tokens = {"r0": budget + 1 - 6, "r1": budget + 1}
        output.has_structured_output_requests = True
        runner._prepare_inputs(output, np.array([budget + 1 - 6, budget + 1]))
        runner._preprocess(output, output.total_num_scheduled_tokens)
    runner._ddtree_publish_for_grammars(output)
    requests = {"r0": _request(compiled, committed=[1]), "r1": _request(compiled, committed=[2])}
    out = _scheduler(requests, budget).get_grammar_bitmask(output)
    if hasattr(out, "num_acceptable_drafts"):  # vLLM 0.33: a block of 1 + budget rows a request
        assert out.grammar_bitmask.shape[0] == 2 * (budget + 1) and out.num_acceptable_drafts == [budget - 6, budget]
    else:  # vLLM 0.25: packed, one row a logits row
        assert out.grammar_bitmask.shape[0] == (budget + 1 - 6) + (budget + 1)
    logits = _masked_logits(runner, output, out)
    for r, req_id in enumerate(runner.req_ids):
        parents, tokens, rows = _node_rows(runner, r)
        matcher = requests[req_id].structured_output_request.grammar.matcher
        for j, path in enumerate(_paths(parents, tokens)):
            np.testing.assert_array_equal(torch.isfinite(logits[rows[j]]).numpy(), _allowed(matcher, path))
    assert len(_node_rows(runner, 0)[0]) == budget + 1 - 6


def test_a_finished_grammar_leaves_every_row_of_its_tree_all_allowed(compiled):
    runner, output = _planned_step(batch=1)
    requests = {"r0": _request(compiled, committed=[0, END, EOS])}
    assert requests["r0"].structured_output_request.grammar.matcher.is_terminated()
    out = _scheduler(requests, runner.ddtree_cfg.budget).get_grammar_bitmask(output)
    assert (out.grammar_bitmask == -1).all()


def test_a_tree_the_runner_did_not_publish_for_this_step_is_an_error_not_a_chains_rows(compiled):
    runner, output = _planned_step(batch=2)
    requests = {"r0": _request(compiled), "r1": _request(compiled)}
    other = SimpleNamespace(**vars(output))  # another step's output (the publication is matched by identity)
    with pytest.raises(RuntimeError, match="'r0' has 15 draft slots but no tree"):
        _scheduler(requests, runner.ddtree_cfg.budget).get_grammar_bitmask(other)


def test_requests_without_draft_slots_keep_vllms_rows(compiled):
    """A step whose structured requests verify no tree (their first decode, or no tree published): vLLM's rows."""
    requests = {"r0": _request(compiled, committed=[0]), "r1": _request(compiled)}
    output = SimpleNamespace(
        num_scheduled_tokens={"r0": 1, "r1": 1}, scheduled_spec_decode_tokens={}, has_structured_output_requests=True
    )
    ours = _scheduler(requests, 15).get_grammar_bitmask(output)
    theirs = _scheduler(requests, 15, ddtree=False).get_grammar_bitmask(output)
    np.testing.assert_array_equal(ours.grammar_bitmask, theirs.grammar_bitmask)
    assert ours.structured_output_request_ids == theirs.structured_output_request_ids == ["r0", "r1"]


def test_a_step_without_structured_requests_is_vllms_at_once(compiled, monkeypatch):
    """vLLM asks for the masks every step: without a structured request nothing of ddtree's runs."""
    monkeypatch.setattr(grammar, "trees_for", lambda output: pytest.fail("the trees were read"))
    output = SimpleNamespace(num_scheduled_tokens={"r0": 16}, has_structured_output_requests=False)
    assert _scheduler({"r0": _request(compiled, structured=False)}, 15).get_grammar_bitmask(output) is None


def test_fill_step_bitmask_refuses_a_tree_larger_than_its_rows():
    parents, tokens = np.array([-1, 0, 0, 1]), np.array([0, 1, 2])
    out = torch.zeros((3, 1), dtype=torch.int32)
    with pytest.raises(RuntimeError, match="tree of 4 nodes has 3 rows"):
        grammar.fill_step_bitmask(out, ["r"], [2], None, lambda req_id: None, {"r": (parents, tokens)})


def test_fill_step_bitmask_in_blocks_puts_each_requests_rows_where_the_packed_layout_has_them(compiled):
    """vLLM 0.33's layout (a block of ``stride`` rows a request) holds the packed layout's rows, request by request."""
    matchers = {"a": _request(compiled).structured_output_request.grammar.matcher}
    matchers["c"] = _request(compiled, committed=[0]).structured_output_request.grammar.matcher
    trees = {"a": (np.array([-1, 0, 0, 1]), np.array([0, 1, 2])), "c": (np.array([-1, 0]), np.array([1]))}
    ids, drafts, stride = ["a", "b", "c"], [4, 0, 2], 6
    own = torch.full((3, 1), 7, dtype=torch.int32)  # vLLM's rows (read for "b", the request without a tree)
    packed = torch.zeros((9, 1), dtype=torch.int32)
    assert grammar.fill_step_bitmask(packed, ids, drafts, own, matchers.get, trees) == 9
    blocks = torch.full((18, 1), -5, dtype=torch.int32)
    assert grammar.fill_step_bitmask(blocks, ids, drafts, own, matchers.get, trees, stride) == 18
    starts = [0, 5, 6]
    for k in range(3):
        rows = slice(k * stride, k * stride + 1 + drafts[k])
        assert torch.equal(blocks[rows], packed[starts[k] : starts[k] + 1 + drafts[k]]), ids[k]
        assert bool((blocks[k * stride + 1 + drafts[k] : (k + 1) * stride] == -5).all())  # rows past its own: untouched
    assert int(blocks[stride, 0]) == 7
    with pytest.raises(RuntimeError, match="has 5 grammar rows in blocks of 4"):
        grammar.fill_step_bitmask(blocks, ids, drafts, own, matchers.get, trees, 4)


# ---- draft slots: never cut, never counted invalid ----------------------------------------------------------------
def test_synchronous_drafts_of_a_structured_request_are_scheduled_uncut(compiled):
    placeholders = [PLACEHOLDER] * 7
    for ddtree, expected in ((True, placeholders), (False, [])):  # vLLM's chain check cuts at the first refusal
        requests = {"r0": _request(compiled)}
        scheduler = _scheduler(requests, 7, ddtree=ddtree)
        scheduler.update_draft_token_ids(SimpleNamespace(req_ids=["r0"], draft_token_ids=[list(placeholders)]))
        assert requests["r0"].spec_token_ids == expected
        assert "should_advance" not in vars(scheduler.structured_output_manager)  # the manager's own method again


def test_the_grammar_checks_come_back_when_vllms_draft_update_fails(compiled):
    scheduler = _scheduler({"r0": _request(compiled)}, 7)
    with pytest.raises(TypeError):
        scheduler.update_draft_token_ids(SimpleNamespace(req_ids=["r0"], draft_token_ids=None))
    assert "should_advance" not in vars(scheduler.structured_output_manager)


def test_asynchronous_placeholders_stay_the_trees_slots_and_none_is_counted_invalid(compiled):
    for ddtree in (True, False):
        requests = {"r0": _request(compiled)}
        output = SimpleNamespace(scheduled_spec_decode_tokens={"r0": [PLACEHOLDER] * 5}, num_invalid_spec_tokens=None)
        drafts = SimpleNamespace(req_ids=["r0"], draft_token_ids=[[EOS, 1, 2, 3, 4]])  # refused at once
        _scheduler(requests, 5, ddtree=ddtree).update_draft_token_ids_in_output(drafts, output)
        if ddtree:
            assert output.scheduled_spec_decode_tokens == {"r0": [PLACEHOLDER] * 5}
            assert output.num_invalid_spec_tokens is None
        else:  # vLLM's chain: the refused drafts become placeholders, counted invalid
            assert output.num_invalid_spec_tokens == {"r0": 5}


# ---- the runner's side --------------------------------------------------------------------------------------------
def test_a_step_with_a_structured_request_is_planned_on_the_host_and_publishes_its_trees():
    runner = bench.build_runner(2, 15, 4, TOP_K, conv_window=0)
    bench.prepare_device_plan(runner, run_kernels=False)
    rng = np.random.default_rng(0)
    # (device, resumed): a device-planned step right after another resumes without an upload; after the host plan's
    # step the device's staging holds that step's layout, so the next device-planned step uploads again.
    steps = [(False, 1, 0), (False, 1, 1), (True, 0, 0), (False, 1, 0), (False, 1, 1)]
    for structured, on_device, resumed in steps:
        with bench.vllm_parts_stubbed():
            output = bench.defer_proposal(runner, rng)
            output.has_structured_output_requests = structured
            before = runner.ddtree_stats.device_plan_steps, runner.ddtree_stats.device_plan_resumed_steps
            runner._prepare_inputs(output, np.full(2, 16))
            runner._preprocess(output, output.total_num_scheduled_tokens)
        runner._ddtree_publish_for_grammars(output)
        assert runner.ddtree_stats.device_plan_steps - before[0] == on_device
        assert runner.ddtree_stats.device_plan_resumed_steps - before[1] == resumed
        published = grammar.trees_for(output)
        if not structured:
            assert published == {}
            continue
        trees = runner._ddtree_plan.trees  # built by the host: the trees the GPU verifies
        assert trees is not None and set(published) == {"r0", "r1"}
        for r, req_id in enumerate(runner.req_ids):
            parents, tokens = published[req_id]
            np.testing.assert_array_equal(parents, trees.parents[trees.node_offsets[r] : trees.node_offsets[r + 1]])
            np.testing.assert_array_equal(tokens, trees.tokens[trees.token_offsets[r] : trees.token_offsets[r + 1]])


# ---- admission ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "env, backend, world_size, parser, in_reasoning, refused",
    [
        ("1", "xgrammar", 1, "", False, None),
        ("1", "xgrammar", 1, "qwen3", True, None),
        (None, "xgrammar", 1, "", False, STRUCTURED_OUTPUTS_ENV),
        ("0", "xgrammar", 1, "", False, STRUCTURED_OUTPUTS_ENV),
        ("1", "xgrammar", 2, "", False, "parallelism"),
        ("1", "xgrammar", 1, "qwen3", False, "reasoning"),
        ("1", "guidance", 1, "", False, "'guidance' backend"),
        ("1", "outlines", 1, "", False, "'outlines' backend"),
    ],
)
def test_structured_outputs_are_refused_where_the_masks_do_not_reach(
    env, backend, world_size, parser, in_reasoning, refused
):
    environ = {} if env is None else {STRUCTURED_OUTPUTS_ENV: env}
    reason = structured_outputs_refusal(backend, world_size, parser, in_reasoning, environ)
    if refused is None:
        assert reason is None
    else:
        assert reason is not None and refused in reason and reason.startswith("structured outputs")


def _processor(structured_config, world_size=1):
    from vllm.v1.engine.input_processor import InputProcessor

    model_config = SimpleNamespace(
        max_logprobs=20,
        get_vocab_size=lambda: 100,
        logits_processors=None,
        is_diffusion=False,
        return_sampling_mask=False,  # (read by vLLM 0.33)
    )
    p = object.__new__(InputProcessor)  # vLLM's checks only read these attributes
    p.__dict__.update(
        model_config=model_config,
        validate_logits_processors_params=lambda params: None,  # (vLLM 0.33's, set in its __init__)
        speculative_config=SimpleNamespace(method="dflash"),
        structured_outputs_config=structured_config,
        renderer=SimpleNamespace(tokenizer=object()),
        vllm_config=SimpleNamespace(
            additional_config={"ddtree": {"budget": 8}},
            reasoning_config=None,
            _check_supports_watermarking=lambda params: False,  # (vLLM 0.33's)
            structured_outputs_config=structured_config,
            parallel_config=SimpleNamespace(world_size=world_size),
        ),
    )
    return p


def test_admission_through_vllms_own_checks_serves_xgrammar_requests_when_switched_on(monkeypatch):
    from vllm.config import StructuredOutputsConfig
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams

    def request():
        schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
        return SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))

    monkeypatch.delenv(STRUCTURED_OUTPUTS_ENV, raising=False)
    with pytest.raises(VLLMValidationError, match=STRUCTURED_OUTPUTS_ENV) as refused:
        _processor(StructuredOutputsConfig())._validate_params(request(), ("generate",))
    assert refused.value.parameter == "structured_outputs"
    monkeypatch.setenv(STRUCTURED_OUTPUTS_ENV, "1")
    served = request()
    _processor(StructuredOutputsConfig())._validate_params(served, ("generate",))  # "auto" picks xgrammar
    assert served.structured_outputs._backend == "xgrammar"
    # A tokenizer vLLM's own guidance check takes (0.33 checks it before ddtree's; the stand-in is none).
    guidance = pytest.importorskip("vllm.v1.structured_output.backend_guidance")
    if hasattr(guidance.GuidanceBackend, "is_tokenizer_supported"):
        monkeypatch.setattr(guidance.GuidanceBackend, "is_tokenizer_supported", staticmethod(lambda tokenizer: True))
    with pytest.raises(VLLMValidationError, match="'guidance' backend"):
        _processor(StructuredOutputsConfig(backend="guidance"))._validate_params(request(), ("generate",))
    with pytest.raises(VLLMValidationError, match="parallelism"):
        _processor(StructuredOutputsConfig(), world_size=2)._validate_params(request(), ("generate",))


@pytest.mark.parametrize(
    "env, backend, world_size, parser, warned",
    [
        ("1", "auto", 1, "", None),
        ("1", "xgrammar", 1, "", None),
        ("0", "guidance", 2, "qwen3", None),  # off: every request's 400 names the switch, nothing at start-up
        ("1", "guidance", 1, "", "'guidance' backend"),
        ("1", "auto", 2, "", "parallelism"),
        ("1", "auto", 1, "qwen3", "reasoning"),
    ],
)
def test_start_up_says_when_the_switch_serves_nothing(env, backend, world_size, parser, warned):
    warning = structured_outputs_start_up_warning(backend, world_size, parser, False, {STRUCTURED_OUTPUTS_ENV: env})
    if warned is None:
        assert warning is None
    else:
        assert (
            warning.startswith(f"{STRUCTURED_OUTPUTS_ENV}=1, but this engine refuses every request")
            and warned in warning
        )


def test_vllms_engine_config_with_a_guidance_backend_is_warned_about(h200_platform, monkeypatch, caplog):
    """Through vLLM's own config creation (``vllm serve``'s): the warning is logged once, before anything loads."""
    import logging

    from vllm.engine.arg_utils import AsyncEngineArgs

    monkeypatch.setenv(STRUCTURED_OUTPUTS_ENV, "1")
    pair = str(Path(__file__).resolve().parents[1] / "fixtures" / "models")
    args = AsyncEngineArgs(
        model=f"{pair}/target",
        speculative_config={"method": "ddtree", "model": f"{pair}/drafter", "ddtree_budget": 15},
        structured_outputs_config={"backend": "guidance"},
        skip_tokenizer_init=True,
    )
    vllm_logger = logging.getLogger("vllm")  # (vLLM 0.33's does not propagate to the root's capture)
    vllm_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING):
            args.create_engine_config()
    finally:
        vllm_logger.removeHandler(caplog.handler)
    assert any(
        "refuses every request with structured outputs through the 'guidance' backend" in r.getMessage()
        for r in caplog.records
    )
