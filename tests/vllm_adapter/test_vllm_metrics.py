"""DDTree's spec-decode metrics through vLLM's own stat loggers, on a real ddtree VllmConfig (no GPU: nothing runs).

The stats are made as vLLM's scheduler makes them (``SpecDecodingStats.new(B)`` + ``observe_draft`` per tree) and
read back from prometheus_client's registry under the names and labels a dashboard scrapes.
"""

from types import SimpleNamespace

import pytest

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
