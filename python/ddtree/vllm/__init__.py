"""DDTree for vLLM 0.25.x (attention-only and hybrid Gated-DeltaNet targets, V1 model runner).

Usage, once ``ddtree`` is installed (its ``vllm.general_plugins`` entry point
loads :mod:`ddtree.vllm.plugin` in every vLLM process)::

    vllm serve <target> --speculative-config \\
        '{"method": "ddtree", "model": "<DFlash drafter>", "num_speculative_tokens": 15, "ddtree_budget": 64}'

or ``vllm.LLM(model=..., speculative_config={...same dict...})``.

Modules: ``config`` (translation/validation, no vLLM import), ``step``
(per-step tree bookkeeping on numpy, no vLLM import), ``node_sampling``
(torch, no vLLM import), and the vLLM side: ``patches`` (every patch, version
check), ``plugin``, ``worker``, ``runner``, ``proposer``, ``sampler``,
``attention`` (the backend around
:mod:`ddtree.kernels.paged_attention_triton`). Nothing here imports vLLM at
package import time.
"""
