"""The training loop: batches of captured rows, AdamW, resumable checkpoints, held-out accuracy.

Knows: batching by a token budget, the learning-rate schedule, mixed precision (bf16 autocast
where the CPU computes bf16 natively, and on CUDA), the checkpoint file and its atomic
replacement (an interrupted run keeps the last whole checkpoint and resumes from it). Must
not know: prompts, the target's files, the exported format.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from backends.torch.head_weights.eagle import Eagle3Head
from backends.torch.train_head.data import Example
from backends.torch.train_head.ttt import Batch, ttt_step
from backends.train_progress import ProgressFn, TrainProgress

CHECKPOINT = "checkpoint.pt"


@dataclass(frozen=True)
class LoopSettings:
    epochs: int = 3
    # 1e-3 diverged on Qwen2.5-Coder-1.5B (the running loss fell to 14.0 in warm-up, then rose
    # to 15.6); 3e-4 with 1024-row batches descended steadily (15.2 to 7.9 in 36 steps)
    lr: float = 3e-4
    warmup: int = 10            # optimizer steps
    batch_tokens: int = 1024    # rows per batch (padded): more steps from little data
    depth: int = 7              # TTT steps (the EAGLE-3 authors train 7)
    clip: float = 0.5
    save_every: int = 20        # optimizer steps between checkpoints
    seed: int = 0


@dataclass(frozen=True)
class Frozen:
    """The target's tensors the head reads but never changes."""

    embed: torch.nn.Embedding
    lm_rows: torch.Tensor       # target output rows of the draft vocabulary [Vd, H]


def batches(examples: Sequence[Example], budget: int, seed: int, epoch: int) -> list[list[int]]:
    """Indices grouped by similar length into at most `budget` padded rows, shuffled per
    epoch (the same order again on resume)."""
    order = sorted(range(len(examples)), key=lambda i: len(examples[i].tokens))
    groups: list[list[int]] = []
    for i in order:
        length = len(examples[i].tokens)
        if groups and length * (len(groups[-1]) + 1) <= budget:
            groups[-1].append(i)
        else:
            groups.append([i])
    random.Random(seed * 1000 + epoch).shuffle(groups)
    return groups


def make_batch(examples: Sequence[Example], idx: Sequence[int], t2d: torch.Tensor,
               frozen: Frozen, device: str) -> Batch:
    rows = max(len(examples[i].tokens) for i in idx)
    width_aux = examples[idx[0]].aux.shape[-1]
    tokens = torch.zeros(len(idx), rows, dtype=torch.long)
    aux = torch.zeros(len(idx), rows, width_aux, dtype=examples[idx[0]].aux.dtype)
    final = torch.zeros(len(idx), rows, examples[idx[0]].final.shape[-1], dtype=aux.dtype)
    counts = torch.zeros(len(idx), rows, dtype=torch.bool)
    for b, i in enumerate(idx):
        e = examples[i]
        n = len(e.tokens)
        tokens[b, :n], aux[b, :n], final[b, :n] = e.tokens, e.aux, e.final
        counts[b, e.prompt_len:n] = t2d[e.tokens[e.prompt_len:]]
    # the target's distribution at position p is read only where token p+1 counts
    need = torch.zeros_like(counts)
    need[:, :-1] = counts[:, 1:]
    with torch.no_grad():
        lm = frozen.lm_rows
        target = torch.zeros(len(idx), rows, lm.shape[0], dtype=lm.dtype, device=device)
        target[need.to(device)] = final[need].to(device, lm.dtype) @ lm.T
    return Batch(tokens.to(device), aux.to(device), target, counts.to(device))


def autocast(device: str, bf16: bool) -> torch.autocast:
    kind = "cuda" if device.startswith("cuda") else "cpu"
    return torch.autocast(kind, dtype=torch.bfloat16, enabled=bf16)


def lr_at(step: int, total: int, s: LoopSettings) -> float:
    """Linear warmup (at most a tenth of the run), then cosine decay to a tenth."""
    warmup = max(1, min(s.warmup, total // 10))
    if step < warmup:
        return s.lr * (step + 1) / warmup
    done = (step - warmup) / max(total - warmup, 1)
    return s.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def train(head: Eagle3Head, frozen: Frozen, examples: Sequence[Example],
          s: LoopSettings, work: Path, device: str, bf16: bool,
          on_progress: ProgressFn) -> dict[str, object]:
    """Train (or resume) to the end of s.epochs; returns the last checkpoint's summary."""
    optim = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=s.lr,
                              betas=(0.9, 0.95), weight_decay=0.0)
    state = load_checkpoint(work, head, optim, s)
    if state.get("stale"):
        on_progress(TrainProgress("note", 0, 0, message=(
            f"the checkpoint in {work} is for another head (its draft vocabulary or size "
            "differs): training starts over; the answers are kept")))
    per_epoch = len(batches(examples, s.batch_tokens, s.seed, 0))
    total = per_epoch * s.epochs
    running = _Running(s.depth)
    step, started, tokens = state["step"], time.monotonic(), 0
    try:
        while step < total:
            epoch, index = divmod(step, per_epoch)
            idx = batches(examples, s.batch_tokens, s.seed, epoch)[index]
            batch = make_batch(examples, idx, head.t2d.cpu(), frozen, device)
            for group in optim.param_groups:
                group["lr"] = lr_at(step, total, s)
            with autocast(device, bf16):
                result = ttt_step(head, frozen.embed, batch, s.depth)
            optim.zero_grad(set_to_none=True)
            result.loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), s.clip)
            optim.step()
            step += 1
            running.add(result.correct, result.rows, result.losses[0])
            tokens += int(sum(len(examples[i].tokens) for i in idx))
            rate = tokens / max(time.monotonic() - started, 1e-9)
            on_progress(TrainProgress("train", step, total, rate, running.loss,
                                      running.accuracy(), epoch + 1))
            if step % s.save_every == 0 or step == total:
                save_checkpoint(work, head, optim, s, step)
    except KeyboardInterrupt:
        save_checkpoint(work, head, optim, s, step)
        on_progress(TrainProgress("saved", step, total, message=(
            f"interrupted: checkpoint at step {step}/{total} kept in {work}; "
            "run the same command again to resume")))
        raise
    return {"steps": step, "epochs": s.epochs, "train_accuracy": running.accuracy()}


class _Running:
    """Top-1 accuracy per depth and depth-1 loss, as moving averages over recent batches."""

    def __init__(self, depth: int, keep: float = 0.9) -> None:
        self.correct = [0.0] * depth
        self.rows = [0.0] * depth
        self.loss = 0.0
        self.keep = keep

    def add(self, correct: Sequence[int], rows: Sequence[int], loss: float) -> None:
        for j, (c, n) in enumerate(zip(correct, rows)):
            self.correct[j] = self.keep * self.correct[j] + c
            self.rows[j] = self.keep * self.rows[j] + n
        self.loss = loss if self.loss == 0.0 else self.keep * self.loss + (1 - self.keep) * loss

    def accuracy(self) -> tuple[float, ...]:
        return tuple(c / n if n else 0.0 for c, n in zip(self.correct, self.rows))


@dataclass(frozen=True)
class Accuracy:
    """Held-out top-1 per TTT depth: teacher-forced (each depth fed the data's tokens) and as
    a chain (every depth up to this one right: the share of steps a greedy chain of that length
    is accepted, so tau = 1 + sum(chained) tokens per step)."""

    per_depth: tuple[float, ...]
    chained: tuple[float, ...]

    @property
    def tau(self) -> float:
        return 1.0 + sum(self.chained)


@torch.no_grad()
def evaluate(head: Eagle3Head, frozen: Frozen, examples: Sequence[Example], depth: int,
             budget: int, device: str, bf16: bool) -> Accuracy:
    """Top-1 accuracy per TTT depth over these examples (the data's own tokens fed back), over
    every answer token: one outside the draft vocabulary is a miss, as it is when drafting."""
    correct, chained = [0] * depth, [0] * depth
    for idx in batches(examples, budget, 0, 0):
        batch = make_batch(examples, idx, head.t2d.cpu(), frozen, device)
        with autocast(device, bf16):
            result = ttt_step(head, frozen.embed, batch, depth)
        for j in range(depth):
            correct[j] += result.correct[j]
            chained[j] += result.chained[j]
    rows = answer_rows(examples, depth)
    roots = max(rows[0], 1)  # a chain's share is over every row it could start from
    return Accuracy(tuple(c / n if n else 0.0 for c, n in zip(correct, rows)),
                    tuple(c / roots for c in chained))


def answer_rows(examples: Sequence[Example], depth: int) -> list[int]:
    """Per TTT depth j, the rows whose scored token (t+2+j) is an answer token."""
    return [sum(max(0, len(e.tokens) - max(e.prompt_len, 2 + j)) for e in examples)
            for j in range(depth)]


# ---- checkpoints -----------------------------------------------------------------------


def save_checkpoint(work: Path, head: Eagle3Head, optim: torch.optim.Optimizer,
                    s: LoopSettings, step: int) -> None:
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / (CHECKPOINT + ".tmp")
    torch.save({"head": head.state_dict(), "optim": optim.state_dict(), "step": step,
                "settings": asdict(s)}, tmp)
    tmp.replace(work / CHECKPOINT)  # the previous checkpoint stays whole until this one is


def load_checkpoint(work: Path, head: Eagle3Head, optim: torch.optim.Optimizer,
                    s: LoopSettings) -> dict[str, int]:
    """The resumed step (0 without a checkpoint, or with one for another head: `stale` 1);
    head and optimizer restored in place."""
    path = work / CHECKPOINT
    if not path.is_file():
        return {"step": 0}
    data = torch.load(path, map_location="cpu", weights_only=True)
    if not _same_head(data["head"], head.state_dict()):
        return {"step": 0, "stale": 1}
    head.load_state_dict(data["head"])
    optim.load_state_dict(data["optim"])
    return {"step": int(data["step"])}


def _same_head(saved: dict[str, torch.Tensor], fresh: dict[str, torch.Tensor]) -> bool:
    """Same tensors, shapes and draft vocabulary (another --draft-vocab or other data changes
    the vocabulary; its rows would not mean the same tokens)."""
    if saved.keys() != fresh.keys():
        return False
    if any(saved[k].shape != fresh[k].shape for k in fresh):
        return False
    return torch.equal(saved["d2t"].cpu(), fresh["d2t"].cpu())


def has_checkpoint(work: Path) -> bool:
    return (work / CHECKPOINT).is_file()
