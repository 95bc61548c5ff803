"""ddtree's host-part timers: a profiler range only when vLLM's ranges are on (each costs ~0.7 us otherwise)."""

import pytest

from ddtree.vllm import stats as stats_module
from ddtree.vllm.stats import DDTreeStats


@pytest.mark.parametrize("variable", ["VLLM_CUSTOM_SCOPES_FOR_PROFILING", "VLLM_NVTX_SCOPES_FOR_PROFILING"])
def test_a_timed_part_is_a_profiler_range_only_when_vllms_ranges_are_on(monkeypatch, variable):
    ranges = []

    class Range:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            ranges.append(self.name)

        def __exit__(self, *exc):
            ranges.append("/" + self.name)

    monkeypatch.setattr(stats_module, "record_function_or_nullcontext", Range)
    for name in ("VLLM_CUSTOM_SCOPES_FOR_PROFILING", "VLLM_NVTX_SCOPES_FOR_PROFILING"):
        monkeypatch.delenv(name, raising=False)
    quiet = DDTreeStats(4)
    with quiet.timed("plan"):
        pass
    assert ranges == [] and quiet.host_seconds["plan"] >= 0.0
    monkeypatch.setenv(variable, "1")
    scoped = DDTreeStats(4)
    with scoped.timed("plan"):
        with scoped.timed("accept"):
            pass
    assert ranges == ["ddtree: plan", "ddtree: accept", "/ddtree: accept", "/ddtree: plan"]
    assert set(scoped.host_seconds) == {"plan", "accept"}
