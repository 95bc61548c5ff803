"""Prefix caching for hybrid targets beside tree steps, on vLLM's own KV-cache manager (CPU).

What ``ddtree.vllm.mamba_align`` rests on: vLLM 0.25's ``KVCacheManager`` with a full-attention group and a mamba
group in cache mode "align" (one state block per request, as ddtree asks) allocates, hashes and frees blocks for
requests that verify trees of a budget's nodes and accept random paths, under synchronous and asynchronous
scheduling (the asynchronous scheduler's optimistic counts and placeholders, as ``AsyncScheduler`` keeps them), one
request or several in turns, preempted and resumed.
A model worker keeps the block row vLLM's worker keeps (it only appends what the scheduler returns) and a state
store whose every block holds the tokens its state has read. It does what vLLM's worker does before a step (the
running state copied to ``(c + n - 1) // block_size``, whole: ddtree's accepted count is 1) and what ddtree does
after it (the boundary commit, then the main commit). Checked:

- every block the worker reads or writes is the request's own at that moment (never a freed or null block);
- every step reads the state of exactly the tokens the request has computed;
- every hashed state block holds the state after exactly its blocks' tokens;
- a second turn (the first request's prompt and answer, and more) starts from a cached state block that tree
  steps wrote, at a boundary that a boundary commit wrote (the test counts them: the scenario ran what it is named
  for).

Without the boundary commits, without the scheduler's lag, with vLLM's own state lookup (which ignores the drop of
the block a DFlash drafter needs recomputed), or with steps of more tokens than a block, the checks fail. The runner's
own parts are checked last, with CPU stand-ins for vLLM's buffers, and vLLM's own pre-step copy and state column.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm import SamplingParams  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from ddtree.vllm import patches  # noqa: E402
from ddtree.vllm.mamba_align import block_size_problem, boundary_prefixes, free_lag_tokens  # noqa: E402

BLOCK = 32
DEPTH = 6
ATTENTION, STATE = 0, 1  # the KV-cache groups


class Sim:
    """vLLM's manager for a hybrid target, a worker's view of it, and requests that verify trees."""

    def __init__(
        self, budget: int, asynchronous: bool, seed: int, boundary_commits: bool = True, lag=None, num_blocks=400
    ):
        patches.install_state_block_patches()  # ddtree's patches 13a and (on vLLM 0.25) 13c
        attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
        state = MambaSpec(
            block_size=BLOCK,
            shapes=((1,),),
            dtypes=(torch.float32,),
            mamba_cache_mode="align",
            num_speculative_blocks=0,
        )
        config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["attn"], attention), KVCacheGroupSpec(["gdn"], state)],
        )
        self.manager = KVCacheManager(
            config, max_model_len=8192, scheduler_block_size=BLOCK, hash_block_size=BLOCK, use_eagle=True
        )
        patches.set_state_block_free_lag(self.manager, free_lag_tokens(budget) if lag is None else lag)
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.budget, self.asynchronous, self.boundary_commits = budget, asynchronous, boundary_commits
        self.rng = np.random.default_rng(seed)
        self.states: dict = {}  # state block id -> the tokens its state has read
        self.boundary_writes = 0
        self.users: dict = {}  # state block id -> the requests that read or wrote it
        self.requests: dict = {}
        self.preempted: set = set()  # requests whose launched step runs after the scheduler freed their blocks
        self.freed_touches: list = []  # (block, column) that step read or wrote
        self.cached_freed_writes = 0  # of those, blocks vLLM had hashed at the step's allocation

    # -- the scheduler's side --------------------------------------------------------------------------------
    def add(self, name: str, truth, prompt_len: int) -> Request:
        """A request whose prompt is ``truth``'s first ``prompt_len`` tokens; its answer is the rest of ``truth``."""
        prompt = list(truth[:prompt_len])
        req = Request(name, prompt, SamplingParams(max_tokens=10_000), None, block_hasher=self.hasher)
        info = {"truth": list(truth), "row": [], "state_idx": None, "inflight": None}
        self.requests[name] = (req, info)
        self.start(req, info, req.num_prompt_tokens)
        return req

    def start(self, req: Request, info: dict, end: int) -> None:
        """A request's first ``end`` tokens from the cache's hit and a prefill of the rest, then its sampled token."""
        blocks, hit = self.manager.get_computed_blocks(req)[:2]  # (vLLM 0.33 returns a third count)
        info.update(c=hit, hit=hit)
        if hit:
            attention_blocks = len(blocks.get_block_ids()[ATTENTION])
            assert hit <= attention_blocks * BLOCK, f"a hit of {hit} tokens over {attention_blocks} attention blocks"
            hit_state = blocks.get_block_ids()[STATE][-1]
            assert self.states.get(hit_state) == tuple(info["truth"][:hit]), "a cache hit's state holds another state"
        self.prefill(req, info, blocks, hit, end)

    def preempt_and_resume(self, name: str) -> None:
        """vLLM's preemption (every block freed, the count reset; the worker forgets the request's row and state
        column), then its resumption: a hit, and a prefill of the request's tokens up to its last one."""
        req, info = self.requests[name]
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        info.update(row=[], state_idx=None)
        end = req.num_tokens
        self.start(req, info, end)

    def preempt_in_flight_and_resume(self, name: str) -> None:
        """Asynchronous scheduling: a step scheduled, then the request preempted before that step's output (vLLM's
        ``_preempt_request``: every block freed, the count reset); the worker runs the launched step anyway, its
        output arrives (the tokens kept, nothing cached: vLLM caches a running request's blocks only), and the
        request resumes from the cache's hit."""
        req, info = self.requests[name]
        accepted = int(self.rng.integers(0, DEPTH + 1))
        n = self.schedule(req, info)
        if info["inflight"] is not None:
            self.output(req, info, info["inflight"])
            info["inflight"] = None
        self.manager.free(req)
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        self.preempted.add(name)
        self.freed_touches = []
        self.run_tree_step(req, info, n, accepted)
        for block, column in self.freed_touches:
            # vLLM hashes a block at the allocation of the step that completes its tokens: a hashed block this step
            # wrote must hold exactly the state its hash names (any other write would corrupt a later hit).
            if self.manager.block_pool.blocks[block].block_hash is not None:
                expected = tuple(info["truth"][: (column + 1) * BLOCK])
                assert self.states[block] == expected, f"{name}: freed block {block} (column {column}) is stale"
                self.cached_freed_writes += 1
        self.output(req, info, accepted)
        self.preempted.discard(name)
        info.update(row=[], state_idx=None)
        self.start(req, info, req.num_tokens)

    def prefill(self, req: Request, info: dict, blocks, hit: int, end: int) -> None:
        """Tokens ``hit .. end`` in chunks that end at block boundaries (vLLM's align chunking), then the sampled
        token after them."""
        c, first = hit, True
        while c < end:
            n = min(end - c, BLOCK - c % BLOCK)
            self.manager.new_step_starts()
            kwargs = dict(num_new_computed_tokens=hit, new_computed_blocks=blocks) if first else {}
            assert self.manager.allocate_slots(req, n, **kwargs) is not None
            if first:
                req.num_computed_tokens = hit
            first = False
            self.sync_row(req, info)
            self.run_prefill_chunk(req, info, c, n)
            c += n
            req.num_computed_tokens = c
        req.append_output_token_ids(info["truth"][end])
        info["c"] = end
        if self.asynchronous:
            self.manager.cache_blocks(req, req.num_computed_tokens)

    def schedule(self, req: Request, info: dict) -> int:
        """One decode step's slots: the root and ``budget`` drafts (placeholders under asynchronous scheduling)."""
        n = 1 + self.budget
        self.manager.new_step_starts()
        req.spec_token_ids = [-1] * self.budget
        assert self.manager.allocate_slots(req, n) is not None
        req.num_computed_tokens += n
        if self.asynchronous:
            req.num_output_placeholders += n
        self.sync_row(req, info)
        return n

    def output(self, req: Request, info: dict, accepted: int) -> None:
        """A step's output reaches the scheduler: ``accepted`` drafts and the bonus token."""
        rejected = self.budget - accepted
        if req.num_computed_tokens > 0:  # (vLLM's rule: a preempted request's count is already 0)
            req.num_computed_tokens -= rejected
        c = req.num_tokens  # the request's tokens so far end at the step's root
        new = info["truth"][c : c + accepted + 1]
        assert len(new) == accepted + 1, "the test's request ran past its answer: give it a longer one"
        req.append_output_token_ids(new)
        if self.asynchronous:
            req.num_output_placeholders -= rejected + len(new)
            if req.request_id not in self.preempted:
                self.manager.cache_blocks(req, req.num_computed_tokens - req.num_output_placeholders)

    # -- the worker's side -----------------------------------------------------------------------------------
    def sync_row(self, req: Request, info: dict) -> None:
        """vLLM's worker appends the blocks an allocation returned; it never learns of blocks freed in place."""
        blocks = self.manager.get_block_ids(req.request_id)[STATE]
        info["row"].extend(blocks[len(info["row"]) :])

    def owned(self, req: Request, info: dict, column: int) -> int:
        block = info["row"][column]
        if req.request_id in self.preempted:  # freed under the launched step (checked after it)
            self.freed_touches.append((block, column))
            return block
        blocks = self.manager.coordinator.single_type_managers[STATE].req_to_blocks[req.request_id]
        assert column < len(blocks) and blocks[column].block_id == block and not blocks[column].is_null, (
            f"{req.request_id}: column {column} (block {block}) is not the request's any more"
        )
        self.users.setdefault(block, set()).add(req.request_id)
        return block

    def move_running_state(self, req: Request, info: dict, c: int, n: int) -> int:
        """vLLM's ``preprocess_mamba`` with an accepted count of 1: the state moves whole to the running column."""
        current = (c + n - 1) // BLOCK
        previous = info["state_idx"] if info["state_idx"] is not None else (c - 1) // BLOCK
        if previous not in (-1, current):
            self.states[self.owned(req, info, current)] = self.states[self.owned(req, info, previous)]
        info["state_idx"] = current
        return current

    def run_prefill_chunk(self, req: Request, info: dict, c: int, n: int) -> None:
        column = self.move_running_state(req, info, c, n)
        block = self.owned(req, info, column)
        if c:
            assert self.states[block] == tuple(info["truth"][:c]), f"{req.request_id}: a prefill read a wrong state"
        self.states[block] = tuple(info["truth"][: c + n])

    def run_tree_step(self, req: Request, info: dict, n: int, accepted: int) -> None:
        """A tree step at the worker's true count: read, then ddtree's boundary commit and main commit."""
        c, truth = info["c"], info["truth"]
        column = self.move_running_state(req, info, c, n)
        running = self.owned(req, info, column)
        assert self.states[running] == tuple(truth[:c]), f"{req.request_id}: a tree step read a wrong state"
        prefix, boundary = boundary_prefixes(np.array([c]), np.array([n]), BLOCK, DEPTH + 1)
        if self.boundary_commits and prefix[0] and accepted + 1 >= prefix[0]:
            self.states[self.owned(req, info, int(boundary[0]))] = tuple(truth[: c + int(prefix[0])])
            self.boundary_writes += 1
        self.states[running] = tuple(truth[: c + 1 + accepted])
        info["c"] = c + 1 + accepted

    # -- checks --------------------------------------------------------------------------------------------
    def check_hashed_states(self) -> int:
        """Every hashed state block of a running request holds the state after exactly its blocks' tokens."""
        checked = 0
        manager = self.manager.coordinator.single_type_managers[STATE]
        for name, (req, info) in self.requests.items():
            for column, block in enumerate(manager.req_to_blocks.get(name, [])):
                if block.is_null or block.block_hash is None:
                    continue
                expected = tuple(info["truth"][: (column + 1) * BLOCK])
                assert self.states.get(block.block_id) == expected, f"{name}: hashed state column {column} is stale"
                checked += 1
        return checked

    def step(self, name: str) -> None:
        """One tree step of a request: scheduled, its previous output received (asynchronously), run."""
        req, info = self.requests[name]
        accepted = int(self.rng.integers(0, DEPTH + 1))
        n = self.schedule(req, info)
        if self.asynchronous:
            # vLLM schedules the next step before the previous one's output; the worker runs it after that one.
            if info["inflight"] is not None:
                self.output(req, info, info["inflight"])
            info["inflight"] = accepted
        self.run_tree_step(req, info, n, accepted)
        if not self.asynchronous:
            self.output(req, info, accepted)

    def settle(self, name: str) -> None:
        """The last step's output reaches the scheduler (asynchronous scheduling)."""
        req, info = self.requests[name]
        if info["inflight"] is not None:
            self.output(req, info, info["inflight"])
            info["inflight"] = None

    def decode(self, *names: str, steps: int) -> int:
        """``steps`` tree steps of each request, in turns; returns how many hashed state blocks were checked."""
        checked = 0
        for _ in range(steps):
            for name in names:
                self.step(name)
            checked += self.check_hashed_states()
        for name in names:
            self.settle(name)
        return checked + self.check_hashed_states()


def _truth(rng, length: int):
    return [int(t) for t in rng.integers(10, 5000, size=length)]


def _tokens(rng, prompt: int, steps: int):
    """A prompt of ``prompt`` tokens and an answer long enough for ``steps`` tree steps."""
    return _truth(rng, prompt + (DEPTH + 1) * steps + 1)


@pytest.mark.parametrize("asynchronous", [False, True])
@pytest.mark.parametrize("budget", [7, 15, 31])  # 31: the largest this block size serves
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tree_steps_keep_every_hashed_state_block_exact_and_a_second_turn_starts_from_one(asynchronous, budget, seed):
    sim = Sim(budget, asynchronous, seed)
    rng = np.random.default_rng(100 + seed)
    prompt = 9 * BLOCK + 5
    first = _tokens(rng, prompt, 3 * BLOCK)
    sim.add("a", first, prompt)
    checked = sim.decode("a", steps=3 * BLOCK)
    assert checked > 0 and sim.boundary_writes > 0
    generated = sim.requests["a"][1]["c"]
    assert generated > prompt + 3 * BLOCK, "the first request crossed too few boundaries"
    # A second turn: the first request's prompt and answer so far, then new tokens.
    sim.add("b", first[:generated] + _tokens(rng, 20, 20), generated + 20)
    hit = sim.requests["b"][1]["hit"]
    assert hit > prompt, f"the second turn hit {hit} tokens, none of them from tree steps"
    sim.decode("b", steps=20)


@pytest.mark.parametrize("asynchronous", [False, True])
def test_requests_in_turns_on_a_small_cache_never_share_a_written_state_block(asynchronous):
    """Three requests decoding in turns, then second turns of each while the others go on: freed blocks go to other
    requests at once (a small pool), so a write into a block the scheduler no longer counts as the writer's would
    corrupt another request's state, and the checks would see it."""
    sim = Sim(31, asynchronous, 3, num_blocks=130)
    rng = np.random.default_rng(7)
    prompt = 6 * BLOCK + 2
    firsts = {name: _tokens(rng, prompt, 2 * BLOCK) for name in "abc"}
    for name, truth in firsts.items():
        sim.add(name, truth, prompt)
    assert sim.decode("a", "b", "c", steps=2 * BLOCK) > 0
    for name in "abc":
        generated = sim.requests[name][1]["c"]
        sim.add(name + "2", firsts[name][:generated] + _tokens(rng, 15, BLOCK), generated + 15)
        assert sim.requests[name + "2"][1]["hit"] > prompt
    sim.decode("a2", "b2", "c2", steps=BLOCK)
    assert sim.boundary_writes > 0
    # Freed state blocks went on to other requests (those that started from a cache hit share blocks by design too).
    assert any(len({user.rstrip("2") for user in users}) > 1 for users in sim.users.values())


def test_a_preempted_request_resumes_from_state_blocks_tree_steps_wrote():
    """vLLM frees a preempted request's blocks; resumed, it starts from the cache's hit (past its prompt: blocks that
    tree steps wrote) and decodes on exactly (synchronous scheduling, as the preemption is modelled)."""
    sim = Sim(15, False, 4)
    prompt = 5 * BLOCK
    sim.add("a", _tokens(np.random.default_rng(11), prompt, 3 * BLOCK + 1), prompt)
    sim.decode("a", steps=2 * BLOCK)
    sim.preempt_and_resume("a")
    assert sim.requests["a"][1]["hit"] > prompt
    sim.decode("a", steps=BLOCK)


def _preempted_under_launched_steps(seed: int):
    """A request decoding under asynchronous scheduling, preempted four times with a step launched; its hits."""
    sim = Sim(15, True, seed)
    prompt = 5 * BLOCK + 3
    sim.add("a", _tokens(np.random.default_rng(20 + seed), prompt, 6 * BLOCK + 1), prompt)
    hits = []
    for _ in range(4):
        sim.decode("a", steps=BLOCK // 2)
        sim.preempt_in_flight_and_resume("a")
        hits.append(sim.requests["a"][1]["hit"])
    sim.decode("a", steps=BLOCK)
    return sim, hits, prompt


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_request_preempted_under_its_launched_step_resumes_exactly_from_what_tree_steps_wrote(seed):
    """Asynchronous scheduling: vLLM frees a preempted request's blocks while the step it launched is still to run.
    A block that step writes and vLLM already hashed (at the step's allocation, when the root completes its block)
    gets exactly the state its hash names, and the resumed request starts from blocks tree steps wrote."""
    _, hits, prompt = _preempted_under_launched_steps(seed)
    assert max(hits) > prompt


def test_a_launched_step_after_its_requests_preemption_writes_hashed_blocks_in_some_runs():
    """The case the test above guards is reached: some run's launched step writes a block vLLM had hashed."""
    assert any(_preempted_under_launched_steps(seed)[0].cached_freed_writes for seed in range(12))


def test_the_block_size_check_names_the_budget_and_the_block_size():
    assert block_size_problem(BLOCK, 31) is None
    problem = block_size_problem(BLOCK, 32)
    assert "ddtree_budget 32" in problem and "block_size 32" in problem and "33" in problem


def test_a_step_of_more_than_a_block_would_leave_a_boundary_column_unallocated():
    """What the block-size rule guards: with more scheduled tokens than a block holds, vLLM's running column skips
    a column (a null block) that a boundary commit must write."""
    assert _runs_writing_freed_blocks(3, budget=BLOCK + 8) > 0


def test_boundary_prefixes_only_where_the_roots_block_is_not_the_running_column():
    prefix, column = boundary_prefixes(np.array([30, 30, 20, 32, 25]), np.array([8, 2, 8, 8, 8]), BLOCK, DEPTH + 1)
    # 30 + 8 - 1 = 37 runs in column 1, the root in column 0: the boundary 32 is 2 entries away.
    # 30 + 2 - 1 = 31 runs in column 0 itself; 20 is 12 entries away (more than a path holds); 32 starts a block.
    assert prefix.tolist() == [2, 0, 0, 0, 7] and column.tolist() == [0, 0, 0, 1, 0]


@pytest.mark.parametrize("asynchronous", [False, True])
def test_without_boundary_commits_a_hashed_state_block_is_stale(asynchronous):
    sim = Sim(7, asynchronous, 0, boundary_commits=False)
    sim.add("a", _tokens(np.random.default_rng(5), 9 * BLOCK, 3 * BLOCK), 9 * BLOCK)
    with pytest.raises(AssertionError, match="stale|wrong state"):
        sim.decode("a", steps=3 * BLOCK)


def test_without_the_lag_an_asynchronous_step_writes_a_block_the_scheduler_freed():
    assert _runs_writing_freed_blocks(4, budget=15, lag=0) > 0


def _runs_writing_freed_blocks(seeds: int, **sim) -> int:
    """Of ``seeds`` asynchronous runs of one request with ``sim``'s settings, those in which a step read or wrote a
    block the scheduler no longer counted as the request's (every other failure is raised)."""
    failures = 0
    for seed in range(seeds):
        run = Sim(asynchronous=True, seed=seed, **sim)
        run.add("a", _tokens(np.random.default_rng(seed), 9 * BLOCK, 3 * BLOCK), 9 * BLOCK)
        try:
            run.decode("a", steps=3 * BLOCK)
        except AssertionError as error:
            assert "is not the request's any more" in str(error)
            failures += 1
    return failures


@pytest.mark.skipif(
    not patches.vllm_below(patches.STATE_LOOKUP_FIXED_IN), reason="this vLLM's own state lookup stops inside the K/V"
)
def test_with_vllms_state_lookup_a_second_turn_would_start_past_its_attention_blocks(monkeypatch):
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    sim = Sim(7, False, 0)
    lookup = MambaManager.__dict__["find_longest_cache_hit"].__func__
    monkeypatch.setattr(MambaManager, "find_longest_cache_hit", classmethod(lookup.__wrapped__))
    rng = np.random.default_rng(100)
    prompt = 9 * BLOCK + 5
    first = _tokens(rng, prompt, 3 * BLOCK)
    sim.add("a", first, prompt)
    sim.decode("a", steps=3 * BLOCK)
    generated = sim.requests["a"][1]["c"]
    with pytest.raises(AssertionError, match="attention blocks"):
        sim.add("b", first[:generated] + _tokens(rng, 20, 0), generated + 20)


@pytest.mark.parametrize("version, wrapped", [("0.25.1", True), ("0.32.9", True), ("0.33.0", False)])
def test_the_state_lookup_patch_is_installed_only_on_a_vllm_with_the_bug(monkeypatch, version, wrapped):
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    for name in ("find_longest_cache_hit", "remove_skipped_blocks"):  # vLLM's own methods, restored afterwards
        attribute = MambaManager.__dict__[name]
        function = attribute.__func__ if isinstance(attribute, classmethod) else attribute
        own = getattr(function, "__wrapped__", function) if getattr(function, "__ddtree_wrapped__", False) else function
        monkeypatch.setattr(MambaManager, name, classmethod(own) if isinstance(attribute, classmethod) else own)
    patches.install_state_block_patches(version)
    lookup = MambaManager.__dict__["find_longest_cache_hit"].__func__
    assert getattr(lookup, "__ddtree_wrapped__", False) is wrapped
    assert getattr(MambaManager.remove_skipped_blocks, "__ddtree_wrapped__", False)  # 13a on every version


# -- the runner's part (CPU stand-ins for vLLM's buffers) --------------------------------------------------------
def _runner_for_boundaries(computed, scheduled, tables):
    from types import SimpleNamespace

    from ddtree.vllm.runner import DDTreeGPUModelRunner

    from ddtree.vllm.stats import DDTreeStats
    from ddtree.vllm.staging import StepStaging

    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_aligned_states = True
    runner._ddtree_state_group_layers = None
    runner.device = torch.device("cpu")
    runner._ddtree_boundary_staging = StepStaging(runner.device)
    runner.ddtree_stats = DDTreeStats(DEPTH, ())
    runner.query_start_loc = SimpleNamespace(np=np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32))
    runner.input_batch = SimpleNamespace(
        num_computed_tokens_cpu=np.asarray(computed, dtype=np.int32),
        block_table=[SimpleNamespace(get_numpy_array=lambda t=t: t) for t in tables],
    )
    attention = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    state = MambaSpec(block_size=BLOCK, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    runner.kv_cache_config = SimpleNamespace(
        kv_cache_groups=[
            KVCacheGroupSpec(["attn.0"], attention),
            KVCacheGroupSpec(["gdn.0", "gdn.1"], state),
            KVCacheGroupSpec(["gdn.2"], state),
        ]
    )
    return runner


def test_the_runner_finds_each_trees_boundary_block_in_every_state_group():
    from types import SimpleNamespace

    # Batch rows 0..2; trees in rows 2 and 0 (plan order). Row 2: 60 computed, 8 scheduled -> root block 1 ends at
    # 64, 4 entries away, running column (67 // 32 = 2) beyond it. Row 0: 40 computed: 24 entries away (no commit).
    tables = [np.arange(30).reshape(3, 10), 100 + np.arange(30).reshape(3, 10), 200 + np.arange(30).reshape(3, 10)]
    runner = _runner_for_boundaries([40, 5, 60], [8, 1, 8], tables)
    # The groups' own block size indexes their tables (cache_config's mamba_block_size was another number on a GPU:
    # the boundary commits read column 11 of 8, gpu-h100-e2e-117fa17), BLOCK here.
    runner.cache_config = SimpleNamespace(mamba_block_size=7, mamba_cache_mode="align")
    plan = SimpleNamespace(batch_index=np.array([2, 0]), draft_depth=DEPTH)
    prefix, slots = runner._ddtree_state_boundaries(plan)
    assert prefix.tolist() == [4, 0]
    assert set(slots) == {"gdn.0", "gdn.1", "gdn.2"} and slots["gdn.0"] is slots["gdn.1"]
    assert runner._ddtree_boundary_staging.uploads == 1  # prefixes and every group's blocks in one copy
    assert slots["gdn.0"].tolist() == [100 + 21, -1] and slots["gdn.2"].tolist() == [200 + 21, -1]
    assert (runner.ddtree_stats.boundary_commit_trees, runner.ddtree_stats.boundary_commit_steps) == (1, 1)
    # No tree within reach of its block's end: nothing to commit, nothing counted.
    runner = _runner_for_boundaries([40, 5, 50], [8, 1, 8], tables)
    assert runner._ddtree_state_boundaries(plan) is None and runner.ddtree_stats.boundary_commit_steps == 0
    runner._ddtree_aligned_states = False  # no prefix caching
    assert runner._ddtree_state_boundaries(plan) is None


def test_the_runner_keeps_accepted_counts_at_one_and_skips_vllms_state_copies(monkeypatch):
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ddtree.vllm import runner as runner_module

    runner = _runner_for_boundaries([40, 5, 60], [8, 1, 8], [np.zeros((3, 4), dtype=np.int32)] * 3)
    runner.input_batch.num_accepted_tokens_cpu = np.array([3, 5, 2, 7])
    runner.num_accepted_tokens = SimpleNamespace(gpu=torch.tensor([3, 5, 2, 7]))
    recorded = []
    runner.num_accepted_tokens_event = SimpleNamespace(record=recorded.append)
    monkeypatch.setattr(runner_module, "current_stream", lambda: "vLLM's current stream")
    called = []
    monkeypatch.setattr(GPUModelRunner, "_update_states_after_model_execute", lambda *a: called.append(a))
    output = torch.tensor([[1, 2, -1], [4, -1, -1], [5, 6, 7]])
    runner._update_states_after_model_execute(output, None)
    assert runner.input_batch.num_accepted_tokens_cpu.tolist() == [1, 1, 1, 7]
    assert runner.num_accepted_tokens.gpu.tolist() == [1, 1, 1, 7] and not called
    assert recorded == ["vLLM's current stream"]  # (the event's stream given: torch's lookup is slow)
    runner._ddtree_aligned_states = False  # without prefix caching: vLLM's own
    runner._update_states_after_model_execute(output, None)
    assert len(called) == 1


def test_the_boundary_commits_run_before_the_main_commit(monkeypatch):
    from types import SimpleNamespace

    from ddtree.vllm import runner as runner_module
    from ddtree.vllm.runner import DDTreeGPUModelRunner

    order = []
    monkeypatch.setattr(runner_module, "commit_boundaries", lambda pendings, plan, *a, **k: order.append("boundary"))
    monkeypatch.setattr(runner_module, "commit_pending", lambda step, plan: order.append("main"))
    runner = object.__new__(DDTreeGPUModelRunner)
    runner._ddtree_conv_window, runner._ddtree_full_graph = 3, None
    runner._ddtree_gdn_step = SimpleNamespace(node_offsets="offsets", pending={"gdn.0": "recorded"})
    gpu = {"paths": "paths", "path_lengths": "lengths", "commit_conv_index": "conv"}
    runner._ddtree_commit_gdn(gpu, ("prefix", {"gdn.0": "slots"}))
    assert order == ["boundary", "main"]
    runner._ddtree_gdn_step = SimpleNamespace(node_offsets="offsets", pending={"gdn.0": "recorded"})
    runner._ddtree_commit_gdn(gpu)
    assert order == ["boundary", "main", "main"]


def test_vllms_own_pre_step_copy_and_state_column_are_the_ones_the_rules_assume(monkeypatch):
    """The model worker above moves the running state whole to column ``(c + n - 1) // block_size`` before a step,
    and the boundary rules take that column as the one the step reads and the main commit writes. Here vLLM's own
    ``preprocess_mamba`` (its copies recorded instead of made) and the GDN metadata's column gather
    (``mamba_get_block_table_tensor``) are run with ddtree's accepted counts of 1."""
    from types import SimpleNamespace

    from vllm.v1.attention.backends.utils import mamba_get_block_table_tensor
    from vllm.v1.worker import mamba_utils

    copies = []
    monkeypatch.setattr(
        mamba_utils,
        "collect_mamba_copy_meta",
        lambda bufs, config, funcs, groups, src, dst, bias, *rest: copies.append((src, dst, bias)),
    )
    monkeypatch.setattr(mamba_utils, "do_mamba_copy_block", lambda bufs: None)
    state = MambaSpec(block_size=BLOCK, shapes=((1,),), dtypes=(torch.float32,), mamba_cache_mode="align")
    bufs = SimpleNamespace(mamba_group_ids=[STATE], mamba_spec=state, offset=0)
    computed, scheduled = {"a": 20, "b": 40, "c": 63}, {"a": 16, "b": 16, "c": 16}
    output = SimpleNamespace(
        finished_req_ids=set(),
        preempted_req_ids=set(),
        scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
        num_scheduled_tokens=scheduled,
    )
    batch = SimpleNamespace(req_ids=["a", "b", "c"], num_accepted_tokens_cpu=np.ones(3, dtype=np.int32))
    requests = {name: SimpleNamespace(num_computed_tokens=c) for name, c in computed.items()}
    state_idx = {"a": 0, "b": 1, "c": 1}  # the previous steps' running columns
    config = SimpleNamespace(enable_prefix_caching=True)
    mamba_utils.preprocess_mamba(output, None, config, state_idx, batch, requests, {}, (), bufs)
    running = {name: (computed[name] + scheduled[name] - 1) // BLOCK for name in computed}
    assert state_idx == running == {"a": 1, "b": 1, "c": 2}
    assert copies == [(0, 1, 0), (1, 2, 0)]  # whole states (bias 0), only where the column moved
    table = torch.arange(3 * 8, dtype=torch.int32).reshape(3, 8)
    seq_lens = torch.tensor([computed[n] + scheduled[n] for n in "abc"])
    columns = mamba_get_block_table_tensor(table, seq_lens, state, "align")
    assert columns[:, 0].tolist() == [8 * r + running[n] for r, n in enumerate("abc")]
