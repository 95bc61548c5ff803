"""``python -m ddtree.training``: prepare the data (once, here), or run the whole pair training (the GPU command).

    python -m ddtree.training prepare --out .carry/train-pair
    python -m ddtree.training run --data .carry/train-pair --out $OUT --seed 0

``run`` phases and default time boxes (wall clock; the whole run stops by ``--budget-s``, 540 s):

    setup (load data, build model)           ~10 s
    target training (calibrated steps)        175 s
    held-out perplexity + save target         ~5 s
    target greedy continuations (drafter data) 35 s
    drafter training (calibrated steps)       150 s
    save drafter, evaluation (CPU engine + GPU bf16 greedy), card, tar   the rest (~90 s)

Outputs under ``--out`` (at most 8 files, none over 15 MiB, as the device tool returns them):
``MODEL_CARD.md``, ``metrics.json``, ``train.log``, ``models.tar.NN`` (a tar of ``target/``
(with tokenizer), ``drafter/`` and ``README.md`` (the card), split into 15 MiB parts:
``cat models.tar.* | tar x``). Intermediate state lives in ``--work`` (default
``/tmp/ddtree-train``): ``--resume`` continues a phase from its last save and skips finished phases.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import platform
import sys
import tarfile
import time
from typing import Dict, List

import torch

from . import card, data, evaluate, model, train
from .dflash import default_gamma

PART_BYTES = 15 * 1024 * 1024


class Logger:
    """Prints with a timestamp (seconds since start) and appends to a log file."""

    def __init__(self, path: str):
        self.start = time.monotonic()
        self.handle = open(path, "a")

    def __call__(self, message: str) -> None:
        line = f"[{time.monotonic() - self.start:7.1f}s] {message}"
        print(line, flush=True)
        self.handle.write(line + "\n")
        self.handle.flush()


def tiny_shapes():
    """Shapes for CPU tests and smoke runs (seconds, not minutes)."""
    target = model.TargetShape(
        hidden_size=32,
        num_layers=4,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        linear_num_key_heads=1,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=1024,
    )
    drafter = model.DrafterShape(num_layers=1, block_size=16, target_layer_ids=[1, 2])
    return target, drafter


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m ddtree.training", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prepare", help="scan a CPython stdlib, split, train the tokenizer, write token files")
    prep.add_argument("--out", required=True)
    prep.add_argument("--stdlib", default=None, help="stdlib directory (default: first of data.STDLIB_CANDIDATES)")
    prep.add_argument("--vocab-size", type=int, default=4096)
    prep.add_argument("--heldout-fraction", type=float, default=0.03)
    prep.add_argument("--prompts", type=int, default=16)
    prep.add_argument("--prompt-length", type=int, default=96)
    prep.add_argument("--seed", type=int, default=0)

    run = sub.add_parser("run", help="train target + drafter, evaluate, write the card (the GPU command)")
    run.add_argument("--data", required=True, help="a directory written by `prepare`")
    run.add_argument("--out", required=True)
    run.add_argument("--work", default="/tmp/ddtree-train")
    run.add_argument("--seed", type=int, default=0)
    run.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    run.add_argument("--resume", action="store_true")
    run.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test)")
    run.add_argument("--budget-s", type=float, default=540.0, help="the whole run stops by then")
    run.add_argument("--target-steps", type=int, default=None, help="fixed step count (default: calibrated)")
    run.add_argument("--target-time-s", type=float, default=175.0)
    run.add_argument(
        "--target-max-epochs",
        type=float,
        default=8.0,
        help="cap on passes over the train split (a 10M model overfits 9M tokens beyond that)",
    )
    run.add_argument("--target-batch", type=int, default=64)
    run.add_argument("--target-seq", type=int, default=512)
    run.add_argument("--target-lr", type=float, default=2e-3)
    run.add_argument("--generate", type=int, default=12288, help="target continuations for drafter training")
    run.add_argument("--generate-time-s", type=float, default=35.0)
    run.add_argument("--generate-batch", type=int, default=2048)
    run.add_argument("--generate-prompt", type=int, default=96, help="train-text prompt tokens of each continuation")
    run.add_argument(
        "--generate-new",
        type=int,
        default=None,
        help="greedy tokens per continuation (default: --drafter-seq minus --generate-prompt); "
        "a small target's long greedy continuations end in loops",
    )
    run.add_argument(
        "--drafter-layers",
        type=int,
        default=None,
        help="the drafter's layers (default: DrafterShape's, 2; the released Qwen3.6-27B drafter has 5)",
    )
    run.add_argument("--drafter-steps", type=int, default=None)
    run.add_argument("--drafter-time-s", type=float, default=150.0)
    run.add_argument("--drafter-batch", type=int, default=64)
    run.add_argument("--drafter-seq", type=int, default=256)
    run.add_argument("--drafter-lr", type=float, default=1.5e-3)
    run.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    run.add_argument("--raw-fraction", type=float, default=0.5)
    run.add_argument(
        "--drafter-labels",
        choices=("text", "target"),
        default="target",
        help="drafter labels: the row's next tokens, or the target's greedy next token after the "
        "real prefix (what acceptance is measured against)",
    )
    run.add_argument(
        "--drafter-eval-every",
        type=int,
        default=500,
        help="log the held-out engine-equivalent chain tau every N drafter steps (0: only at the end)",
    )
    run.add_argument(
        "--drafter-snapshots",
        type=float,
        nargs="*",
        default=[],
        help="also save the drafter after these fractions of its steps (e.g. 0.25 0.5) as drafter-25/, "
        "drafter-50/, ...: drafters of increasing strength for benches/tree_gain.py",
    )
    run.add_argument(
        "--goal-chain-tau",
        type=float,
        default=card.CHAIN_TAU_GOAL,
        help="the held-out chain tau the card checks (the first pair's 2.5; issue 17's stronger pair: 4.5)",
    )
    run.add_argument("--eval-prompts", type=int, default=16)
    run.add_argument("--eval-tokens", type=int, default=128)
    run.add_argument("--eval-threads", type=int, default=0, help="CPU threads for the fp32 reference (0: all)")
    run.add_argument("--eval-device", default=None, help="device of the engine evaluation (default: cuda if any)")
    return parser


def save_snapshot(drafter, models_dir: str, fraction: float, log) -> str:
    """The drafter as it is now, rounded to bf16 like the final one, as ``drafter-<percent>/``; its name."""
    import copy

    name = f"drafter-{round(fraction * 100):02d}"
    snapshot = copy.deepcopy(drafter)
    model.round_to_bf16_(snapshot)
    snapshot.to(torch.bfloat16).save_pretrained(os.path.join(models_dir, name))
    log(f"[drafter] snapshot after {fraction:.0%} of the planned steps: {name}/")
    return name


def _split_tar(directory: str, names: List[str], out_dir: str) -> List[str]:
    """Tar ``names`` (relative to ``directory``) into ``out_dir/models.tar.NN`` parts of <= 15 MiB."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in names:
            tar.add(os.path.join(directory, name), arcname=name)
    payload = buffer.getvalue()
    parts = []
    for index, start in enumerate(range(0, len(payload), PART_BYTES)):
        path = os.path.join(out_dir, f"models.tar.{index:02d}")
        with open(path, "wb") as handle:
            handle.write(payload[start : start + PART_BYTES])
        parts.append(os.path.basename(path))
    return parts


def evaluate_pair(args, dataset, target_dir: str, drafter_dir: str, end: float, log) -> Dict:
    """Reference greedy outputs, engine acceptance, greedy robustness (see :mod:`.evaluate`)."""
    prompts = [p["ids"] for p in dataset.prompts[: args.eval_prompts]]
    threads = args.eval_threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    started = time.perf_counter()
    reference = evaluate.hf_greedy(target_dir, prompts, args.eval_tokens, "cpu", torch.float32, dataset.pad_id)
    log(
        f"[eval] fp32 CPU greedy reference ({threads} threads): {len(prompts)} x {args.eval_tokens} tokens in "
        f"{time.perf_counter() - started:.1f} s"
    )
    cpu_target = model.load_target(target_dir, dtype=torch.float32, device="cpu")
    margins = evaluate.greedy_margins(cpu_target, prompts, reference)
    del cpu_target
    log(
        f"[eval] greedy margins: min {margins['min']:.3f}, median {margins['median']:.3f}, "
        f"{margins['below_tenth']} of {margins['count']} below 0.1"
    )
    gpu = evaluate.gpu_bf16_agreement(target_dir, prompts, reference, args.eval_tokens, dataset.pad_id)
    log(f"[eval] bf16 GPU vs fp32 CPU greedy: {gpu}")

    eval_device = args.eval_device or ("cuda" if torch.cuda.is_available() else "cpu")
    result, used_prompts = None, prompts
    try:
        target, drafter = evaluate.load_pair(target_dir, drafter_dir, device=eval_device, dtype=torch.float32)
        log(f"[eval] ddtree.engine on {eval_device} fp32, {len(prompts)} prompts x {args.eval_tokens} tokens")
        result = evaluate.engine_acceptance(
            target, drafter, prompts, card.BUDGETS, args.eval_tokens, log, deadline=end - 20.0
        )
    except Exception as error:
        if eval_device == "cpu":
            raise
        import traceback

        log(
            f"[eval] engine on {eval_device} FAILED ({error!r}); falling back to CPU with 4 prompts\n"
            f"{traceback.format_exc()}"
        )
        eval_device, used_prompts = "cpu (fallback)", prompts[:4]
        target, drafter = evaluate.load_pair(target_dir, drafter_dir, device="cpu", dtype=torch.float32)
        result = evaluate.engine_acceptance(
            target, drafter, used_prompts, card.BUDGETS, args.eval_tokens, log, deadline=end - 20.0
        )
    engine_vs_cpu = evaluate.agreement(result["reference"], reference[: len(used_prompts)], min(128, args.eval_tokens))
    log(
        f"[eval] engine AR ({eval_device} fp32) vs fp32 CPU reference: {engine_vs_cpu['prompts_agreeing_128']} of "
        f"{engine_vs_cpu['prompts']} agree on {engine_vs_cpu['horizon']} tokens"
    )
    return {
        "prompts": len(used_prompts),
        "prompt_length": len(prompts[0]),
        "new_tokens": args.eval_tokens,
        "engine_device": eval_device,
        "modes": result["modes"],
        "skipped": result["skipped"],
        "margins": margins,
        "gpu_bf16": gpu,
        "engine_ar_vs_cpu_fp32": engine_vs_cpu,
        "reference_outputs": reference,
        "prompt_ids": prompts,
        "prompt_sources": [(p.get("path"), p["offset"]) for p in dataset.prompts[: args.eval_prompts]],
    }


def _done(path: str) -> bool:
    return os.path.isfile(path)


def run(args) -> Dict:
    start = time.monotonic()
    end = start + args.budget_s
    os.makedirs(args.out, exist_ok=True)
    os.makedirs(args.work, exist_ok=True)
    log = Logger(os.path.join(args.out, "train.log"))
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    log(f"ddtree.training run: {' '.join(sys.argv)}")
    log(
        f"python {platform.python_version()}, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "")
    )

    dataset = data.load(args.data)
    log(
        f"data {args.data}: {dataset.manifest['tokens']} tokens, vocab {dataset.vocab_size}, "
        f"{len(dataset.prompts)} prompts"
    )
    target_shape, drafter_shape = tiny_shapes() if args.tiny else (model.TargetShape(), model.DrafterShape())
    if args.drafter_layers is not None:
        if not 1 <= args.drafter_layers <= 16:
            raise SystemExit(f"--drafter-layers must be in 1..16, got {args.drafter_layers}")
        drafter_shape = dataclasses.replace(drafter_shape, num_layers=args.drafter_layers)
    text_config = model.target_text_config(target_shape, dataset.vocab_size, dataset.eos_id, dataset.pad_id)
    models_dir = os.path.join(args.work, "models")
    target_dir, drafter_dir = os.path.join(models_dir, "target"), os.path.join(models_dir, "drafter")
    import transformers

    metrics: Dict = {
        "command": "python -m ddtree.training " + " ".join(sys.argv[1:]),
        "seed": args.seed,
        "goal_chain_tau": args.goal_chain_tau,
        "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "shapes": model.shapes_dict(target_shape, drafter_shape),
        "data": {k: dataset.manifest[k] for k in ("source", "files", "tokens", "chars", "vocab_size", "sha256")},
    }
    metrics["data"]["vocab_size"] = dataset.vocab_size

    # ---------------------------------------------------------------- target
    reserve_after_target = args.generate_time_s + args.drafter_time_s + 75.0
    target_done = os.path.join(args.work, "target.done.json")
    if args.resume and _done(target_done):
        metrics["target"] = model.read_json(target_done)
        log("[target] already trained (resume): skipping")
    else:
        target = model.new_target(text_config, args.seed)
        settings = train.PhaseSettings(
            batch_size=args.target_batch,
            seq_len=args.target_seq,
            peak_lr=args.target_lr,
            warmup_steps=100 if not args.tiny else 5,
            steps=args.target_steps,
            max_steps=max(1, int(args.target_max_epochs * dataset.train.size / (args.target_batch * args.target_seq))),
            time_box_s=args.target_time_s,
            log_every=25 if not args.tiny else 5,
        )
        log(
            f"[target] Qwen3_5ForCausalLM {model.count_parameters(target):,} parameters, layers {text_config.layer_types}"
        )
        loop = train.train_target(
            target,
            dataset,
            settings,
            device,
            args.seed,
            args.work,
            log,
            deadline=min(end - reserve_after_target, time.monotonic() + args.target_time_s),
            resume=args.resume,
        )
        model.round_to_bf16_(target)  # from here on, every use of the target sees the shipped weights
        held = train.heldout_loss(target, dataset.heldout, settings.seq_len, device)
        log(
            f"[target] held-out loss {held['loss']:.4f} nats, perplexity {held['perplexity']:.2f} "
            f"({held['tokens']} tokens)"
        )
        model.save_target(target, target_dir, dataset.tokenizer_path)
        metrics["target"] = {
            "parameters": model.count_parameters(target),
            "steps": loop.step,
            "planned_steps": loop.total_steps,
            "stopped_early": loop.stopped_early,
            "batch_size": settings.batch_size,
            "seq_len": settings.seq_len,
            "peak_lr": settings.peak_lr,
            "train_seconds": round(loop.train_seconds, 1),
            "first_loss": loop.history[0]["loss"] if loop.history else None,
            "final_loss": loop.history[-1]["loss"] if loop.history else None,
            "history": loop.history,
            "heldout": held,
            "architecture": f"{target_shape.num_layers} layers ({text_config.layer_types.count('linear_attention')} "
            f"GDN + {text_config.layer_types.count('full_attention')} gated attention), hidden "
            f"{target_shape.hidden_size}, partial rotary 0.25, untied embeddings.",
        }
        with open(target_done, "w") as handle:
            json.dump(metrics["target"], handle)
        del target

    # ---------------------------------------------------------------- drafter
    target = model.load_target(target_dir, dtype=torch.float32, device=device)
    drafter_done = os.path.join(args.work, "drafter.done.json")
    if args.resume and _done(drafter_done):
        metrics["drafter"] = model.read_json(drafter_done)
        log("[drafter] already trained (resume): skipping")
    else:
        gen_path = os.path.join(args.work, "generated.pt")
        if args.resume and os.path.isfile(gen_path):
            generated = torch.load(gen_path)
        elif args.generate > 0:
            generated = train.generate_sequences(
                target,
                dataset,
                args.generate,
                args.generate_prompt,
                args.generate_new or args.drafter_seq - args.generate_prompt,
                args.generate_batch,
                device,
                args.seed,
                log,
                deadline=min(time.monotonic() + args.generate_time_s, end - args.drafter_time_s - 75.0),
            )
            torch.save(generated, gen_path)
        else:
            generated = None
        drafter = model.new_drafter(text_config, drafter_shape, dataset.mask_id, args.seed)
        gamma = default_gamma(drafter_shape.block_size)
        settings = train.PhaseSettings(
            batch_size=args.drafter_batch,
            seq_len=args.drafter_seq,
            peak_lr=args.drafter_lr,
            warmup_steps=50 if not args.tiny else 5,
            steps=args.drafter_steps,
            time_box_s=args.drafter_time_s,
            weight_decay=0.01,
            log_every=25 if not args.tiny else 5,
        )
        log(
            f"[drafter] DFlash {model.count_parameters(drafter):,} parameters, block {drafter.block_size}, "
            f"target layers {drafter.target_layer_ids}, gamma {gamma}"
        )
        snapshots: List[str] = []
        heldout_prompts = [p["ids"] for p in dataset.prompts[: args.eval_prompts]]
        heldout = (
            heldout_prompts,
            train.greedy_continuations(target, heldout_prompts, args.eval_tokens, dataset.pad_id, device),
        )
        loop = train.train_drafter(
            drafter,
            target,
            dataset,
            generated,
            settings,
            args.anchors,
            gamma,
            args.raw_fraction,
            device,
            args.seed,
            args.work,
            log,
            deadline=min(end - 75.0, time.monotonic() + args.drafter_time_s),
            resume=args.resume,
            heldout=heldout,
            eval_every=args.drafter_eval_every,
            labels=args.drafter_labels,
            snapshots=args.drafter_snapshots,
            on_snapshot=lambda fraction: snapshots.append(save_snapshot(drafter, models_dir, fraction, log)),
        )
        model.round_to_bf16_(drafter)
        drafter.to(torch.bfloat16).save_pretrained(drafter_dir)
        metrics["drafter"] = {
            "parameters": model.count_parameters(drafter),
            "steps": loop.step,
            "planned_steps": loop.total_steps,
            "stopped_early": loop.stopped_early,
            "batch_size": settings.batch_size,
            "seq_len": settings.seq_len if generated is None else min(settings.seq_len, int(generated.shape[1])),
            "peak_lr": settings.peak_lr,
            "train_seconds": round(loop.train_seconds, 1),
            "layers": drafter_shape.num_layers,
            "block_size": drafter_shape.block_size,
            "target_layer_ids": drafter_shape.target_layer_ids,
            "anchors": args.anchors,
            "gamma": gamma,
            "raw_fraction": args.raw_fraction,
            "generated": 0 if generated is None else int(generated.shape[0]),
            "generated_shape": None if generated is None else list(generated.shape),
            "labels": args.drafter_labels,
            "snapshots": snapshots,
            "first_loss": loop.history[0]["loss"] if loop.history else None,
            "final_loss": loop.history[-1]["loss"] if loop.history else None,
            "final_tf_tau": loop.history[-1].get("tf_tau") if loop.history else None,
            "heldout_chain_tau": loop.heldout["tau"] if loop.heldout else None,
            "heldout_chain_steps": loop.heldout["steps"] if loop.heldout else None,
            "history": loop.history,
        }
        with open(drafter_done, "w") as handle:
            json.dump(metrics["drafter"], handle)
        del drafter
    del target
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # ---------------------------------------------------------------- evaluation
    try:
        metrics["eval"] = evaluate_pair(args, dataset, target_dir, drafter_dir, end, log)
    except Exception as error:  # the checkpoints and the card must come back even if evaluation breaks
        import traceback

        log(f"[eval] FAILED: {error!r}\n{traceback.format_exc()}")
        metrics.setdefault("eval", {})["error"] = repr(error)

    # ---------------------------------------------------------------- card + outputs
    metrics["files"] = {
        sub: {
            name: os.path.getsize(os.path.join(models_dir, sub, name))
            for name in sorted(os.listdir(os.path.join(models_dir, sub)))
        }
        for sub in ("target", "drafter")
    }
    metrics["wall_seconds"] = round(time.monotonic() - start, 1)
    text = card.render(metrics)
    for path in (os.path.join(args.out, "MODEL_CARD.md"), os.path.join(models_dir, "README.md")):
        with open(path, "w") as handle:
            handle.write(text)
    with open(os.path.join(args.out, "metrics.json"), "w") as handle:
        json.dump(metrics, handle, indent=1)
    saved = (metrics.get("drafter") or {}).get("snapshots") or []
    parts = _split_tar(models_dir, ["README.md", "target", "drafter", *saved], args.out)
    missing = card.missing_fields(metrics)
    log(
        f"done in {metrics['wall_seconds']} s; wrote {parts}; chain tau "
        f"{card.lookup(metrics, 'eval.modes.chain.tau')}; missing card fields: {missing or 'none'}"
    )
    return metrics


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "prepare":
        manifest = data.prepare(
            args.out,
            stdlib=args.stdlib,
            vocab_size=args.vocab_size,
            heldout_fraction=args.heldout_fraction,
            num_prompts=args.prompts,
            prompt_length=args.prompt_length,
            seed=args.seed,
        )
        print(json.dumps({k: v for k, v in manifest.items() if k != "sha256"}, indent=1))
        return 0
    run(args)
    return 0
