"""Fixtures the vLLM adapter's tests share."""

import pytest


@pytest.fixture
def h200_platform(monkeypatch):
    """vLLM's platform as an H200 host reports it, for config creation on this GPU-less machine (nothing runs)."""
    import vllm.platforms

    platform = vllm.platforms.current_platform
    monkeypatch.setattr(platform, "device_type", "cuda", raising=False)
    monkeypatch.setattr(platform, "get_device_total_memory", lambda device_id=0: 141 << 30, raising=False)
    monkeypatch.setattr(platform, "get_device_name", lambda device_id=0: "NVIDIA H200", raising=False)
    monkeypatch.setattr(platform, "support_static_graph_mode", lambda: True, raising=False)
    return platform
