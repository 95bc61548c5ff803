"""DDTree's rejection sampler and the runner's sampling state, against vLLM's own code on CPU."""

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_device_accept import device_trees

vllm = pytest.importorskip("vllm")


def _fake_runner(plan, on_device):
    """The runner's state the sampler touches, with the runner's own acceptance upload."""
    from ddtree.vllm.min_tokens import MinTokensRequests
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.staging import StepStaging

    methods = (
        "ddtree_accept",
        "ddtree_device_accepts",
        "ddtree_accept_on_device",
        "ddtree_output_to_host",
        "ddtree_min_tokens_pending",
        "_ddtree_walk_graphs_for_step",
        "ddtree_walk_target",
    )
    runner = type("FakeRunner", (), {name: getattr(DDTreeGPUModelRunner, name) for name in methods})()
    runner.use_async_scheduling, runner.device, runner.max_num_reqs = False, torch.device("cpu"), 4
    runner._ddtree_output_host = runner._ddtree_output_early = None
    runner._ddtree_plan, runner._ddtree_accept = plan, None
    runner._ddtree_device_accept = on_device
    plan.device_trees = device_trees(plan) if on_device else None
    runner.ddtree_stats = DDTreeStats(15)
    runner._ddtree_flat_positions = torch.zeros(13, dtype=torch.int64)
    runner._ddtree_conv_window = 0
    runner._ddtree_accept_staging = StepStaging(torch.device("cpu"))
    runner._ddtree_min_tokens = MinTokensRequests()
    runner._ddtree_full_graph, runner._ddtree_step_graphs_on, runner._ddtree_walk_graphs = None, True, None
    runner._ddtree_counts = None  # (the statistics' ring: not read here)
    return runner


@pytest.mark.parametrize("on_device", [False, True])
def test_rejection_sampler_emits_vllm_chain_rows(on_device):
    """The sampler on CPU tensors with a fake runner: tree walk (the Rust core's, or the device walk of
    DDTREE_DEVICE_ACCEPT), chain format, plain rows."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.sampler import DDTreeRejectionSampler
    from ddtree.vllm.step import TreeStore, accept, plan_verify

    rng = np.random.default_rng(0)
    store = TreeStore(budget=6)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 10.0
    ids = np.stack([np.stack([rng.permutation(20)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
    drafts = [[], lists[0], lists[1][:4]]  # request "p" has no tree
    req_ids = ["p", "a", "b"]
    plan = plan_verify(store, req_ids, np.array([3, 10, 20]), np.array([1, 7, 5]), {"a": drafts[1], "b": drafts[2]})
    plan.logit_rows_gpu = torch.from_numpy(plan.logit_rows)
    plan.batch_index_gpu = torch.from_numpy(plan.batch_index)
    md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    md.bonus_logits_indices = torch.tensor([0, 7, 12])
    vocab = 20
    # Target logits: make every node's argmax the token of its first child when it has one (accept all
    # along first children), else token 19.
    logits = torch.full((13, vocab), -5.0)
    for j, (lo, hi) in enumerate(zip(plan.trees.node_offsets[:-1], plan.trees.node_offsets[1:])):
        parents = plan.trees.parents[lo:hi]
        toks = plan.trees.tokens[plan.trees.token_offsets[j] : plan.trees.token_offsets[j + 1]]
        for node in range(hi - lo):
            kids = [c for c in range(1, hi - lo) if parents[c] == node]
            tok = int(toks[kids[0] - 1]) if kids else 19
            logits[plan.logit_rows[lo + node], tok] = 5.0
    logits[0, 11] = 5.0
    runner = _fake_runner(plan, on_device)
    sampler = DDTreeRejectionSampler(runner)
    sampling = SimpleNamespace(
        temperature=None,
        all_greedy=True,
        top_k=None,
        top_p=None,
        generators={},
        no_penalties=True,
        bad_words_token_ids={},
        allowed_token_ids_mask=None,
        max_num_logprobs=None,
    )
    out = sampler(md, None, logits, sampling).sampled_token_ids
    assert runner.ddtree_stats.host_seconds["accept"] > 0
    if on_device:  # the chain rows' early copy for vLLM's bookkeeping, made before the drafter is queued
        early_out, early_host = runner._ddtree_output_early
        assert early_out is out and torch.equal(early_host, out) and early_host.data_ptr() != out.data_ptr()
    else:  # the host walk already waited for the verification
        assert runner._ddtree_output_early is None
    assert out.shape == (3, 7)
    assert out[0].tolist() == [11] + [-1] * 6
    for row, j in ((1, 0), (2, 1)):
        lo, hi = plan.trees.node_offsets[j], plan.trees.node_offsets[j + 1]
        parents = plan.trees.parents[lo:hi]
        toks = plan.trees.tokens[plan.trees.token_offsets[j] : plan.trees.token_offsets[j + 1]]
        node, want = 0, []
        while True:
            kids = [c for c in range(1, hi - lo) if parents[c] == node]
            if not kids:
                break
            node = kids[0]
            want.append(int(toks[node - 1]))
        want.append(19)
        assert out[row, : len(want)].tolist() == want
        assert (out[row, len(want) :] == -1).all()
    staged = runner._ddtree_accept_gpu
    assert torch.equal(staged["output_tokens"], out[1:])
    assert staged["context_order"].shape == (13,)
    if on_device:  # nothing went through the host: no acceptance plan, no upload
        assert runner._ddtree_accept is None and runner._ddtree_accept_staging.uploads == 0
        return
    assert runner._ddtree_accept is not None
    # The acceptance's arrays reached the device side in one upload, in the runner's layout.
    assert runner._ddtree_accept_staging.uploads == 1
    assert staged["kv_src"].tolist() == runner._ddtree_accept.kv_src.tolist()

    def replan():
        """The same trees again (plan_verify consumed the proposal), installed in the runner."""
        store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
        fresh = plan_verify(
            store, req_ids, np.array([3, 10, 20]), np.array([1, 7, 5]), {"a": drafts[1], "b": drafts[2]}
        )
        fresh.logit_rows_gpu = torch.from_numpy(fresh.logit_rows)
        fresh.batch_index_gpu = torch.from_numpy(fresh.batch_index)
        fresh.device_trees = device_trees(fresh) if on_device else None
        runner._ddtree_plan = fresh
        return fresh

    # allowed_token_ids: a per-request mask (True = excluded), the same at every node, so exact for trees.
    unmasked = out.clone()
    plan = replan()
    mask = torch.zeros(4, vocab, dtype=torch.bool)  # vLLM's [max_num_reqs, V]
    mask[1] = True
    mask[1, 13] = False  # request "a" may only emit token 13
    masked = sampler(md, None, logits, SimpleNamespace(**{**vars(sampling), "allowed_token_ids_mask": mask}))
    a_tokens = [t for t in masked.sampled_token_ids[1].tolist() if t >= 0]
    assert a_tokens and set(a_tokens) == {13}
    assert torch.equal(masked.sampled_token_ids[[0, 2]], unmasked[[0, 2]])

    # min_tokens: request "a" needs 3 more tokens before a stop token (19, what every leaf prefers) may end it,
    # counted from the engine's counts (its 9-token prompt, 10 computed tokens, its tree of 7 scheduled), not from
    # vLLM's processor (which holds nothing here: under asynchronous scheduling it drops such requests early).
    plan = replan()
    runner._ddtree_min_tokens.add("a", 5, {19})
    runner.input_batch = SimpleNamespace(
        req_id_to_index={"p": 0, "a": 1, "b": 2},
        num_computed_tokens_cpu=np.array([3, 10, 20]),
        num_prompt_tokens=np.array([2, 9, 15]),
    )
    runner.num_scheduled_tokens = SimpleNamespace(np=np.array([1, 7, 5]))
    held = sampler(md, None, logits, sampling).sampled_token_ids
    a_tokens = [t for t in held[1].tolist() if t >= 0]
    assert 19 not in a_tokens[:3] and 19 in unmasked[1].tolist()[:3]
    assert torch.equal(held[[0, 2]], unmasked[[0, 2]])
    # Three tokens later nothing is held back: the request leaves the min_tokens set.
    plan = replan()
    runner.input_batch.num_computed_tokens_cpu = np.array([3, 13, 20])
    assert torch.equal(sampler(md, None, logits, sampling).sampled_token_ids, unmasked)
    assert len(runner._ddtree_min_tokens) == 0

    # logit_bias: request "a" biased +100 towards token 13 at every node; the others unchanged.
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    plan = replan()
    bias = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)
    bias.biases = {1: {13: 100.0}}
    procs = SimpleNamespace(non_argmax_invariant=[bias], argmax_invariant=[])
    biased = sampler(md, None, logits, SimpleNamespace(**{**vars(sampling), "logitsprocs": procs})).sampled_token_ids
    assert set(t for t in biased[1].tolist() if t >= 0) == {13}
    assert torch.equal(biased[[0, 2]], unmasked[[0, 2]])

    # Logprobs: each emitted token's, from the raw logits row of the node it was sampled at, in the layout
    # vLLM's own rejection sampler returns (vLLM's parse_output then keeps the emitted entries only).
    from vllm.v1.sample.rejection_sampler import RejectionSampler
    from vllm.v1.sample.sampler import Sampler

    runner.sampler = Sampler(logprobs_mode="raw_logprobs")
    logits += torch.linspace(0.0, 1.0, vocab)  # distinct values, so every rank is well defined
    plan = replan()
    result = sampler(md, None, logits, SimpleNamespace(**{**vars(sampling), "max_num_logprobs": 2}))
    tokens, lists = RejectionSampler.parse_output(
        result.sampled_token_ids, vocab, logprobs_tensors=result.logprobs_tensors
    )
    log_softmax = logits.log_softmax(dim=-1)
    # The paths of the walk (the host's, here, for the device walk too), on the greedy tokens of the nodes.
    paths = accept(plan, logits[torch.from_numpy(plan.logit_rows)].argmax(-1).numpy(), 7).accepted.paths
    assert (runner._ddtree_accept is None) is on_device  # the logprob rows came from the walk's own side
    expected_rows = [[0]]  # request "p": its only row
    for j in range(2):
        path = [int(p) for p in paths[j] if p >= 0]
        expected_rows.append([int(plan.logit_rows[plan.trees.node_offsets[j] + p]) for p in path])
    position = 0
    for r, (emitted, rows) in enumerate(zip(tokens, expected_rows)):
        assert len(emitted) == len(rows)
        for token, row in zip(emitted, rows):
            ids_row = lists.logprob_token_ids[position]
            values = lists.logprobs[position]
            assert ids_row[0] == token and values[0] == pytest.approx(float(log_softmax[row, token]), abs=1e-5)
            top2 = log_softmax[row].topk(2)
            assert list(ids_row[1:]) == top2.indices.tolist()
            assert lists.sampled_token_ranks[position] == int((log_softmax[row] > log_softmax[row, token]).sum()) + 1
            position += 1
    assert position == len(lists.logprobs)


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_penalties_and_bad_words_follow_each_nodes_own_history(monkeypatch, logits_dtype):
    """Bad words and presence/frequency/repetition penalties at a node see the committed output plus the tokens
    on the node's root path, exactly as vLLM's own code does for that history, row by row. bf16 target logits
    are constrained in fp32, like vLLM's sampler: its CUDA repetition-penalty op needs the logits in the
    penalties' dtype (fp32), which the check below stands in for on CPU."""
    import vllm._custom_ops as custom_ops
    import vllm.v1.sample.ops.penalties as penalties
    from vllm.v1.sample.ops.penalties import apply_all_penalties

    monkeypatch.setattr(penalties, "PIN_MEMORY", False)  # a CUDA build of torch on a machine without a GPU
    cpu_op = custom_ops.apply_repetition_penalties

    def dtype_checked(logits, prompt_mask, output_mask, repetition_penalties):
        assert logits.dtype == repetition_penalties.dtype, "the CUDA op refuses mixed dtypes"
        return cpu_op(logits, prompt_mask, output_mask, repetition_penalties)

    monkeypatch.setattr(custom_ops, "apply_repetition_penalties", dtype_checked)

    from ddtree.vllm.sampler import DDTreeRejectionSampler
    from ddtree.vllm.step import TreeStore, plan_verify

    rng = np.random.default_rng(7)
    vocab = 12
    store = TreeStore(budget=8)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 10.0
    ids = np.stack([np.stack([rng.permutation(vocab)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
    req_ids = ["p", "a", "b"]
    plan = plan_verify(store, req_ids, np.array([3, 10, 20]), np.array([1, 9, 6]), {"a": lists[0], "b": lists[1][:5]})
    counts = np.array([1, 9, 6])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    num_rows = int(counts.sum())
    logits = (torch.from_numpy(rng.normal(size=(num_rows, vocab)).astype(np.float32)) * 3).to(logits_dtype)
    outputs = [[1, 1, 4], [2, 3, 3, 5], [7]]
    prompts = torch.tensor([[0, 9, vocab], [6, 6, 2], [3, vocab, vocab]])  # padded with the vocabulary size
    sampling = SimpleNamespace(
        allowed_token_ids_mask=None,
        no_penalties=False,
        output_token_ids=outputs,
        prompt_token_ids=prompts,
        bad_words_token_ids={},
        presence_penalties=torch.tensor([0.5, 0.0, 1.5]),
        frequency_penalties=torch.tensor([0.2, 0.7, 0.0]),
        repetition_penalties=torch.tensor([1.0, 1.3, 2.0]),
    )
    rows_per_req = torch.from_numpy(counts)

    def per_row(t):
        return None if t is None else t[:3].repeat_interleave(rows_per_req, dim=0)

    # Bad words over each node's own history too: [4, x] bans x after a 4, [y] bans y everywhere.
    sampling.bad_words_token_ids = {0: [[4, 8]], 1: [[5, 2], [11]], 2: [[7, 3]]}
    got = DDTreeRejectionSampler._constrained(logits, plan, sampling, per_row, starts, counts, 3, [])
    assert got.dtype == torch.float32 and not torch.equal(got, logits.float())
    for r in range(3):
        j = {1: 0, 2: 1}.get(r)
        for k in range(counts[r]):
            history = list(outputs[r])
            if j is not None:  # walk node k up to the root, collecting its path's tokens
                first = plan.trees.node_offsets[j]
                tokens = plan.trees.tokens[plan.trees.token_offsets[j] : plan.trees.token_offsets[j + 1]]
                path, node = [], k
                while node > 0:
                    path.append(int(tokens[node - 1]))
                    node = int(plan.trees.parents[first + node])
                history += path[::-1]
            row = starts[r] + k
            want = logits[row : row + 1].float()
            for word in sampling.bad_words_token_ids[r]:
                if history[len(history) - len(word) + 1 :] == word[:-1] or len(word) == 1:
                    want[0, word[-1]] = float("-inf")
            want = apply_all_penalties(
                want,
                prompts[r : r + 1],
                sampling.presence_penalties[r : r + 1],
                sampling.frequency_penalties[r : r + 1],
                sampling.repetition_penalties[r : r + 1],
                [history],
            )
            assert torch.allclose(got[row], want[0], atol=1e-6), (r, k, history)


def test_runner_batch_holds_the_logit_bias_and_min_p_processors(monkeypatch):
    """Under a speculative config vLLM builds only the min_tokens logits processor (it refuses min_p and
    logit_bias there), so a ddtree engine, which admits both, would serve neither: its sampler finds no
    ``LogitBiasLogitsProcessor`` / ``MinPLogitsProcessor`` in the batch. The ddtree runner gives its persistent
    batch every built-in processor; through vLLM's own batch updates (add, finish, condense) the sampler then
    biases every row of each biased request."""
    import vllm.utils.torch_utils as torch_utils
    import vllm.v1.worker.gpu_input_batch as input_batch_module
    from vllm.sampling_params import SamplingParams
    from vllm.v1.sample.logits_processor import build_logitsprocs
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    import ddtree.vllm.proposer as proposer_module
    from ddtree.vllm.config import ADDITIONAL_CONFIG_KEY, DDTreeConfig
    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.sampler import DDTreeRejectionSampler

    for module in (torch_utils, input_batch_module):  # no CUDA driver here
        monkeypatch.setattr(module, "PIN_MEMORY", False)
    cpu, vocab = torch.device("cpu"), 32
    config = SimpleNamespace(
        speculative_config=SimpleNamespace(method="dflash"),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        additional_config={ADDITIONAL_CONFIG_KEY: DDTreeConfig(budget=8, draft_len=4, top_k=None).to_dict()},
    )

    def vllm_init(self, vllm_config, device):  # what GPUModelRunner.__init__ sets up that the subclass uses
        self.vllm_config, self.device, self.speculative_config = vllm_config, device, vllm_config.speculative_config
        self.parallel_config, self.use_async_scheduling = vllm_config.parallel_config, False
        self.model_config = SimpleNamespace(is_hybrid=False, get_hidden_size=lambda: 64)
        self.max_num_reqs, self.max_num_tokens = 4, 64
        self.compilation_config = SimpleNamespace(cudagraph_mode=None)  # (an eager engine)
        self.drafter = object()
        # (vLLM 0.25 takes the kernels' block sizes; 0.33 the blocks a request may hold instead)
        blocks = {"kernel_block_sizes": [16]}
        if "kernel_block_sizes" not in inspect.signature(InputBatch.__init__).parameters:
            blocks = {"max_num_blocks_per_req": [4]}
        self.input_batch = InputBatch(
            max_num_reqs=4,
            max_model_len=64,
            max_num_batched_tokens=64,
            device=device,
            vocab_size=vocab,
            block_sizes=[16],
            logitsprocs=build_logitsprocs(vllm_config, device, False, False),
            **blocks,
        )

    monkeypatch.setattr(GPUModelRunner, "__init__", vllm_init)
    monkeypatch.setattr(proposer_module, "DDTreeProposer", lambda *args: SimpleNamespace())
    assert [type(p) for p in build_logitsprocs(config, cpu, False, False).all] == [MinTokensLogitsProcessor]
    runner = DDTreeGPUModelRunner(config, cpu)
    assert {LogitBiasLogitsProcessor, MinPLogitsProcessor, MinTokensLogitsProcessor} <= {
        type(p) for p in runner.input_batch.logitsprocs.all
    }

    batch, bias = runner.input_batch, {5: 4.0, 9: -6.0}

    def request(req_id, temperature=0.0, **params):
        return CachedRequestState(
            req_id=req_id,
            prompt_token_ids=[1, 2, 3],
            mm_features=[],
            sampling_params=SamplingParams(temperature=temperature, **params),
            generator=None,
            block_ids=([],),
            num_computed_tokens=3,
            output_token_ids=[],
        )

    for req_id, params in (
        ("x", {}),
        ("a", {"logit_bias": bias}),
        ("b", {"logit_bias": bias, "min_p": 0.1, "temperature": 1.0}),
        ("c", {"logit_bias": bias}),
    ):
        batch.add_request(request(req_id, **params))
    batch.condense()
    batch.refresh_metadata()
    batch.remove_request("x")  # finished: "c" moves into its slot
    batch.condense()
    batch.refresh_metadata()
    assert batch.req_ids == ["c", "a", "b"]
    metadata = batch.sampling_metadata
    min_p = next(p for p in metadata.logitsprocs.all if isinstance(p, MinPLogitsProcessor))
    assert min_p.min_p_count == 1 and min_p.min_p_cpu[2] == pytest.approx(0.1)

    # No trees this step (plan None): one row per request, its sampled token emitted.
    runner._ddtree_plan, runner._ddtree_accept = None, None
    md = SpecDecodeMetadata.make_dummy([[], [], []], cpu)
    md.bonus_logits_indices = torch.arange(3)
    logits = torch.zeros(3, vocab)
    logits[:, 9] = 3.0  # the raw argmax; the bias (+4 on 5, -6 on 9) makes token 5 the biased one
    # "b" samples at temperature 1: after the bias token 5 has p ~0.64, every other token ~0.012, below min_p's
    # 0.1 * 0.64, so min_p leaves token 5 alone.
    out = DDTreeRejectionSampler(runner)(md, None, logits, metadata).sampled_token_ids
    assert out[:, 0].tolist() == [5, 5, 5]


def test_each_logits_row_samples_the_position_after_its_token():
    """Seeded rows are keyed by the position each row samples: its token's (vLLM's ``logits_indices`` into the
    runner's positions, which hold a tree node's root position plus its depth) plus one; M-RoPE models read the
    text section of their M-RoPE positions."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.sampler import _sampled_positions

    md = SpecDecodeMetadata.make_dummy([[5, 6], [], [7]], torch.device("cpu"))
    positions = torch.tensor([40, 41, 41, 9, 17, 18, 0, 0])  # a tree of a root and two children at depth 1
    runner = SimpleNamespace(uses_mrope=False, positions=positions)
    expected = positions[md.logits_indices] + 1
    assert torch.equal(_sampled_positions(runner, md), expected)
    mrope = SimpleNamespace(gpu=torch.stack([positions, positions * 0, positions * 0]))
    assert torch.equal(_sampled_positions(SimpleNamespace(uses_mrope=True, mrope_positions=mrope), md), expected)
    assert _sampled_positions(None, md) is None


def test_a_seeded_request_samples_by_its_seed_and_positions_not_its_generators_state():
    """Through the sampler: a seeded request's tokens come from its seed (the generator's initial seed) and the
    positions its rows sample (the runner's depth-based positions), so a generator advanced by other draws, and a
    batch mate's other tree, leave them as they were; another seed changes them."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.sampler import DDTreeRejectionSampler
    from ddtree.vllm.step import TreeStore, plan_verify

    rng = np.random.default_rng(1)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 1.0
    ids = np.stack([np.stack([rng.permutation(20)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    logits = torch.from_numpy(rng.normal(size=(13, 20)).astype(np.float32))

    def run(seed, advance, b_budget):
        store = TreeStore(budget=6)
        lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
        drafts = [[], lists[0], lists[1][:b_budget]]
        plan = plan_verify(
            store,
            ["p", "a", "b"],
            np.array([3, 10, 20]),
            np.array([1, 7, b_budget + 1]),
            {"a": drafts[1], "b": drafts[2]},
        )
        plan.logit_rows_gpu = torch.from_numpy(plan.logit_rows)
        plan.batch_index_gpu = torch.from_numpy(plan.batch_index)
        runner = _fake_runner(plan, False)
        positions = torch.zeros(16, dtype=torch.int64)
        positions[0] = 3  # the plain request's token
        roots = np.repeat(np.array([10, 20]), np.diff(plan.trees.node_offsets))
        positions[torch.from_numpy(plan.token_index)] = torch.from_numpy(roots + plan.trees.depths.astype(np.int64))
        runner.uses_mrope, runner.positions = False, positions
        md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
        md.bonus_logits_indices = torch.tensor([0, 7, 8 + b_budget - 1])
        generator = torch.Generator().manual_seed(seed)
        torch.rand(advance, generator=generator)  # other draws first: the state moves, the initial seed does not
        sampling = SimpleNamespace(
            temperature=torch.ones(3),
            all_greedy=False,
            top_k=None,
            top_p=None,
            generators={1: generator},
            no_penalties=True,
            bad_words_token_ids={},
            allowed_token_ids_mask=None,
            max_num_logprobs=None,
        )
        rows = len(md.logits_indices)
        return DDTreeRejectionSampler(runner)(md, None, logits[:rows], sampling).sampled_token_ids[1].tolist()

    first = run(7, 0, 4)
    assert run(7, 1000, 4) == first  # the generator's state does not matter
    assert run(7, 0, 2) == first  # nor the batch mate's tree
    assert any(run(seed, 0, 4) != first for seed in (8, 9, 10))  # the seed does


def _all_greedy():
    """vLLM's sampling metadata of an all-greedy step with no constraint."""
    return SimpleNamespace(
        temperature=None, all_greedy=True, top_k=None, top_p=None, generators={}, no_penalties=True,
        bad_words_token_ids={}, allowed_token_ids_mask=None, max_num_logprobs=None,
    )  # fmt: skip


def _every_request_runner(lp, ids, on_device):
    """A fake runner whose plan has requests "a" and "b" verify trees of 7 and 5 nodes (12 logits rows) from the
    proposal ``lp``/``ids`` ``[2, 3, 3]``; and the drafts vLLM scheduled."""
    from ddtree.vllm.step import TreeStore, plan_verify

    store = TreeStore(budget=6)
    lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
    drafts = [lists[0], lists[1][:4]]
    plan = plan_verify(store, ["a", "b"], np.array([10, 20]), np.array([7, 5]), dict(zip("ab", drafts)))
    plan.logit_rows_gpu = torch.from_numpy(plan.logit_rows)
    plan.batch_index_gpu = torch.from_numpy(plan.batch_index)
    return _fake_runner(plan, on_device), drafts


def test_a_step_where_every_request_verifies_a_tree_takes_the_walks_rows_as_a_copy(monkeypatch):
    """Every request a tree: the chain rows are the device walk's rows, whole (one copy, not a fill and two
    scatters), equal to the host walk's, and not the walk's own tensor (a walk graph's output, rewritten by its
    next replay while vLLM still reads these rows)."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.sampler import DDTreeRejectionSampler

    rng = np.random.default_rng(4)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 10.0
    ids = np.stack([np.stack([rng.permutation(20)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    logits = torch.from_numpy(rng.normal(size=(12, 20)).astype(np.float32))
    greedy = _all_greedy()

    def run(on_device):
        runner, drafts = _every_request_runner(lp, ids, on_device)
        md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
        walks = []
        if on_device:
            walk = runner.ddtree_accept_on_device
            runner.ddtree_accept_on_device = lambda *a: walks.append(walk(*a)) or walks[-1]
        return DDTreeRejectionSampler(runner)(md, None, logits, greedy).sampled_token_ids, walks

    (device_rows, walks), (host_rows, _) = run(True), run(False)
    assert torch.equal(device_rows, host_rows) and device_rows.shape == (2, 7)
    walked = walks[0]["output_tokens"]
    assert device_rows.data_ptr() != walked.data_ptr()
    walked.fill_(0)  # the walk graph's next replay
    assert torch.equal(device_rows, host_rows)


def test_a_greedy_step_of_trees_writes_its_tokens_where_the_walk_graph_reads_them():
    """Once the step shape's walk graph is known, the sampler's argmax goes into the graph's own target: the walk
    copies nothing (counted), and the rows are the host walk's, step after step."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.graphs import WalkGraphs
    from ddtree.vllm.sampler import DDTreeRejectionSampler

    rng = np.random.default_rng(4)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 10.0
    ids = np.stack([np.stack([rng.permutation(20)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    greedy = _all_greedy()
    # (each runner its own plan: the host's has no device trees)
    (device, drafts), (host, _) = _every_request_runner(lp, ids, True), _every_request_runner(lp, ids, False)
    device._ddtree_walk_graphs = WalkGraphs(lambda work: work)  # (a replay runs the work, as a graph would)
    device._ddtree_full_graph = (12, 2)  # a FULL graph's step: its walk goes through the walk graphs
    md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    for step in range(3):
        logits = torch.from_numpy(rng.normal(size=(12, 20)).astype(np.float32))
        rows = DDTreeRejectionSampler(device)(md, None, logits, greedy).sampled_token_ids
        assert torch.equal(rows, DDTreeRejectionSampler(host)(md, None, logits, greedy).sampled_token_ids)
        # The first step finds the shape's graph by walking; the next ones write into its target.
        assert device.ddtree_stats.walk_target_in_place_steps == step
    assert device._ddtree_walk_graphs.replayed == 2 and device.ddtree_stats.walk_graph_steps == 2
    # A sampled step of the same shape writes its tokens where it samples them: the walk copies them in.
    sampled = SimpleNamespace(**dict(vars(greedy), all_greedy=False, temperature=torch.tensor([1.0, 0.7])))
    logits = torch.from_numpy(rng.normal(size=(12, 20)).astype(np.float32))
    DDTreeRejectionSampler(device)(md, None, logits, sampled)
    assert device.ddtree_stats.walk_target_in_place_steps == 2 and device._ddtree_walk_graphs.replayed == 3
    # A greedy step that no FULL graph replayed (cut trees near max_model_len; a prefill beside the trees without
    # mixed walk graphs) walks op by op: the sampler asks for no buffer, and its rows are the host walk's.
    graphs, asked = device._ddtree_walk_graphs, []
    target_for = graphs.target_for
    graphs.target_for = lambda *args: asked.append(args) or target_for(*args)
    device._ddtree_full_graph, device._ddtree_mixed_walk_graphs = None, False
    logits = torch.from_numpy(rng.normal(size=(12, 20)).astype(np.float32))
    rows = DDTreeRejectionSampler(device)(md, None, logits, greedy).sampled_token_ids
    assert torch.equal(rows, DDTreeRejectionSampler(host)(md, None, logits, greedy).sampled_token_ids)
    assert asked == [] and graphs.replayed == 3 and device.ddtree_stats.walk_target_in_place_steps == 2


def test_step_rows_are_kept_by_their_counts_read_only(monkeypatch):
    from ddtree.vllm import sampler

    cpu = torch.device("cpu")
    rows = sampler.step_rows([3, 0, 2], cpu)
    assert rows.counts.tolist() == [4, 1, 3] and rows.starts.tolist() == [0, 4, 5]
    assert sampler.step_rows((3, 0, 2), cpu) is rows and sampler.step_rows([3, 0, 1], cpu) is not rows
    with pytest.raises(ValueError, match="read-only"):
        rows.counts[0] = 9  # shared by every step of these counts: nothing may write it
    assert rows.per_row(torch.tensor([7, 8, 9])).tolist() == [7] * 4 + [8] + [9] * 3
    assert sampler.step_rows([], cpu).counts.shape == (0,)
    monkeypatch.setattr(sampler, "MAX_KEPT_STEP_ROWS", 2)
    for n in range(4):
        sampler.step_rows([n], cpu)
    assert len(sampler._STEP_ROWS) <= 2


def test_a_seeded_requests_token_is_the_same_in_a_step_without_drafts_and_beside_a_tree():
    """A seeded request's first token is sampled either in a step without drafts (vLLM's ``_sample`` would call
    vLLM's sampler, which draws from the request's generator) or beside other requests' trees (ddtree's sampler,
    noise by seed and position), as arrival times fall. The runner samples a step without drafts with ddtree's
    sampler whenever a request is seeded, so both give the same token; a greedy step stays vLLM's."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.sampler import DDTreeRejectionSampler
    from ddtree.vllm.step import TreeStore, plan_verify

    rng = np.random.default_rng(3)
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 5.0
    ids = np.stack([np.stack([rng.permutation(20)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    logits = torch.from_numpy(rng.normal(size=(13, 20)).astype(np.float32) * 0.3)  # flat: the noise decides

    def sampling(seed):
        return SimpleNamespace(
            temperature=torch.ones(3),
            all_greedy=False,
            top_k=None,
            top_p=None,
            generators={0: torch.Generator().manual_seed(seed)},  # request "p", its first token at position 4
            no_penalties=True,
            bad_words_token_ids={},
            allowed_token_ids_mask=None,
            max_num_logprobs=None,
        )

    def beside_trees(seed):
        store = TreeStore(budget=6)
        lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
        drafts = [[], lists[0], lists[1][:4]]
        plan = plan_verify(
            store, ["p", "a", "b"], np.array([3, 10, 20]), np.array([1, 7, 5]), {"a": drafts[1], "b": drafts[2]}
        )
        plan.logit_rows_gpu = torch.from_numpy(plan.logit_rows)
        plan.batch_index_gpu = torch.from_numpy(plan.batch_index)
        runner = _fake_runner(plan, False)
        positions = torch.zeros(16, dtype=torch.int64)
        positions[0] = 3
        runner.uses_mrope, runner.positions = False, positions
        md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
        md.bonus_logits_indices = torch.tensor([0, 7, 12])
        return DDTreeRejectionSampler(runner)(md, None, logits, sampling(seed)).sampled_token_ids[0, 0].item()

    def without_drafts(seed, metadata=None):
        runner = _fake_runner(SimpleNamespace(), False)
        runner._ddtree_plan = None
        for name in ("_ddtree_samples_draftless_step", "_ddtree_sample_draftless_step"):
            setattr(runner, name, getattr(DDTreeGPUModelRunner, name).__get__(runner))
        runner.uses_mrope = False
        runner.positions = torch.tensor([0, 1, 2, 3, 40, 41, 7, 8])  # "p"'s prompt ends at index 3, position 3
        runner._ddtree_draftless_logits_indices = torch.tensor([3, 5, 7])
        metadata = metadata or sampling(seed)
        runner.input_batch = SimpleNamespace(sampling_metadata=metadata, update_async_output_token_ids=lambda: None)
        runner.rejection_sampler = DDTreeRejectionSampler(runner)
        rows = logits[[0, 1, 2]]
        if not runner._ddtree_samples_draftless_step(rows):
            return None
        return runner._ddtree_sample_draftless_step(rows).sampled_token_ids[0, 0].item()

    firsts = [beside_trees(seed) for seed in range(8)]
    assert [without_drafts(seed) for seed in range(8)] == firsts
    assert len(set(firsts)) > 1  # the seed decides (a test that cannot fail would not)
    greedy = SimpleNamespace(generators={}, all_greedy=True)
    assert without_drafts(0, greedy) is None  # no seeded request: vLLM's own sampler


def test_a_draftless_steps_logprobs_are_its_rows_and_found_without_reading_the_device():
    """ddtree's sampler on a step without drafts (a seeded request in it) returns vLLM's raw logprobs of each
    request's row, finding the rows on the host (from each request's row counts): no device read, which on a GPU
    would wait for the forward."""
    from vllm.v1.sample.sampler import Sampler

    from ddtree.vllm.sampler import DDTreeRejectionSampler, DraftlessStep

    class DeviceOnly(torch.Tensor):  # a "device" tensor: reading it on the host fails the test
        def cpu(self, *args, **kwargs):
            raise AssertionError("the sampler read the rows from the device")

    runner = _fake_runner(SimpleNamespace(), False)
    runner._ddtree_plan = None
    runner.uses_mrope, runner.positions = False, torch.tensor([3, 9, 17])
    runner.sampler = Sampler(logprobs_mode="raw_logprobs")
    logits = torch.from_numpy(np.random.default_rng(5).normal(size=(3, 20)).astype(np.float32))
    step = DraftlessStep.of(torch.tensor([0, 1, 2]))
    step = step._replace(bonus_logits_indices=step.bonus_logits_indices.as_subclass(DeviceOnly))
    sampling = SimpleNamespace(
        temperature=torch.tensor([1.0, 0.0, 1.0]),
        all_greedy=False,
        top_k=None,
        top_p=None,
        generators={0: torch.Generator().manual_seed(3)},
        no_penalties=True,
        bad_words_token_ids={},
        allowed_token_ids_mask=None,
        max_num_logprobs=2,
    )
    out = DDTreeRejectionSampler(runner)(step, None, logits, sampling)
    tokens = out.sampled_token_ids[:, 0].long()
    assert tokens[1].item() == int(logits[1].argmax())  # the greedy request
    expected = logits.log_softmax(dim=-1)
    chosen = out.logprobs_tensors.logprobs[:, 0]  # (the sampled token's logprob first, as vLLM's)
    assert torch.allclose(chosen, expected[torch.arange(3), tokens])


def test_the_runner_routes_only_seeded_steps_without_drafts_to_ddtrees_sampler(monkeypatch):
    """``_sample``: a step without drafts goes to ddtree's sampler when a request is seeded, to vLLM's otherwise; a
    step with drafts always to vLLM's ``_sample`` (which calls ddtree's rejection sampler)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm.runner import DDTreeGPUModelRunner
    from ddtree.vllm.sampler import DDTreeRejectionSampler

    calls = []
    monkeypatch.setattr(GPUModelRunner, "_sample", lambda self, logits, md: calls.append(("vllm", md)) or "vllm")
    monkeypatch.setattr(
        DDTreeGPUModelRunner, "_ddtree_sample_draftless_step", lambda self, logits: calls.append(("ddtree",)) or "dd"
    )
    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_plan = runner._ddtree_accept = runner._ddtree_accept_gpu = None
    runner.drafter = SimpleNamespace()
    runner.rejection_sampler = object.__new__(DDTreeRejectionSampler)
    runner._ddtree_draftless_logits_indices = torch.tensor([0, 1])
    logits = torch.zeros(2, 8)
    seeded = SimpleNamespace(generators={1: torch.Generator()})
    unseeded = SimpleNamespace(generators={})
    runner.input_batch = SimpleNamespace(sampling_metadata=seeded)
    assert runner._sample(logits, None) == "dd"
    runner.input_batch = SimpleNamespace(sampling_metadata=unseeded)
    assert runner._sample(logits, None) == "vllm"
    runner.input_batch = SimpleNamespace(sampling_metadata=seeded)
    drafts = SimpleNamespace(num_draft_tokens=[3, 3])
    assert runner._sample(logits, drafts) == "vllm"
    assert calls == [("ddtree",), ("vllm", None), ("vllm", drafts)]


@pytest.mark.parametrize("filters", ["none", "top_k", "top_p"])
def test_sampled_nodes_never_take_a_token_their_row_masks_out(filters):
    """Rows with most tokens at -inf (a grammar's masks, or allowed_token_ids), sampled at temperature 1 under
    top-k / top-p: every emitted token is one its node's row allows, the bonus included, over many draws."""
    from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

    from ddtree.vllm.sampler import DDTreeRejectionSampler
    from ddtree.vllm.step import TreeStore, plan_verify

    rng = np.random.default_rng(3)
    vocab = 20
    lp = np.sort(rng.normal(size=(2, 3, 3)).astype(np.float32), axis=-1)[..., ::-1] - 5.0
    ids = np.stack([np.stack([rng.permutation(vocab)[:3] for _ in range(3)]) for _ in range(2)]).astype(np.int64)
    store = TreeStore(budget=6)
    lists = store.propose(["a", "b"], np.ascontiguousarray(lp), ids)
    drafts = [lists[0], lists[1]]
    plan = plan_verify(store, ["a", "b"], np.array([10, 20]), np.array([7, 7]), {"a": drafts[0], "b": drafts[1]})
    plan.logit_rows_gpu = torch.from_numpy(plan.logit_rows)
    plan.batch_index_gpu = torch.from_numpy(plan.batch_index)
    md = SpecDecodeMetadata.make_dummy(drafts, torch.device("cpu"))
    rows = len(md.logits_indices)
    # Each row allows 4 random tokens, and always its node's first child's token half of the time (so that paths
    # go deeper than the root now and then).
    allowed = np.zeros((rows, vocab), dtype=bool)
    trees = plan.trees
    for j in range(2):
        lo, hi = trees.node_offsets[j], trees.node_offsets[j + 1]
        parents, toks = trees.parents[lo:hi], trees.tokens[trees.token_offsets[j] : trees.token_offsets[j + 1]]
        for node in range(hi - lo):
            row = plan.logit_rows[lo + node]
            allowed[row, rng.choice(vocab, 4, replace=False)] = True
            kids = [c for c in range(1, hi - lo) if parents[c] == node]
            if kids and rng.random() < 0.5:
                allowed[row, int(toks[kids[0] - 1])] = True
    logits = torch.from_numpy(rng.normal(size=(rows, vocab)).astype(np.float32) * 2)
    logits[~torch.from_numpy(allowed)] = float("-inf")
    sampling = SimpleNamespace(
        temperature=torch.ones(2),
        all_greedy=False,
        top_k=torch.full((2,), 2) if filters == "top_k" else None,
        top_p=torch.full((2,), 0.7) if filters == "top_p" else None,
        generators={},
        no_penalties=True,
        bad_words_token_ids={},
        allowed_token_ids_mask=None,
        max_num_logprobs=None,
    )
    deeper = 0
    for draw in range(40):
        torch.manual_seed(draw)
        runner = _fake_runner(plan, False)
        out = DDTreeRejectionSampler(runner)(md, None, logits.clone(), sampling).sampled_token_ids
        for j in range(2):
            lo, hi = trees.node_offsets[j], trees.node_offsets[j + 1]
            parents, toks = trees.parents[lo:hi], trees.tokens[trees.token_offsets[j] : trees.token_offsets[j + 1]]
            node = 0
            emitted = [t for t in out[j].tolist() if t >= 0]
            for k, token in enumerate(emitted):
                assert allowed[plan.logit_rows[lo + node], token], (filters, draw, j, k, token)
                kids = [c for c in range(1, hi - lo) if parents[c] == node and int(toks[c - 1]) == token]
                if k < len(emitted) - 1:
                    assert kids, "an emitted token before the bonus is a child's token"
                    node = kids[0]
            deeper += len(emitted) > 1
    assert deeper > 0, "no draw accepted a node below a root: only roots' rows were checked"
