"""Training of the project's small test pair: a Qwen3.5-hybrid target (Qwen3.6-27B's architecture at small
scale) and its DFlash drafter, on CPython's standard library, with evaluation by ``ddtree.engine``.

Modules: :mod:`.data` (corpus, split, tokenizer, token files), :mod:`.model` (architecture, checkpoint
layout), :mod:`.dflash` (DFlash training forward and loss), :mod:`.train` (time-boxed, resumable
phases), :mod:`.evaluate` (engine acceptance, greedy robustness), :mod:`.card` (model card),
:mod:`.pipeline` (the command line). Entry point: ``python -m ddtree.training run ...``.
"""
