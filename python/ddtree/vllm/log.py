"""ddtree's logger inside vLLM.

vLLM configures one logger, ``vllm``, with its handler and level, and no other: a logger outside that tree
(``ddtree.vllm.runner``) has no handler in a vLLM process, so Python prints only its warnings, unformatted, and
drops every info line (the start-up settings the adapter changes, with their reasons). ddtree's loggers are
therefore children of ``vllm``: ``vllm.ddtree.<module>``.
"""

from __future__ import annotations


def get_logger(module: str):
    """vLLM's logger for one ddtree module (``__name__``), under ``vllm.ddtree``."""
    from vllm.logger import init_logger

    return init_logger("vllm.ddtree." + module.rsplit(".", 1)[-1])
