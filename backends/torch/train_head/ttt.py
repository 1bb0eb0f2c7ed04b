"""The EAGLE-3 training objective with training-time test (TTT), over a batch of captured rows.

Knows: how one EAGLE-3 decoder step reads (embedding of the next token, fused hidden state),
how TTT feeds the head its own output for `depth` steps, and the loss the EAGLE-3 authors
train with (SafeAILab/EAGLE `eagle/traineagle3/cnets.py Model.forward`, read at cb7e0841):
step j's row t attends to step 0's keys at positions <= t plus its own keys of steps 1..j at
position t; its target is the target model's distribution restricted to the draft vocabulary;
a row counts only where the target's next token is in the draft vocabulary; step losses are
weighted 0.8**j. Must not know: where rows come from, optimizers, files.

Alignment (HEADS.md 1.2): row t pairs the fused hidden state of position t with the embedding
of token t+1 and predicts token t+2; TTT step j feeds token t+1+j (the data's own token) and
the head's pre-norm output of step j-1, at position t+j, and predicts token t+2+j.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STEP_WEIGHT = 0.8  # ref main.py: ploss_weight = [0.8 ** i ...]


@dataclass(frozen=True)
class Batch:
    """Right-padded rows: tokens [B, T], aux [B, T, 3Ht] (the three captured states), target
    logits over the draft vocabulary [B, T, Vd] (from the target's final state at each
    position p where token p+1 counts; other rows are never read), and `counts` [B, T]: token
    t is a generated token inside the draft vocabulary."""

    tokens: torch.Tensor
    aux: torch.Tensor
    target_logits: torch.Tensor
    counts: torch.Tensor


@dataclass(frozen=True)
class StepResult:
    loss: torch.Tensor            # weighted sum over depths (what is minimized)
    losses: tuple[float, ...]     # per depth
    correct: tuple[int, ...]      # per depth: rows whose top-1 equals the target's
    rows: tuple[int, ...]         # per depth: rows that counted
    # per depth: rows right at this depth and every earlier one, what a greedy chain accepts
    # (a head's depth-2 guesses were right mostly where depth 1 was wrong: teacher-forced
    # top-1 0.19 at depth 2, as a chain 0.06, SmolLM2-135M)
    chained: tuple[int, ...]


def ttt_step(head: torch.nn.Module, embed: torch.nn.Embedding, batch: Batch,
             depth: int) -> StepResult:
    """Loss and top-1 counts of `head` (an Eagle3Head) over `depth` TTT steps on one batch."""
    loss = batch.aux.new_zeros((), dtype=torch.float32)
    losses, correct, rows, chained = [], [], [], []
    alive = None  # rows whose chain is still accepted
    for j, h in enumerate(ttt_states(head, embed, batch.tokens, batch.aux, depth)):
        mask = _shift(batch.counts, 2 + j)
        at = mask.nonzero(as_tuple=True)
        # only counted rows reach the output layer: prompt rows are context, never scored
        # (the 1.5B Qwen's data: 184 -> 272 rows/s)
        logits = head.logits(h[at]).float()
        target = batch.target_logits[at[0], at[1] + 1 + j].float()  # distribution of t+2+j
        step_loss, hit = _objective(logits, target)
        right = torch.zeros_like(mask)
        right[at] = hit
        loss = loss + STEP_WEIGHT ** j * step_loss
        alive = right if alive is None else alive & right
        losses.append(float(step_loss.detach()))
        correct.append(int(hit.sum()))
        rows.append(len(hit))
        chained.append(int(alive.sum()))
    return StepResult(loss, tuple(losses), tuple(correct), tuple(rows), tuple(chained))


def ttt_logits(head: torch.nn.Module, embed: torch.nn.Embedding, tokens: torch.Tensor,
               aux: torch.Tensor, depth: int) -> Iterator[torch.Tensor]:
    """The head's draft-vocabulary logits [B, T, Vd] at each TTT step j < depth: row t scores
    token t+2+j, having read the data's tokens up to t+1+j and its own fed-back states."""
    return (head.logits(h) for h in ttt_states(head, embed, tokens, aux, depth))


def ttt_states(head: torch.nn.Module, embed: torch.nn.Embedding, tokens: torch.Tensor,
               aux: torch.Tensor, depth: int) -> Iterator[torch.Tensor]:
    """The head's pre-norm output [B, T, H] at each TTT step (what ttt_logits scores)."""
    n_rows = tokens.shape[1]
    width = aux.shape[-1] // 3
    hidden = head.project(list(aux.to(head.fc.weight.dtype).split(width, dim=-1)))
    positions = torch.arange(n_rows, device=tokens.device).expand(tokens.shape[0], -1)
    past = None
    for j in range(depth):
        emb = embed(_shift(tokens, 1 + j)).to(hidden.dtype)   # token t+1+j at row t
        h, past = head(emb, hidden, positions + j, past, ttt_mask(n_rows, j, tokens.device))
        yield h
        hidden = head.feedback(h)


def ttt_mask(n_rows: int, step: int, device: torch.device) -> torch.Tensor:
    """[T, (step+1)*T]: row t sees step 0's keys at positions <= t and, of every later step,
    its own key at t (the draft KV cache a chain builds at inference)."""
    causal = torch.ones(n_rows, n_rows, dtype=torch.bool, device=device).tril()
    own = torch.eye(n_rows, dtype=torch.bool, device=device)
    return torch.cat([causal, *[own] * step], dim=1)


def _shift(x: torch.Tensor, by: int) -> torch.Tensor:
    """x moved `by` rows to the left along dim 1, zero-filled (ref `padding(left=False)`)."""
    out = torch.zeros_like(x)
    if by < x.shape[1]:
        out[:, :x.shape[1] - by] = x[:, by:]
    return out


def _objective(logits: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mean loss over these rows, and which rows scored the target's top-1."""
    log_p = F.log_softmax(logits, dim=-1)
    per_row = -(F.softmax(target, dim=-1) * log_p).sum(-1)
    loss = per_row.sum() / max(len(per_row), 1)
    return loss, logits.argmax(-1) == target.argmax(-1)
