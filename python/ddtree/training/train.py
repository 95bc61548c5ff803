"""The two training phases (target LM, then DFlash drafter on the frozen target), time-boxed and resumable.

Each phase runs a fixed number of optimizer steps: given (``--target-steps``) or, by default,
calibrated once from the wall time of its first steps so that the phase fits its time box. The
chosen count is logged and written to the model card, so a run is reproducible from the seed and
the step counts (up to GPU floating-point non-determinism). A wall-clock deadline stops a phase
early (and says so) if the calibration was off. State is checkpointed to the work directory every
``save_every_s`` seconds; ``--resume`` continues from there.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from . import dflash
from .data import Dataset, sample_windows


@dataclass
class PhaseSettings:
    """One phase's optimisation settings."""

    batch_size: int
    seq_len: int
    peak_lr: float
    warmup_steps: int
    weight_decay: float = 0.1
    max_steps: int = 100_000
    steps: Optional[int] = None  # fixed step count; None: calibrate from the time box
    time_box_s: float = 240.0
    calibration_steps: int = 20
    log_every: int = 25
    save_every_s: float = 60.0


def autocast(device: torch.device):
    """bf16 autocast on CUDA (the GPU run); nothing on CPU (tests, fp32)."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def make_optimizer(params, settings: PhaseSettings, device: torch.device):
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=settings.peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


class StepLoop:
    """Shared loop: fixed/calibrated step count, LR schedule, deadline, periodic state saves, logging."""

    def __init__(
        self,
        name: str,
        settings: PhaseSettings,
        model,
        optimizer,
        generator: torch.Generator,
        state_path: str,
        log: Callable[[str], None],
        deadline: float,
    ):
        self.name, self.settings, self.model, self.optimizer = name, settings, model, optimizer
        self.generator, self.state_path, self.log = generator, state_path, log
        self.deadline = deadline  # time.monotonic() value
        self.step = 0
        self.total_steps = settings.steps
        self.history: List[Dict] = []
        self.stopped_early = False
        self.train_seconds = 0.0

    def resume(self) -> bool:
        if not os.path.isfile(self.state_path):
            return False
        state = torch.load(self.state_path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])
        self.step, self.total_steps = state["step"], state["total_steps"]
        self.history, self.train_seconds = state["history"], state["train_seconds"]
        self.log(f"[{self.name}] resumed at step {self.step}/{self.total_steps}")
        return True

    def save(self) -> None:
        tmp = self.state_path + ".tmp"
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "generator": self.generator.get_state(),
                "step": self.step,
                "total_steps": self.total_steps,
                "history": self.history,
                "train_seconds": self.train_seconds,
            },
            tmp,
        )
        os.replace(tmp, self.state_path)

    def run(self, step_fn: Callable[[], Dict]) -> None:
        """``step_fn()`` does forward + backward on one batch and returns ``{"loss": float, ...}``."""
        s = self.settings
        started = time.monotonic()
        budget_end = min(self.deadline, started + s.time_box_s - self.train_seconds)
        last_save = started
        calib_start = None
        window_loss, window_n, window_t = 0.0, 0, time.monotonic()
        device_sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
        while self.total_steps is None or self.step < self.total_steps:
            if time.monotonic() >= budget_end:
                self.stopped_early = True
                self.log(f"[{self.name}] time box reached at step {self.step}/{self.total_steps}: stopping early")
                break
            lr = dflash.cosine_lr(self.step, self.total_steps or s.max_steps, s.peak_lr, s.warmup_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.zero_grad(set_to_none=True)
            metrics = step_fn()
            grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            self.step += 1
            window_loss += metrics["loss"]
            window_n += 1
            if self.total_steps is None:
                # calibration: time steps 5..calibration_steps (the first ones include warm-up work)
                if self.step == 5:
                    device_sync()
                    calib_start = time.monotonic()
                elif self.step == s.calibration_steps:
                    device_sync()
                    per_step = (time.monotonic() - calib_start) / (s.calibration_steps - 5)
                    left = budget_end - time.monotonic()
                    self.total_steps = int(min(s.max_steps, self.step + max(0, left * 0.97) / per_step))
                    self.log(
                        f"[{self.name}] calibrated: {per_step * 1000:.1f} ms/step -> {self.total_steps} steps "
                        f"(pass --{self.name}-steps {self.total_steps} to reproduce)"
                    )
            if self.step % s.log_every == 0 or self.step == self.total_steps:
                now = time.monotonic()
                entry = {
                    "step": self.step,
                    "loss": window_loss / window_n,
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "elapsed_s": round(self.train_seconds + now - started, 1),
                }
                entry.update({k: v for k, v in metrics.items() if k != "loss" and isinstance(v, float)})
                self.history.append(entry)
                extra = " ".join(
                    f"{k} {v:.3f}" for k, v in entry.items() if k not in ("step", "loss", "lr", "elapsed_s")
                )
                self.log(
                    f"[{self.name}] step {self.step}/{self.total_steps} loss {entry['loss']:.4f} lr {lr:.2e} "
                    f"{extra} ({(now - window_t) / window_n * 1000:.0f} ms/step, {entry['elapsed_s']:.0f} s)"
                )
                window_loss, window_n, window_t = 0.0, 0, now
            if time.monotonic() - last_save >= s.save_every_s:
                self.train_seconds += time.monotonic() - started
                started = last_save = time.monotonic()
                self.save()
        self.train_seconds += time.monotonic() - started
        if self.total_steps is None:
            self.total_steps = self.step
        self.save()


# --------------------------------------------------------------------------- target


def _start_loop(
    name: str,
    model,
    settings: PhaseSettings,
    device: torch.device,
    seed: int,
    work_dir: str,
    log,
    deadline: float,
    resume: bool,
) -> StepLoop:
    """Puts ``model`` in training mode with a fresh optimizer and seeded generator (or the saved state)."""
    model.to(device).train()
    generator = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(list(model.parameters()), settings, device)
    loop = StepLoop(
        name, settings, model, optimizer, generator, os.path.join(work_dir, f"{name}_state.pt"), log, deadline
    )
    if resume:
        loop.resume()
    return loop


def train_target(
    model,
    dataset: Dataset,
    settings: PhaseSettings,
    device: torch.device,
    seed: int,
    work_dir: str,
    log,
    deadline: float,
    resume: bool = False,
) -> StepLoop:
    """Next-token training of the target on random windows of the train stream."""
    loop = _start_loop("target", model, settings, device, seed + 1, work_dir, log, deadline, resume)
    generator = loop.generator

    def step() -> Dict:
        batch = sample_windows(dataset.train, settings.batch_size, settings.seq_len + 1, generator).to(device)
        with autocast(device):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        return {"loss": float(loss.detach())}

    loop.run(step)
    model.eval()
    return loop


@torch.no_grad()
def heldout_loss(
    model, stream: np.ndarray, seq_len: int, device: torch.device, max_tokens: int = 400_000, batch_size: int = 16
) -> Dict:
    """Mean next-token CE (nats) and perplexity of ``model`` in fp32 over non-overlapping windows."""
    model.eval()
    n_windows = min((stream.size - 1) // seq_len, max(1, max_tokens // seq_len))
    total, count = 0.0, 0
    for first in range(0, n_windows, batch_size):
        rows = [
            stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(first, min(n_windows, first + batch_size))
        ]
        batch = torch.from_numpy(np.stack(rows).astype(np.int64)).to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        total += float(F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum"))
        count += batch[:, 1:].numel()
    mean = total / max(1, count)
    return {"loss": mean, "perplexity": math.exp(mean), "tokens": count}


# --------------------------------------------------------------------------- distillation data


@torch.no_grad()
def generate_sequences(
    model,
    dataset: Dataset,
    count: int,
    prompt_len: int,
    new_tokens: int,
    batch_size: int,
    device: torch.device,
    seed: int,
    log,
    deadline: float,
) -> torch.Tensor:
    """``[n, prompt_len + new_tokens]``: train-split prompts followed by the target's greedy continuation.

    The drafter learns to predict the target's own greedy output, which is what it is asked to do
    at evaluation (DFlash trains on target-generated responses for the same reason). Stops at
    ``deadline`` with what it has (at least one batch).
    """
    generator = torch.Generator().manual_seed(seed + 3)
    model.eval()
    model.generation_config.eos_token_id = None  # plain greedy continuation: no stop, no EOS suppression
    rows = []
    done = 0
    while done < count:
        n = min(batch_size, count - done)
        prompts = sample_windows(dataset.train, n, prompt_len, generator).to(device)
        with autocast(device):
            out = model.generate(
                input_ids=prompts,
                attention_mask=torch.ones_like(prompts),
                max_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=dataset.pad_id,
            )
        rows.append(out[:, : prompt_len + new_tokens].cpu())
        done += n
        log(f"[generate] {done}/{count} sequences of {prompt_len}+{new_tokens} tokens")
        if time.monotonic() >= deadline:
            log("[generate] time box reached")
            break
    return torch.cat(rows)


# --------------------------------------------------------------------------- drafter


@torch.no_grad()
def greedy_continuations(model, prompts, new_tokens: int, pad_id: int, device: torch.device) -> List[List[int]]:
    """The target's greedy continuations of ``prompts`` (equal lengths; no stop; in fp32: what the
    engine's ``ar`` mode outputs, so :func:`dflash.teacher_forced_chain` on them is the engine's chain tau)."""
    model.eval()
    model.generation_config.eos_token_id = None
    ids = torch.tensor([list(p) for p in prompts], device=device)
    out = model.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
    )
    return [row[ids.shape[1] :].tolist() for row in out.cpu()]


def heldout_chain_tau(drafter, target, heldout) -> Dict:
    """Engine-equivalent greedy chain tau of ``drafter`` on ``heldout = (prompts, continuations)`` (fp32)."""
    was_training = drafter.training
    drafter.eval()
    try:
        return dflash.teacher_forced_chain(drafter, target, heldout[0], heldout[1])
    finally:
        drafter.train(was_training)


def train_drafter(
    drafter,
    target,
    dataset: Dataset,
    generated: Optional[torch.Tensor],
    settings: PhaseSettings,
    num_anchors: int,
    gamma: float,
    raw_fraction: float,
    device: torch.device,
    seed: int,
    work_dir: str,
    log,
    deadline: float,
    resume: bool = False,
    heldout=None,
    eval_every: int = 500,
    labels: str = "text",
    snapshots: Sequence[float] = (),
    on_snapshot: Optional[Callable[[float], None]] = None,
) -> StepLoop:
    """DFlash training (module :mod:`.dflash`) with the target frozen.

    ``snapshots``: fractions of the planned steps (e.g. 0.25, 0.5) at which ``on_snapshot(fraction)`` is
    called with the drafter's weights as they are after that many steps (drafters of increasing strength
    from one run, for measuring how the tree's gain depends on the chain's).

    Each batch: ``raw_fraction`` of the rows are raw train-split windows, the rest are drawn from
    ``generated`` (target continuations); rows are cut to ``settings.seq_len`` (or to the length of
    the generated rows, if shorter). ``labels``: ``"text"`` (the next tokens of the row) or
    ``"target"`` (the target's greedy next token after the real prefix,
    :func:`dflash.target_greedy_labels`: the same inside greedy continuations, and on raw text what
    acceptance is measured against).

    The logged ``tf_tau`` is the teacher-forced chain length averaged over the random anchors of the
    current *training* batch: it weighs easy stretches (the loops of greedy continuations) as much
    as hard ones and says nothing about held-out text. ``heldout = (prompts, continuations)`` (held-out
    prompts and the target's greedy continuations) adds ``heldout_tau``, the engine's chain tau on
    them (:func:`dflash.teacher_forced_chain`), every ``eval_every`` steps and at the end
    (``loop.heldout``).
    """
    target.to(device).eval()
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    loop = _start_loop("drafter", drafter, settings, device, seed + 2, work_dir, log, deadline, resume)
    generator = loop.generator
    features_hook = dflash.TargetFeatures(target, drafter.target_layer_ids)
    weights = dflash.position_weights(drafter.block_size, gamma).to(device)
    if labels not in ("text", "target"):
        raise ValueError(f"labels must be 'text' or 'target', got {labels!r}")
    n_raw = settings.batch_size if generated is None else int(round(settings.batch_size * raw_fraction))
    seq_len = settings.seq_len if generated is None else min(settings.seq_len, int(generated.shape[1]))

    def batch_tokens() -> torch.Tensor:
        parts = []
        if n_raw:
            parts.append(sample_windows(dataset.train, n_raw, seq_len, generator))
        if settings.batch_size - n_raw:
            pick = torch.randint(0, generated.shape[0], (settings.batch_size - n_raw,), generator=generator)
            parts.append(generated[pick, :seq_len])
        return torch.cat(parts).to(device)

    pending = sorted(f for f in snapshots if 0.0 < f < 1.0)

    def step() -> Dict:
        # Snapshots once the step count is planned (after calibration), before this step's update.
        while pending and loop.total_steps and loop.step >= round(pending[0] * loop.total_steps):
            on_snapshot(pending.pop(0))
        tokens = batch_tokens()
        anchors = dflash.sample_anchors(
            tokens.shape[0], tokens.shape[1], num_anchors, drafter.block_size, generator
        ).to(device)
        with torch.no_grad(), autocast(device):
            target_out = target(input_ids=tokens)
            label_tokens = dflash.target_greedy_labels(tokens, target_out.logits) if labels == "target" else None
        del target_out
        features = features_hook.take()
        with autocast(device):
            logits, block_labels = dflash.dflash_step_logits(drafter, target, tokens, features, anchors, label_tokens)
        loss, info = dflash.dflash_loss(logits, block_labels, weights)
        loss.backward()
        acc = info["accuracy"].tolist()
        metrics = {
            "loss": float(loss.detach()),
            "acc1": acc[0],
            "acc8": acc[min(7, len(acc) - 1)],
            "tf_tau": info["chain_tau"],
        }
        # loop.step is the count before this step; skip the calibration window (it times the steps)
        if (
            heldout is not None
            and eval_every
            and loop.step > settings.calibration_steps
            and (loop.step + 1) % eval_every == 0
        ):
            metrics["heldout_tau"] = heldout_chain_tau(drafter, target, heldout)["tau"]
            features_hook.captured.clear()  # the evaluation's forward also ran the training hooks
        return metrics

    try:
        loop.run(step)
    finally:
        features_hook.remove()
    drafter.eval()
    loop.heldout = None
    if heldout is not None:
        loop.heldout = heldout_chain_tau(drafter, target, heldout)
        log(
            f"[drafter] held-out chain tau (engine-equivalent, teacher-forced on the target's greedy output of "
            f"{len(heldout[0])} held-out prompts): {loop.heldout['tau']:.3f} over {loop.heldout['steps']} steps"
        )
    return loop
