"""``specgraph distill``: make an EAGLE head for a target, from data it builds itself.

    specgraph distill --model smollm2-135m-instruct --head eagle --out head.safetensors

1. The training set (``distill_data.py``): the target's own answers to prompts made from the
   standard library, plus plain text, with the target's features for every token. Cached beside
   ``out`` (``<out>.data.pt``), so a resumed run does not rebuild it.
2. The draft vocabulary: the ``draft_vocab`` most frequent next tokens of the training split.
3. Training (:func:`train`): every drafting step from every slot at once (``EagleHead.unrolled``,
   ``steps`` deep), each step's loss = smooth-L1 to the target's feature + 0.1 x cross-entropy to the
   target's distribution over the draft vocabulary (EAGLE's), weighted 0.8^step; uniform noise on the
   input features. Checkpoints every ``checkpoint_every`` steps to ``<out>.ckpt.pt``; ``resume``
   continues from it.
4. Held-out acceptance (:func:`heldout_acceptance`): on the target's greedy answers to held-out
   prompts, the share of drafting positions whose first ``j`` chain drafts all match, per ``j``.
5. ``out`` (float16 safetensors) + ``out.json``: config, target fingerprint, recipe, steps, acceptance.
"""
from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from .distill_data import Sequence, chat_ids, stdlib_modules, stdlib_prompts, stdlib_texts, target_responses, \
    teacher_features
from .eagle import EagleConfig, EagleHead, save_head, target_fingerprint, target_vocab_weights


@dataclass(frozen=True)
class Recipe:
    """What ``distill`` builds and how it trains (stored in the head's JSON)."""

    prompts: int = 600
    texts: int = 150
    text_tokens: int = 512
    max_new_tokens: int = 160
    sampled_fraction: float = 0.3
    heldout_fraction: float = 0.08
    draft_vocab: int = 8192
    steps: int = 1400
    batch: int = 8
    window: int = 256
    lr: float = 1e-3
    unroll: int = 3
    noise: float = 0.1
    seed: int = 0


def target_head_config(model: torch.nn.Module, vocab: int, draft_vocab: int) -> EagleConfig:
    """The head's shapes: one decoder layer like the target's (its HF config when it has one)."""
    _, lm_head = target_vocab_weights(model, vocab)
    hidden = int(lm_head.shape[1])
    c = getattr(model, "config", None)
    heads = getattr(c, "num_attention_heads", None) or max(1, hidden // 64)
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    return EagleConfig(hidden=hidden, heads=heads, kv_heads=getattr(c, "num_key_value_heads", None) or heads,
                       head_dim=head_dim, intermediate=getattr(c, "intermediate_size", None) or 4 * hidden,
                       vocab_size=vocab, draft_vocab=min(draft_vocab, vocab),
                       rope_theta=float(getattr(c, "rope_theta", None) or 10000.0),
                       rms_eps=float(getattr(c, "rms_norm_eps", None) or 1e-5),
                       target=target_fingerprint(model, vocab))


def draft_vocabulary(sequences: list[Sequence], size: int) -> torch.Tensor:
    """The ``size`` most frequent next tokens of the training split (answers count double), sorted."""
    counts: Counter[int] = Counter()
    for s in sequences:
        if not s.heldout:
            counts.update(s.ids[1:])
            counts.update(s.ids[max(1, s.prompt_len):])
    ids = [t for t, _ in counts.most_common(size)]
    return torch.tensor(sorted(ids), dtype=torch.long)


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


def step_losses(head: EagleHead, ids, feats, lens, unroll: int, noise: float = 0.0):
    """Per drafting step ``(loss, top-1 agreement with the target)`` of a padded batch."""
    noisy = feats + (torch.rand_like(feats) * 2 - 1) * noise * feats.std() if noise else feats
    outs = head.unrolled(ids, noisy, unroll)
    t = ids.shape[1]
    out = []
    for j, g in enumerate(outs):
        valid = (torch.arange(t)[None] + j < lens[:, None] - 1)  # g_j[s] predicts f_{s+j}; its next token exists
        target = torch.cat([feats[:, j:], feats.new_zeros(feats.shape[0], j, feats.shape[2])], dim=1)
        with torch.no_grad():
            teacher = torch.softmax(head.draft_logits(target), dim=-1)
        logp = torch.log_softmax(head.draft_logits(g), dim=-1)
        vloss = F.smooth_l1_loss(g, target, reduction="none").mean(-1)
        ploss = -(teacher * logp).sum(-1)
        loss = ((vloss + 0.1 * ploss) * valid).sum() / valid.sum().clamp(min=1)
        agree = ((logp.argmax(-1) == teacher.argmax(-1)) & valid).sum() / valid.sum().clamp(min=1)
        out.append((loss, float(agree)))
    return out


def train(head: EagleHead, sequences: list[Sequence], recipe: Recipe, checkpoint: Path | None = None,
          resume: bool = False, minutes: float | None = None, progress: bool = True) -> dict:
    """Train ``head`` on the training split; returns ``{"first_step", "steps" (done), "first_loss", "loss" (the
    mean of the first and of the last 20 steps of this run), "seconds"}``."""
    windows = _windows([s for s in sequences if not s.heldout], recipe.window)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(recipe.seed)
    step = 0
    if resume and checkpoint is not None and checkpoint.is_file():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        step, rng = state["step"], state["rng"]
    warmup = min(100, recipe.steps // 10 + 1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, i / recipe.steps)))), last_epoch=step - 1)
    bar = _progress(recipe.steps, step, progress)
    first_step, losses_seen = step, []
    t0 = time.perf_counter()
    head.train()
    while step < recipe.steps:
        if minutes is not None and time.perf_counter() - t0 > minutes * 60:
            break
        ids, feats, lens = _batch(windows, [rng.randrange(len(windows)) for _ in range(recipe.batch)])
        losses = step_losses(head, ids, feats, lens, recipe.unroll, recipe.noise)
        total = sum(0.8 ** j * l for j, (l, _) in enumerate(losses))
        opt.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        opt.step()
        sched.step()
        step += 1
        losses_seen.append(total.item())
        bar.update(1)
        bar.set_postfix(loss=f"{losses_seen[-1]:.3f}", top1=f"{losses[0][1]:.2f}")
        if checkpoint is not None and (step % 250 == 0 or step == recipe.steps):
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng}, checkpoint)
    bar.close()
    head.eval()
    mean = (lambda xs: round(sum(xs) / len(xs), 4) if xs else None)
    return {"first_step": first_step, "steps": step, "first_loss": mean(losses_seen[:20]),
            "loss": mean(losses_seen[-20:]), "seconds": round(time.perf_counter() - t0, 1)}


def _progress(total: int, done: int, show: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=done, disable=not show, desc="distill", dynamic_ncols=True)


@torch.no_grad()
def heldout_acceptance(head: EagleHead, sequences: list[Sequence], depth: int = 5) -> list[float]:
    """On the target's greedy held-out answers: for ``j = 1..depth``, the share of drafting positions whose
    first ``j`` chain drafts all equal the target's tokens (a chain of ``depth`` then gains ``1 + sum``
    tokens per target forward)."""
    hits, count = torch.zeros(depth), 0
    for s in sequences:
        if not (s.heldout and s.greedy) or len(s.ids) - s.prompt_len < 2:
            continue
        ids = torch.tensor(s.ids)[None]
        outs = head.unrolled(ids, s.feats.float()[None], depth)
        n = len(s.ids)
        ok = torch.ones(n, dtype=torch.bool)
        for j, g in enumerate(outs):  # slot s drafts x_{s+j+1} at step j
            draft = head.draft_ids[head.draft_logits(g[0]).argmax(-1)]
            truth = torch.cat([ids[0, j + 1:], ids.new_full((j + 1,), -1)])
            ok &= draft == truth
            hits[j] += ok[s.prompt_len:n - 1].sum()  # drafting starts once the answer's first token is out
        count += n - 1 - s.prompt_len
    return (hits / max(count, 1)).tolist()


def distill(model: torch.nn.Module, tokenizer=None, *, out: str | Path, head: str = "eagle",
            recipe: Recipe = Recipe(), prompts: list | None = None, texts: list[list[int]] | None = None,
            resume: bool = False, minutes: float | None = None, progress: bool = True, log=print) -> dict:
    """Build the training set, train an EAGLE head for ``model`` and write ``out`` (+ ``out.json``).

    ``prompts`` / ``texts``: token-id lists instead of the standard-library ones (a model without a
    tokenizer needs both). Returns the record stored in the JSON's ``recipe``."""
    if head != "eagle":
        raise ValueError(f"distill --head {head!r}: only 'eagle' heads can be distilled (Medusa heads are not built)")
    from ...compiler.options import BackendOptions
    from ...compiler.program import compile_decoder

    out = Path(out)
    data_file = out.with_name(out.name + ".data.pt")
    t0 = time.perf_counter()
    # the target as the engine sees it (vocabulary, layers), and its features (the hidden_states pass)
    program = compile_decoder(model, BackendOptions(page_size=16, hidden_states=True, lowering="eager",
                                                    self_check=False))
    vocab = program.vocab_size
    if resume and data_file.is_file():
        sequences = [Sequence(**s) for s in torch.load(data_file, weights_only=False)]
        log(f"distill: {len(sequences)} sequences from {data_file}")
    else:
        sequences = build_training_set(model, tokenizer, program, recipe, prompts, texts, progress, log)
        out.parent.mkdir(parents=True, exist_ok=True)
        torch.save([asdict(s) for s in sequences], data_file)
    data_seconds = time.perf_counter() - t0
    cfg = target_head_config(model, vocab, recipe.draft_vocab)
    ids = draft_vocabulary(sequences, cfg.draft_vocab)
    cfg = replace(cfg, draft_vocab=len(ids))
    torch.manual_seed(recipe.seed)
    h = EagleHead(cfg)
    h.draft_ids.copy_(ids)
    embed, lm_head = target_vocab_weights(model, vocab)
    h.attach(embed, lm_head)
    trained = train(h, sequences, recipe, out.with_name(out.name + ".ckpt.pt"), resume, minutes, progress)
    acceptance = heldout_acceptance(h, sequences)
    tokens = sum(len(s.ids) for s in sequences)
    record = {"recipe": asdict(recipe), "data": {"sequences": len(sequences), "tokens": tokens,
                                                 "heldout_sequences": sum(s.heldout for s in sequences),
                                                 "seconds": round(data_seconds, 1)},
              **trained,
              "heldout_acceptance_by_position": [round(a, 4) for a in acceptance],
              "heldout_chain_tokens_per_forward": round(1 + sum(acceptance), 3)}
    h.cfg = replace(cfg, recipe=record)
    save_head(h, out)
    log(f"distill: wrote {out} ({trained['steps']} steps, held-out acceptance by position "
        f"{[round(a, 3) for a in acceptance]}, chain tokens/forward {record['heldout_chain_tokens_per_forward']})")
    return record


def build_training_set(model, tokenizer, program, recipe: Recipe, prompts, texts, progress: bool,
                       log) -> list[Sequence]:
    """Prompts -> the target's answers, plus plain texts; then the target's features of all of them
    (``program``: the target compiled with ``hidden_states``, page size 16)."""
    from ..engine import Engine
    from .distill_data import heldout

    rng = random.Random(recipe.seed)
    if prompts is None or texts is None:
        if tokenizer is None:
            raise ValueError("distill without a tokenizer needs prompts and texts as token ids")
        modules = stdlib_modules(recipe.seed)
    if prompts is None:
        prompts = [(kind, chat_ids(tokenizer, text), held)
                   for kind, text, held in stdlib_prompts(modules, recipe.prompts, recipe.seed, recipe.heldout_fraction)]
    else:
        prompts = [("chat", list(p), heldout(str(i), recipe.heldout_fraction)) for i, p in enumerate(prompts)]
    plain = stdlib_texts(modules, tokenizer, recipe.texts, recipe.text_tokens, recipe.heldout_fraction) \
        if texts is None else [Sequence(list(t), "text", rng.random() < recipe.heldout_fraction) for t in texts]
    log(f"distill: {len(prompts)} prompts ({sum(p[2] for p in prompts)} held out), {len(plain)} texts")
    engine = Engine(model, tokenizer, max_num_seqs=16, self_check=False, prefix_caching=False)
    bar = _progress(len(prompts), 0, progress)
    bar.set_description("target answers")
    answers = target_responses(engine, prompts, recipe.max_new_tokens, recipe.sampled_fraction, recipe.seed,
                               progress=bar.update)
    bar.close()
    del engine
    sequences = answers + plain
    bar = _progress(sum(len(s.ids) for s in sequences), 0, progress)
    bar.set_description("target features")
    teacher_features(program, 16, sequences, progress=bar.update)
    bar.close()
    return sequences
