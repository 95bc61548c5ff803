"""Memos by step shape that start afresh when full.

A batch of whole trees repeats one step shape, so a memo of what a shape needs is hit almost every step; mixed
steps' shapes vary without bound. Emptying a memo when it reaches its limit bounds it without any bookkeeping on
the hit path, which stays the caller's own ``dict.get``.
"""

from __future__ import annotations

from typing import Any, Dict, TypeVar

V = TypeVar("V")


def keep(memo: Dict[Any, V], key: Any, value: V, limit: int) -> V:
    """Stores ``value`` under ``key``, after emptying ``memo`` if it holds ``limit`` entries; returns ``value``."""
    if len(memo) >= limit:
        memo.clear()
    memo[key] = value
    return value
