"""``ddtree generate``: load a target and a DFlash drafter, generate, print text and statistics.

The arguments are declared in ``ddtree.cli`` (which must not import torch for
``ddtree demo``); this module runs the command.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional

import torch

from .constraints import GrammarConstraint
from .drafter import CONFIG_NAME, DFlashDraftModel
from .engine import GenerationConfig, SpeculativeEngine
from .sampling import SamplingSettings
from .validation import EngineInputError, check_prompts, check_settings

DTYPES = {"auto": "auto", "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _fail(message: str) -> int:
    print(f"ddtree generate: {message}", file=sys.stderr)
    return 2


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _load_tokenizer(directory: str, required: bool):
    """The target's tokenizer, or None when it has none and none is needed."""
    # transformers may hand back a default tokenizer for a directory without
    # tokenizer files; that would silently mis-tokenise, so look first.
    has_files = any(os.path.isfile(os.path.join(directory, name)) for name in TOKENIZER_FILES)
    error = None
    if has_files:
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(directory)
        except Exception as caught:  # an unreadable tokenizer
            error = caught
    if required:
        reason = f"cannot load its tokenizer ({error})" if error else "has no tokenizer files"
        raise EngineInputError(f"{directory} {reason}; pass --prompt-ids instead")
    return None


def _prompt_ids(args, tokenizer) -> List[List[int]]:
    texts = list(args.prompt)
    for path in args.prompt_file:
        with open(path, encoding="utf-8") as handle:
            texts.append(handle.read())
    prompts = [tokenizer.encode(text) for text in texts] if texts else []
    for spec in args.prompt_ids:
        try:
            prompts.append([int(t) for t in spec.replace(" ", "").split(",") if t])
        except ValueError as error:
            raise EngineInputError(f"--prompt-ids must be comma-separated integers, got {spec!r}") from error
    return prompts


def _compiled_grammar(args, tokenizer, vocab_size: int):
    """``--regex`` or ``--json-schema`` compiled by xgrammar over the target's tokenizer."""
    try:
        import xgrammar
    except ImportError as error:
        raise EngineInputError("--regex and --json-schema need xgrammar (pip install xgrammar)") from error
    info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgrammar.GrammarCompiler(info)
    option, text = ("--regex", args.regex) if args.regex else ("--json-schema", args.json_schema)
    try:
        if args.regex:
            return compiler.compile_regex(text)
        return compiler.compile_json_schema(text, any_whitespace=False)
    except Exception as error:  # xgrammar reports a bad pattern or schema as a RuntimeError of its own
        raise EngineInputError(f"{option}: xgrammar cannot compile {text!r}: {str(error).splitlines()[-1]}") from error


def _check_drafter_config(directory: str) -> None:
    """Cheap checks on the drafter directory before loading any weights."""
    if not os.path.isfile(os.path.join(directory, CONFIG_NAME)):
        raise EngineInputError(f"--drafter {directory}: no {CONFIG_NAME} there")


def run(args: argparse.Namespace) -> int:
    try:
        check_settings(args.mode, args.budget, args.max_new_tokens, has_drafter=bool(args.drafter) or args.mode == "ar")
        sampling = SamplingSettings(args.temperature, args.top_p, args.top_k)
        sampling.validate()
        if not (args.prompt or args.prompt_file or args.prompt_ids):
            raise EngineInputError("give at least one --prompt, --prompt-file or --prompt-ids")
        if args.drafter and args.mode != "ar":
            _check_drafter_config(args.drafter)
        if args.device == "cuda" and not torch.cuda.is_available():
            raise EngineInputError("--device cuda but torch sees no CUDA device")
        structured = bool(getattr(args, "regex", None) or getattr(args, "json_schema", None))
        tokenizer = _load_tokenizer(args.target, required=bool(args.prompt or args.prompt_file) or structured)
        prompts = _prompt_ids(args, tokenizer)

        from ddtree.engine.target import load_causal_lm

        target = load_causal_lm(args.target, DTYPES[args.dtype]).to(args.device)
        drafter: Optional[DFlashDraftModel] = None
        if args.mode != "ar":
            drafter = DFlashDraftModel.from_pretrained(args.drafter, dtype=target.dtype, device=args.device)
        engine = SpeculativeEngine(target, drafter)  # checks drafter vs target
        check_prompts(prompts, engine.target)
        grammar = _compiled_grammar(args, tokenizer, engine.target.vocab_size) if structured else None
    except (EngineInputError, ValueError, FileNotFoundError) as error:
        return _fail(str(error))

    stop = ()
    if tokenizer is not None and tokenizer.eos_token_id is not None and not args.ignore_eos:
        stop = (tokenizer.eos_token_id,)
    config = GenerationConfig(
        mode=args.mode,
        budget=args.budget,
        max_new_tokens=args.max_new_tokens,
        sampling=sampling,
        seed=args.seed,
        stop_token_ids=stop,
        progress=not args.no_progress,
        constraints=[GrammarConstraint(grammar) for _ in prompts] if grammar is not None else None,
    )
    results = engine.generate(prompts, config)
    for index, result in enumerate(results):
        text = tokenizer.decode(result.output_ids) if tokenizer is not None else " ".join(map(str, result.output_ids))
        print(f"=== request {index} ({result.finish_reason}) ===")
        print(text)
        print(f"--- {args.mode}: {result.stats.summary()}")
    return 0
