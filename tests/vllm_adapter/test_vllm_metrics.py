"""DDTree's spec-decode metrics through vLLM's own stat loggers, on a real ddtree VllmConfig (no GPU: nothing runs).

The stats are made as vLLM's scheduler makes them (``SpecDecodingStats.new(B)`` + ``observe_draft`` per tree) and
read back from prometheus_client's registry under the names and labels a dashboard scrapes. The O(L) readings
(``tree_counts``, DDTree's ``observe``) are checked against copies of the O(B) ones they replaced, kept here.
"""

import functools
from decimal import Decimal
from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

vllm = pytest.importorskip("vllm")

from ddtree.vllm import metrics, patches  # noqa: E402

PAIR = "tests/fixtures/models"
BUDGET, DEPTH = 64, 15  # the fixture drafter's block_size is 16


@pytest.fixture(scope="module")
def config():
    """A ddtree engine's VllmConfig as `vllm serve` creates it in its front end (H200 platform faked)."""
    import vllm.platforms
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    patches.apply()
    with pytest.MonkeyPatch.context() as mp:
        platform = vllm.platforms.current_platform
        mp.setattr(platform, "device_type", "cuda", raising=False)
        mp.setattr(platform, "get_device_total_memory", lambda device_id=0: 141 << 30, raising=False)
        mp.setattr(platform, "get_device_name", lambda device_id=0: "NVIDIA H200", raising=False)
        mp.setattr(platform, "support_static_graph_mode", lambda: True, raising=False)
        args = AsyncEngineArgs(
            model=f"{PAIR}/target",
            language_model_only=True,
            additional_config={"gdn_prefill_backend": "triton"},
            speculative_config={"method": "ddtree", "model": f"{PAIR}/drafter", "ddtree_budget": BUDGET},
        )
        cfg = args.create_engine_config(UsageContext.OPENAI_API_SERVER)
    assert cfg.speculative_config.num_speculative_tokens == BUDGET
    assert cfg.additional_config["ddtree"]["draft_len"] == DEPTH
    return cfg


@pytest.fixture
def not_ddtree(config):
    """The same config without its ddtree settings: what any other engine looks like to patch 9."""
    settings = config.additional_config.pop("ddtree")
    try:
        yield config
    finally:
        config.additional_config["ddtree"] = settings


def step_stats(trees):
    """One scheduler step's SpecDecodingStats, made as vLLM's scheduler makes them: (nodes, accepted) per tree."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    stats = SpecDecodingStats.new(BUDGET)
    for nodes, accepted in trees:
        stats.observe_draft(num_draft_tokens=nodes, num_accepted_tokens=accepted)
    return stats


# The GPU run of the issue: 54 whole trees of 64 nodes, 86 accepted tokens, 44/24/14/3/1 trees reaching depth 1-5.
MEASURED = [(64, 0)] * 10 + [(64, 1)] * 20 + [(64, 2)] * 10 + [(64, 3)] * 11 + [(64, 4)] * 2 + [(64, 5)]
MEASURED_PER_DEPTH = [44, 24, 14, 3, 1] + [0] * (DEPTH - 5)


def sample(name, config, **labels):
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(
        name, {"model_name": config.model_config.served_model_name, "engine": "0", **labels}
    )


def record(logger, stats):
    from vllm.v1.metrics.stats import SchedulerStats

    logger.record(scheduler_stats=SchedulerStats(spec_decoding_stats=stats), iteration_stats=None)


def test_prometheus_counts_trees_nodes_and_depths(config):
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    logger = PrometheusStatLogger(config, [0])
    assert isinstance(logger.spec_decoding_prom, SpecDecodingProm)
    assert type(logger.spec_decoding_prom) is metrics.DDTreeSpecDecodingProm
    assert sample("vllm:spec_decode_ddtree_budget", config) == BUDGET
    assert sample("vllm:spec_decode_ddtree_draft_depth", config) == DEPTH
    assert sample("vllm:spec_decode_ddtree_num_trees_total", config) == 0

    record(logger, step_stats(MEASURED[:30]))  # two steps, as the scheduler reports them
    record(logger, step_stats(MEASURED[30:]))
    # vLLM's own counters keep their meaning: drafts = trees, draft tokens = nodes, accepted = path tokens.
    assert sample("vllm:spec_decode_num_drafts_total", config) == 54
    assert sample("vllm:spec_decode_num_draft_tokens_total", config) == 54 * 64 == 3456
    assert sample("vllm:spec_decode_num_accepted_tokens_total", config) == 86
    # ... and sized by the budget: positions from the depth on exist and stay 0.
    assert sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", config, position="0") == 44
    assert sample("vllm:spec_decode_num_accepted_tokens_per_pos_total", config, position="63") == 0
    # DDTree's: same labels, depth 1..L only.
    assert sample("vllm:spec_decode_ddtree_num_trees_total", config) == 54
    assert sample("vllm:spec_decode_ddtree_num_partial_trees_total", config) == 0
    assert sample("vllm:spec_decode_ddtree_num_tree_nodes_total", config) == 3456
    per_depth = [
        sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth=str(d))
        for d in range(1, DEPTH + 1)
    ]
    assert per_depth == MEASURED_PER_DEPTH
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth="0") is None
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth=str(DEPTH + 1)) is None

    # Trees the scheduler cut (fewer nodes than the budget), and one accepting the whole depth.
    record(logger, step_stats([(40, 2), (64, DEPTH), (1, 1), (63, 0)]))
    assert sample("vllm:spec_decode_ddtree_num_trees_total", config) == 58
    assert sample("vllm:spec_decode_ddtree_num_partial_trees_total", config) == 3
    assert sample("vllm:spec_decode_ddtree_num_tree_nodes_total", config) == 3456 + 168
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth="1") == 47
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth="2") == 26
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth=str(DEPTH)) == 1
    # Mean acceptance length, as the docs' PromQL computes it: 1 + accepted / trees.
    accepted = sample("vllm:spec_decode_num_accepted_tokens_total", config)
    assert accepted == 86 + 2 + DEPTH + 1
    assert 1 + accepted / sample("vllm:spec_decode_ddtree_num_trees_total", config) == pytest.approx(1 + 104 / 58)


def test_bad_stats_do_not_crash_the_front_end(config, monkeypatch):
    from vllm.v1.metrics.loggers import PrometheusStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    logger = PrometheusStatLogger(config, [0])
    long = step_stats([(64, 3)])
    long.num_accepted_tokens_per_pos += [7] * 300  # longer than the budget: vLLM reads B, DDTree L positions
    long.num_draft_tokens_per_pos += [9] * 300
    record(logger, long)
    assert sample("vllm:spec_decode_ddtree_num_trees_total", config) == 1
    assert sample("vllm:spec_decode_ddtree_num_partial_trees_total", config) == 0
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth="3") == 1
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth="4") == 0
    assert sample("vllm:spec_decode_ddtree_num_accepted_tokens_per_depth_total", config, depth=str(DEPTH)) == 0

    # DDTree's part alone (vLLM's own counters are vLLM's: a short accepted list is its IndexError).
    prom = logger.spec_decoding_prom
    garbage = SimpleNamespace(
        num_drafts="two",
        num_draft_tokens=float("nan"),
        num_accepted_tokens=-5,
        num_accepted_tokens_per_pos=None,
        num_draft_tokens_per_pos=[1, 2],  # too short to tell whole trees
    )
    monkeypatch.setattr(SpecDecodingProm, "observe", lambda self, stats, engine_idx=0: None)
    prom.observe(garbage, 0)
    prom.observe(step_stats([(64, 2)]), engine_idx=3)  # an engine the logger does not know
    prom.observe(SimpleNamespace(num_drafts=2, num_draft_tokens_per_pos=5, num_accepted_tokens_per_pos="ab"), 0)
    assert sample("vllm:spec_decode_ddtree_num_trees_total", config) == 3
    assert sample("vllm:spec_decode_ddtree_num_partial_trees_total", config) == 0
    assert sample("vllm:spec_decode_ddtree_num_tree_nodes_total", config) == 64


def test_tree_counts_reads_whatever_arrives():
    counts = metrics.tree_counts(step_stats([(64, 3), (10, 1), (64, 0)]), BUDGET, DEPTH)
    assert counts == metrics.TreeCounts(
        trees=3,
        partial_trees=1,
        nodes=138,
        accepted=4,
        accepted_per_depth=(2, 1, 1) + (0,) * (DEPTH - 3),
        budget_in_use=64,
    )
    assert metrics.tree_counts(None, BUDGET, DEPTH) == metrics.TreeCounts(0, 0, 0, 0, (0,) * DEPTH)
    odd = SimpleNamespace(
        num_drafts=4, num_accepted_tokens_per_pos=[3, None, "x", -1], num_draft_tokens_per_pos=[4] * 64
    )
    assert metrics.tree_counts(odd, BUDGET, 5).accepted_per_depth == (3, 0, 0, 0, 0)
    assert metrics.tree_counts(odd, BUDGET, 5).partial_trees == 0


def test_tree_counts_under_a_budget_schedule():
    # Budgets 16/32/64 (the largest sizes vLLM's lists): trees of 16 and 32 nodes are whole, 10 and 40 were cut.
    stats = step_stats([(32, 2), (32, 1), (16, 0), (10, 1), (40, 3)])
    counts = metrics.tree_counts(stats, (16, 32, 64), DEPTH)
    assert (counts.trees, counts.partial_trees, counts.nodes) == (5, 2, 130)
    assert counts.budget_in_use == 32  # most of the step's whole trees
    # Read with the largest budget alone, every tree below 64 nodes would count as cut.
    assert metrics.tree_counts(stats, 64, DEPTH).partial_trees == 5
    assert metrics.budget_tuple(64) == (64,) and metrics.budget_tuple([64, 16, 32, 16]) == (16, 32, 64)


def test_log_line_reads_trees_over_the_drafters_depth(config):
    from vllm.v1.metrics.loggers import AggregatedLoggingStatLogger, LoggingStatLogger

    logger = LoggingStatLogger(config)
    assert type(logger.spec_decoding_logging) is metrics.DDTreeSpecDecodingLogging
    assert type(AggregatedLoggingStatLogger(config, [0]).spec_decoding_logging) is metrics.DDTreeSpecDecodingLogging
    record(logger, step_stats(MEASURED[:30]))
    record(logger, step_stats(MEASURED[30:] + [(40, 0)]))
    lines = []
    logger.spec_decoding_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    (line,) = lines
    rates = ", ".join(f"{n / 55:.3f}" for n in MEASURED_PER_DEPTH)
    assert line.startswith("SpecDecoding metrics: Mean acceptance length: 2.56, Accepted throughput: ")
    assert "Accepted: 86 tokens, Trees: 55 (partial: 1), Mean tree nodes: 63.6 of budget 64, " in line
    assert f"Per-depth acceptance rate (depth 1-{DEPTH}): {rates}, Accepted per tree node: 2.5%" in line
    assert line.endswith("Accepted per tree node: 2.5%") and "Drafted" not in line
    logger.spec_decoding_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1  # nothing new since the last line: no line, as vLLM's
    logger.spec_decoding_logging.observe(SimpleNamespace(num_drafts=None))  # bad input: ignored, no crash
    logger.spec_decoding_logging.log(log_fn=lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1


def test_other_engines_keep_vllms_metrics(not_ddtree):
    from prometheus_client import REGISTRY
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger
    from vllm.v1.spec_decode.metrics import SpecDecodingLogging, SpecDecodingProm

    prom = PrometheusStatLogger(not_ddtree, [0])
    assert type(prom.spec_decoding_prom) is SpecDecodingProm
    assert not [name for name in REGISTRY._names_to_collectors if name.startswith(metrics.PREFIX)]
    assert type(LoggingStatLogger(not_ddtree).spec_decoding_logging) is SpecDecodingLogging


def test_patch_9_is_applied_once():
    from vllm.v1.metrics.loggers import LoggingStatLogger, PrometheusStatLogger

    patches.apply()
    for cls in (PrometheusStatLogger, LoggingStatLogger):
        wrapper = cls.__init__
        assert getattr(wrapper, "__ddtree_wrapped__", False)
        patches._wrap_once(cls, "__init__", patches._tree_metrics_prom)
        assert cls.__init__ is wrapper


def test_the_per_position_lists_survive_vllms_msgpack():
    """The partial-tree count reads ``num_draft_tokens_per_pos``, which vLLM's front end never reads: it must
    arrive there as the engine core sent it (EngineCoreOutputs through vLLM's own encoder and decoder)."""
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.metrics.stats import SchedulerStats
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    sent = step_stats([(64, 4), (12, 2), (64, 0)])
    outputs = EngineCoreOutputs(scheduler_stats=SchedulerStats(spec_decoding_stats=sent))
    received = MsgpackDecoder(EngineCoreOutputs).decode(MsgpackEncoder().encode(outputs)).scheduler_stats
    assert received.spec_decoding_stats == sent
    assert received.spec_decoding_stats.num_draft_tokens_per_pos[BUDGET - 1] == 2
    assert metrics.tree_counts(received.spec_decoding_stats, BUDGET, DEPTH).partial_trees == 1


def test_the_front_end_reads_a_schedules_budgets_from_the_engine_config():
    from ddtree.vllm.patches import tree_shape

    def engine_config(schedule):
        settings = {"draft_len": 15, "budget_schedule": schedule}
        spec = SimpleNamespace(num_speculative_tokens=64, draft_model_config=None)
        return SimpleNamespace(speculative_config=spec, additional_config={"ddtree": settings})

    assert tree_shape(engine_config([[1, 64], [8, 16]])) == ((16, 64), 15)  # lists: after a JSON round trip
    assert tree_shape(engine_config(None)) == (64, 15)


# ---- the O(L) readings against the O(B) ones they replaced -------------------------------------------------
def old_count(value):
    """``metrics._count`` before its int fast path (kept as the oracle)."""
    try:
        n = int(value)
    except (TypeError, ValueError, OverflowError):
        return 0
    return n if n > 0 else 0


def old_items(values):
    if values is None or isinstance(values, (str, bytes)):
        return []
    try:
        return list(values)
    except TypeError:
        return []


def old_tree_counts(stats, budget, depth):
    """``metrics.tree_counts`` as it was, converting the first ``B`` drafted entries (kept as the oracle)."""
    budgets = metrics.budget_tuple(budget)
    largest = budgets[-1]
    trees = old_count(getattr(stats, "num_drafts", 0))
    accepted = [old_count(v) for v in old_items(getattr(stats, "num_accepted_tokens_per_pos", None))[:depth]]
    accepted += [0] * (depth - len(accepted))
    drafted = old_items(getattr(stats, "num_draft_tokens_per_pos", None))
    whole = {}
    if largest >= 1 and len(drafted) >= largest:
        at_least = [old_count(v) for v in drafted[:largest]] + [0]
        whole = {b: max(at_least[b - 1] - at_least[b], 0) for b in budgets}
    partial = max(trees - sum(whole.values()), 0) if whole else 0
    in_use = max(whole, key=lambda b: (whole[b], b)) if any(whole.values()) else None
    return metrics.TreeCounts(
        trees=trees,
        partial_trees=partial,
        nodes=old_count(getattr(stats, "num_draft_tokens", 0)),
        accepted=old_count(getattr(stats, "num_accepted_tokens", 0)),
        accepted_per_depth=tuple(accepted),
        budget_in_use=in_use,
    )


class ReversedList(list):
    """A list subclass that iterates otherwise than it indexes: ``list(x)`` follows its ``__iter__``."""

    def __iter__(self):
        return iter(list.__getitem__(self, slice(None, None, -1)))


# Values of every built-in kind a malformed list could hold (int() of each returns or raises TypeError,
# ValueError or OverflowError: a user class's __int__ raising anything else is the one input the two readings
# would tell apart, the old one raising at any of the first B entries, the new one at those it reads).
ODD = st.one_of(
    st.integers(-3, 2**70),
    st.booleans(),
    st.floats(),
    st.none(),
    st.text(max_size=3),
    st.binary(max_size=2),
    st.decimals(),
    st.fractions(max_denominator=4),
    st.complex_numbers(max_magnitude=4),
    st.sampled_from([0.0, -0.0, Decimal(0), 0j, Fraction(0), np.int64(0), np.int64(3), np.float64("nan"), "7", [1]]),
)
KINDS = ["list"] * 8 + ["tuple", "iter", "array", "none", "str", "int", "dict", "missing", "listsub"]


@st.composite
def per_pos_recipes(draw, size, depth, odd_weight=3):
    """(container kind, values): mostly a list of ``size`` counts, nonzero only below ``depth`` and falling as
    a scheduler's are, else anything."""
    n = max(draw(st.sampled_from([size] * 6 + [size - 1, size + 1, 0, 1, size + 7])), 0)
    values = sorted(draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), reverse=True)
    values = [v if i < depth else 0 for i, v in enumerate(values)]
    for _ in range(draw(st.integers(0, 2)) if draw(st.integers(0, odd_weight)) == 0 else 0):
        if values:
            values[draw(st.integers(0, len(values) - 1))] = draw(st.one_of(st.integers(-2, 9), ODD))
    return draw(st.sampled_from(KINDS)), values


def build(kind, values):
    """A fresh container of ``values`` (an iterator is used up by whoever reads it first)."""
    return {
        "list": lambda: list(values),
        "tuple": lambda: tuple(values),
        "iter": lambda: iter(list(values)),
        "array": lambda: np.array(values + [None], dtype=object)[:-1],
        "none": lambda: None,
        "str": lambda: "".join(map(str, values)),
        "int": lambda: len(values),
        "dict": lambda: dict.fromkeys(range(len(values)), 1),
        "listsub": lambda: ReversedList(values),
    }[kind]()


@st.composite
def stats_recipes(draw, size, depth, odd_weight=3):
    def field():
        return draw(st.integers(0, 300) if draw(st.integers(0, odd_weight)) else ODD)

    recipe = {"num_drafts": field(), "num_draft_tokens": field(), "num_accepted_tokens": field()}
    for name in ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos"):
        recipe[name] = draw(per_pos_recipes(size, depth, odd_weight))
    return recipe


def make_stats(recipe):
    if recipe is None:
        return None
    fields = {k: recipe[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    for name in ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos"):
        kind, values = recipe[name]
        if kind != "missing":
            fields[name] = build(kind, values)
    return SimpleNamespace(**fields)


def outcome(fn, *args):
    try:
        return "returned", fn(*args)
    except Exception as error:
        return "raised", type(error), str(error)


@st.composite
def tree_counts_cases(draw):
    budget = draw(st.one_of(st.integers(-2, 12), st.lists(st.integers(-16, 12), max_size=4)))
    sizes = [budget] if isinstance(budget, int) else budget or [0]
    depth = draw(st.integers(-2, 14))
    recipe = draw(st.one_of(st.none(), stats_recipes(max(max(sizes), 0), max(depth, 0))))
    return recipe, budget, depth


@settings(deadline=None)
@given(tree_counts_cases())
def test_tree_counts_reads_as_the_o_b_reading_did(case):
    recipe, budget, depth = case
    assert outcome(metrics.tree_counts, make_stats(recipe), budget, depth) == outcome(
        old_tree_counts, make_stats(recipe), budget, depth
    )


def test_tree_counts_reads_a_few_entries_only():
    """O(L + budgets): the accepted list's first L entries, the drafted list's around each budget."""
    read = []

    class Seen:
        def __init__(self, name, pos, n):
            self.name, self.pos, self.n = name, pos, n

        def __int__(self):
            read.append((self.name, self.pos))
            return self.n

    stats = step_stats([(64, 3), (32, 1), (16, 0), (10, 2)])
    for name in ("num_accepted_tokens_per_pos", "num_draft_tokens_per_pos"):
        setattr(stats, name, [Seen(name[4:12], p, n) for p, n in enumerate(getattr(stats, name))])
    counts = metrics.tree_counts(stats, (16, 32, 64), DEPTH)
    new_reads = sorted(set(read))
    assert counts == old_tree_counts(stats, (16, 32, 64), DEPTH)
    assert (counts.trees, counts.partial_trees, counts.budget_in_use) == (4, 1, 64)
    assert new_reads == [("accepted", p) for p in range(DEPTH)] + [("draft_to", p) for p in (15, 16, 31, 32, 63)]


# vLLM's SpecDecodingProm.observe + DDTree's part as it was: the counters the new observe must leave.
class OldDDTreeProm(metrics._DDTreeProm):
    def observe(self, spec_decoding_stats, engine_idx=0):
        from vllm.v1.spec_decode.metrics import SpecDecodingProm

        SpecDecodingProm.observe(self, spec_decoding_stats, engine_idx)
        if not self.ddtree_enabled:
            return
        try:
            counts = old_tree_counts(spec_decoding_stats, self.ddtree_budget, self.ddtree_depth)
            if engine_idx not in self.counter_ddtree_trees:
                metrics._warn_once("engine", f"unknown engine index {engine_idx!r}")
                return
            self.counter_ddtree_trees[engine_idx].inc(counts.trees)
            self.counter_ddtree_partial_trees[engine_idx].inc(counts.partial_trees)
            self.counter_ddtree_tree_nodes[engine_idx].inc(counts.nodes)
            for child, n in zip(self.counter_ddtree_accepted_per_depth[engine_idx], counts.accepted_per_depth):
                child.inc(n)
            if counts.budget_in_use is not None:
                self.gauge_ddtree_budget_in_use[engine_idx].set(counts.budget_in_use)
        except Exception as error:
            metrics._warn_once(type(error).__name__, f"{type(error).__name__}: {error}")


def isolated_prom(mixin, budget, depth, size):
    """A DDTree prom (``mixin`` over vLLM's SpecDecodingProm) with its own prometheus registry, two engines."""
    import prometheus_client
    from vllm.v1.spec_decode.metrics import SpecDecodingProm

    registry = prometheus_client.CollectorRegistry()
    counter = staticmethod(functools.partial(prometheus_client.Counter, registry=registry))
    base = type("IsolatedSpecDecodingProm", (SpecDecodingProm,), {"_counter_cls": counter})
    cls = type("Isolated" + mixin.__name__, (mixin, base), {})
    prom = cls(
        SimpleNamespace(num_speculative_tokens=size),
        ["model_name", "engine"],
        {0: ["m", "0"], 1: ["m", "1"]},
        budget=budget,
        depth=depth,
        gauge_cls=functools.partial(prometheus_client.Gauge, registry=registry),
    )
    return prom, registry


def samples(registry):
    """Every sample's value and its type (NaN as a string), creation times left out."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): (type(s.value), "nan" if s.value != s.value else s.value)
        for metric in registry.collect()
        for s in metric.samples
        if not s.name.endswith("_created")
    }


@st.composite
def prom_cases(draw):
    size = draw(st.sampled_from([1, 4, 12]))
    depth = draw(st.integers(-1, 14))
    budget = draw(st.sampled_from([size, (max(size // 2, 1), size), (1, size)]))
    steps = draw(st.lists(st.tuples(stats_recipes(size, max(depth, 0)), st.sampled_from([0] * 4 + [1, 2])), max_size=4))
    return size, depth, budget, steps


@settings(deadline=None)
@given(prom_cases())
def test_prometheus_counters_are_vllms_and_the_old_ones(case):
    """Every counter and gauge after each step, and what each observe raised (vLLM's part raises for what vLLM
    cannot count), as vLLM's own observe followed by DDTree's O(B) part leave them."""
    size, depth, budget, steps = case
    new, new_registry = isolated_prom(metrics._DDTreeProm, budget, depth, size)
    old, old_registry = isolated_prom(OldDDTreeProm, budget, depth, size)
    for recipe, engine_idx in steps:
        assert outcome(new.observe, make_stats(recipe), engine_idx) == outcome(
            old.observe, make_stats(recipe), engine_idx
        )
        assert samples(new_registry) == samples(old_registry)


@pytest.mark.parametrize(
    "value",
    [None, "", b"", "1", Decimal(0), Decimal(2), 0j, 0.0, -0.0, 1.5, float("nan"), False, True, -1, 2**70]
    + [Fraction(0), np.int64(0), np.int64(2), [], [1]],
    ids=repr,
)
@pytest.mark.parametrize("pos", [0, 2, 3, 11])
def test_prometheus_counts_odd_values_as_vllm_does(value, pos):
    """One odd value in a scheduler's list, within the depth or beyond it: same counters, same error."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    new, new_registry = isolated_prom(metrics._DDTreeProm, 12, 3, 12)
    old, old_registry = isolated_prom(OldDDTreeProm, 12, 3, 12)
    for prom in (new, old):
        prom.observe(SpecDecodingStats.new(12))  # a step without trees: zeros
    stats = SpecDecodingStats.new(12)
    for accepted in (3, 1, 0):
        stats.observe_draft(num_draft_tokens=12, num_accepted_tokens=accepted)
    stats.num_accepted_tokens_per_pos[pos] = value
    assert outcome(new.observe, stats) == outcome(old.observe, stats)
    assert samples(new_registry) == samples(old_registry)


def test_prometheus_skips_only_the_zeros():
    """vLLM's per-position counters are incremented at the nonzero positions only: the first L for a ddtree
    step, any beyond when they are not 0 (not a ddtree step's: counted as vLLM counts them)."""
    from vllm.v1.spec_decode.metrics import SpecDecodingStats

    prom, registry = isolated_prom(metrics._DDTreeProm, 12, 3, 12)
    incs = []
    for pos, child in enumerate(prom.counter_spec_decode_num_accepted_tokens_per_pos[0]):
        child.inc = functools.partial(lambda inc, pos, n: (incs.append((pos, n)), inc(n)), child.inc, pos)
    stats = SpecDecodingStats.new(12)
    for accepted in (3, 1, 0):
        stats.observe_draft(num_draft_tokens=12, num_accepted_tokens=accepted)
    prom.observe(stats)
    assert incs == [(0, 2), (1, 1), (2, 1)]
    incs.clear()
    stats.num_accepted_tokens_per_pos[9], stats.num_accepted_tokens_per_pos[11] = 5, True
    prom.observe(stats)
    assert incs == [(0, 2), (1, 1), (2, 1), (9, 5), (11, True)]
    per_pos = {
        dict(labels)["position"]: value
        for (name, labels), (_, value) in samples(registry).items()
        if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total" and dict(labels)["engine"] == "0"
    }
    assert per_pos == {str(p): {0: 4, 1: 2, 2: 2, 9: 5, 11: 1}.get(p, 0) for p in range(12)}
