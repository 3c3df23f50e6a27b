"""Training a draft head on ``distill``'s data, and measuring it on the held-out answers.

* :func:`train`: AdamW with warm-up and cosine decay over random windows of the training split;
  checkpoints every 250 steps, each measured on the held-out answers (the best weights are kept);
  ``resume`` continues from the checkpoint.
* EAGLE (:func:`eagle_losses`): every drafting step from every slot at once (``EagleHead.unrolled``,
  ``unroll`` steps deep, EAGLE-3's training-time test), each step's loss = smooth-L1 to the target's
  feature + 0.1 x KL divergence from the target's distribution over the draft vocabulary, weighted
  0.8^step; uniform noise on the input features.
* Medusa (:func:`medusa_losses`): head ``k``'s KL divergence from the target's distribution ``k`` tokens on.
* :func:`heldout_acceptance`: per draft position, the share of chain drafts the target would accept.
"""
from __future__ import annotations

import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .base import DraftHead
from .distill_data import Sequence
from .eagle import EagleHead
from .medusa import MedusaHeads

CHECKPOINT_STEPS = 250  # also how often the held-out answers are measured
PLAN_AFTER_STEPS = 10  # with a time limit, steps timed before the schedule's end is fitted to it


def _windows(sequences: list[Sequence], window: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for s in sequences:
        ids = torch.tensor(s.ids)
        for start in range(0, len(s.ids) - 1, window):
            out.append((ids[start:start + window], s.feats[start:start + window]))
    return out


def _batch(windows, picks: list[int]):
    t = max(len(windows[i][0]) for i in picks)
    ids = torch.zeros(len(picks), t, dtype=torch.long)
    feats = torch.zeros(len(picks), t, windows[picks[0]][1].shape[1])
    lens = torch.tensor([len(windows[i][0]) for i in picks])
    for row, i in enumerate(picks):
        n = len(windows[i][0])
        ids[row, :n], feats[row, :n] = windows[i][0], windows[i][1].float()
    return ids, feats, lens


class Teacher:
    """The target's distribution over the draft vocabulary at every slot of a batch (``[B, T, draft_vocab]``),
    with what the losses read of it computed once per batch, not once per drafting step: its negative entropy
    and its best token. A drafting step ``j`` compares the head's output at slot ``s`` with the teacher at
    ``s + j``: :meth:`terms` reads the teacher from slot ``j`` on, so nothing ``[B, T, vocab]``-sized is copied
    to shift it, and the head's last ``j`` slots (no teacher) are not run through the draft LM head."""

    def __init__(self, head: DraftHead, feats: torch.Tensor):
        with torch.no_grad():
            self.probs = torch.softmax(head.draft_logits(feats), dim=-1)
            self.neg_entropy = (self.probs * torch.log(self.probs.clamp_min(1e-30))).sum(-1)
            self.top = self.probs.argmax(-1)

    def terms(self, head: DraftHead, g: torch.Tensor, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(KL(teacher at s + j || head at s), head's top-1 == teacher's)`` per slot ``s < T - j``: the
        cross-entropy less the teacher's entropy (same gradient), so the loss reaches 0 when the head matches
        the target, however uncertain the target is."""
        n = max(g.shape[1] - j, 0)
        logp = torch.log_softmax(head.draft_logits(g[:, :n]), dim=-1)
        kl = self.neg_entropy[:, j:] - (self.probs[:, j:] * logp).sum(-1)
        return kl, logp.argmax(-1) == self.top[:, j:]


def _mean(per_slot: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (per_slot * valid).sum() / valid.sum().clamp(min=1)


def eagle_losses(head: EagleHead, ids, feats, lens, unroll: int, noise: float = 0.0):
    """Per drafting step ``(loss, top-1 agreement with the target)`` of a padded batch: smooth-L1 to the
    target's feature + 0.1 x KL divergence from its distribution over the draft vocabulary (EAGLE's cross-entropy
    less the target's entropy)."""
    noisy = feats + (torch.rand_like(feats) * 2 - 1) * noise * feats.std() if noise else feats
    outs = head.unrolled(ids, noisy, unroll)
    t = ids.shape[1]
    teacher = Teacher(head, feats)
    out = []
    for j, g in enumerate(outs):
        n = max(t - j, 0)  # g_j[s] predicts f_{s+j}; the token after it exists (so s < t - j)
        valid = torch.arange(n, device=ids.device)[None] + j < lens[:, None] - 1
        ploss, agree = teacher.terms(head, g, j)
        vloss = F.smooth_l1_loss(g[:, :n], feats[:, j:], reduction="none").mean(-1)
        out.append((_mean(vloss + 0.1 * ploss, valid), float(_mean(agree, valid))))
    return out


def medusa_losses(head: MedusaHeads, ids, feats, lens):
    """Per head ``k`` ``(loss, top-1 agreement)``: KL divergence of head ``k`` at ``f_s`` from the target's
    distribution at ``f_{s+k}`` (over the draft vocabulary), i.e. for token ``s + k + 1``."""
    t = ids.shape[1]
    teacher = Teacher(head, feats)
    out = []
    for k, g in enumerate(head(feats), start=1):
        valid = torch.arange(max(t - k, 0), device=ids.device)[None] + k < lens[:, None]
        loss, agree = teacher.terms(head, g, k)
        out.append((_mean(loss, valid), float(_mean(agree, valid))))
    return out


def head_losses(head: DraftHead, ids, feats, lens, recipe):
    if head.kind == "eagle":
        return eagle_losses(head, ids, feats, lens, recipe.unroll, recipe.noise)
    return medusa_losses(head, ids, feats, lens)


def train(head: DraftHead, sequences: list[Sequence], recipe, checkpoint: Path | None = None,
          resume: bool = False, minutes: float | None = None, progress: bool = True) -> dict:
    """Train ``head`` on the training split, measuring it on the held-out answers every ``CHECKPOINT_STEPS``
    steps and at the end; the head keeps the weights that measured best. (The shipped head drafts 3.1 / 2.7
    tokens per forward on training code / chat answers but 2.25 / 2.04 on held-out ones; its held-out curve
    still rose at the last step, so the guard matters only for longer runs.)

    ``minutes``: the time this run may train. The cosine decay then ends at the steps that fit
    (:func:`steps_that_fit`, from this run's measured time per step, checkpoints included, after every step),
    so a slower machine trains fewer steps of a whole schedule rather than stopping part-way down it. A resumed
    run fits its own schedule from the checkpoint's step to the recipe's steps (or to what fits in its
    ``minutes``): after a run that ended early the learning rate rises again.

    Returns ``{"first_step", "steps" (done), "first_loss", "loss" (the mean of the first and of the last 20
    steps of this run), "seconds", "heldout_curve" ([step, chain tokens/forward] per measurement),
    "kept_step", "last_lr"}``."""
    windows = _windows([s for s in sequences if not s.heldout], recipe.window)
    device = head.draft_ids.device
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(recipe.seed)
    step, curve, best = 0, [], None  # best: (tokens/forward, step, weights)
    saved_step = None
    if resume and checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, rng, curve, best = state["step"], state["rng"], state.get("curve", []), state.get("best")
    warmup = min(100, recipe.steps // 10 + 1)
    horizon = recipe.steps  # where the cosine decay ends (sooner with ``minutes``)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, i / horizon)))), last_epoch=step - 1)
    bar = progress_bar(recipe.steps, step, progress)
    first_step, losses_seen = step, []
    t0 = time.perf_counter()

    def measure_and_save():
        nonlocal best, saved_step
        if saved_step == step:  # (the last step was a checkpoint's: measured and saved already)
            return
        saved_step = step
        score = heldout_tokens_per_forward(head, sequences)
        if score is not None:
            curve.append([step, round(score, 4)])
            if best is None or score > best[0]:
                best = (score, step, {k: v.detach().clone() for k, v in head.state_dict().items()})
        if checkpoint is not None:
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng, "curve": curve,
                        "best": best}, checkpoint)

    head.train()
    while step < horizon:
        if minutes is not None and time.perf_counter() - t0 > minutes * 60:
            break  # (a step far slower than the ones before it)
        ids, feats, lens = (t.to(device) for t in _batch(windows, [rng.randrange(len(windows))
                                                                     for _ in range(recipe.batch)]))
        losses = head_losses(head, ids, feats, lens, recipe)
        total = sum(0.8 ** j * l for j, (l, _) in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        step += 1
        if minutes is not None:  # (before the next step's learning rate is set)
            horizon = steps_that_fit(recipe.steps, step, step - first_step, time.perf_counter() - t0, minutes * 60)
            bar.total = horizon  # (the bar counts to where the schedule ends)
        sched.step()
        losses_seen.append(total.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses_seen[-1]:.3f}", top1=f"{losses[0][1]:.2f}",
                        heldout=curve[-1][1] if curve else "-")
        if step % CHECKPOINT_STEPS == 0:
            measure_and_save()
    measure_and_save()
    bar.close()
    head.eval()
    if best is not None:
        head.load_state_dict(best[2])
    mean = (lambda xs: round(sum(xs) / len(xs), 4) if xs else None)
    return {"first_step": first_step, "steps": step, "first_loss": mean(losses_seen[:20]),
            "loss": mean(losses_seen[-20:]), "seconds": round(time.perf_counter() - t0, 1), "heldout_curve": curve,
            "kept_step": best[1] if best is not None else step, "last_lr": sched.get_last_lr()[0]}


def steps_that_fit(steps: int, step: int, done: int, elapsed: float, budget: float) -> int:
    """The step at which a schedule of at most ``steps`` ends when a run that has done ``done`` steps (now at
    ``step``) in ``elapsed`` seconds may take ``budget``: at its mean time per step so far (``steps`` until
    :data:`PLAN_AFTER_STEPS` steps are timed)."""
    if done < PLAN_AFTER_STEPS:
        return steps
    return max(step, min(steps, step + int((budget - elapsed) * done / elapsed)))


def heldout_tokens_per_forward(head: DraftHead, sequences: list[Sequence], depth: int = 5) -> float | None:
    """``1 + sum(heldout_acceptance(...))`` (a chain of ``depth``'s tokens per target forward), measured in eval
    mode and the head's mode restored; ``None`` without held-out greedy answers."""
    if not any(s.heldout and s.greedy for s in sequences):
        return None
    was_training = head.training
    head.eval()
    score = 1 + sum(heldout_acceptance(head, sequences, depth))
    head.train(was_training)
    return score


def progress_bar(total: int | None, done: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, disable=not show, desc="distill", dynamic_ncols=True)


def chain_drafts(head: DraftHead, ids: torch.Tensor, feats: torch.Tensor, depth: int) -> list[torch.Tensor]:
    """Greedy chain drafts from every position of one sequence at once: ``out[j][s]`` is the draft for token
    ``s + j + 1`` of the chain that starts once token ``s`` is committed (while every earlier draft of the
    chain was right; ``ids [T]``, ``feats [T, hidden]``)."""
    if head.kind == "eagle":
        outs = [g[0] for g in head.unrolled(ids[None], feats[None], depth)]
    else:  # head k at f_{s-1} guesses token s + k
        prev = torch.cat([feats.new_zeros(1, feats.shape[1]), feats[:-1]])
        outs = head(prev)[:depth]
    return [head.draft_ids[head.draft_logits(g).argmax(-1)] for g in outs]


@torch.no_grad()
def heldout_acceptance(head: DraftHead, sequences: list[Sequence], depth: int = 5) -> list[float]:
    """On the target's greedy held-out answers: for ``j = 1..depth``, the share of drafting positions whose
    first ``j`` chain drafts all equal the target's tokens (a chain of ``depth`` then gains ``1 + sum``
    tokens per target forward)."""
    depth = min(depth, getattr(head.cfg, "num_heads", depth))
    hits, counts = torch.zeros(depth), torch.zeros(depth)
    device = head.draft_ids.device
    for s in sequences:
        if not (s.heldout and s.greedy) or len(s.ids) - s.prompt_len < 2:
            continue
        ids = torch.tensor(s.ids, device=device)
        n = len(s.ids)
        ok = torch.ones(n, dtype=torch.bool, device=device)
        for j, draft in enumerate(chain_drafts(head, ids, s.feats.to(device).float(), depth)):
            truth = torch.cat([ids[j + 1:], ids.new_full((j + 1,), -1)])
            ok &= draft == truth
            # chains from the answer's first token on, whose j-th draft's token exists
            hits[j] += ok[s.prompt_len:n - 1 - j].sum().item()
            counts[j] += max(0, n - 1 - j - s.prompt_len)
    return (hits / counts.clamp(min=1)).tolist()
