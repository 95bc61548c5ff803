"""Hypothesis profiles for the whole suite (strategies live in core_strategies.py)."""

from __future__ import annotations

from hypothesis import settings

settings.register_profile("ci", max_examples=300, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=100, deadline=None)
settings.load_profile("ci")
