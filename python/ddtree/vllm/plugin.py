"""Entry point of the ``vllm.general_plugins`` group (see ``pyproject.toml``).

vLLM calls :func:`register` in every process it starts (API server, engine
core, workers) before it builds configs or workers. It only applies the
patches of :mod:`ddtree.vllm.patches`; engines that do not ask for
``method: "ddtree"`` behave exactly as without the plugin.

On a vLLM version outside the supported range the plugin stays inactive and
says so in vLLM's log (raising here would break every vLLM engine of the
environment, ddtree or not); ``ddtree.vllm.patches.apply()`` raises instead.
"""

from __future__ import annotations


def register() -> None:
    from ddtree.vllm import patches

    try:
        patches.apply()
    except patches.UnsupportedVLLMVersion as err:
        from ddtree.vllm.log import get_logger

        get_logger(__name__).warning("ddtree plugin inactive: %s", err)
