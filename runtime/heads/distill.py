"""``specgraph distill``: make a draft head (EAGLE or Medusa) for a target, from data it builds itself.

    specgraph distill --model smollm2-135m-instruct --head eagle --out head.safetensors

1. The training set (``distill_data.py``): the target's own answers to prompts made from the
   standard library and to prompts it asks itself, plus plain text, with the target's features for
   every token. Cached beside ``out`` (``<out>.data.pt``, or ``data``): a later run with the same data
   recipe for the same target (a resumed one, or one for another head kind) reuses it.
2. The draft vocabulary: the ``draft_vocab`` most frequent next tokens of the training split.
3. Training and held-out acceptance per draft position (``training.py``).
4. ``out`` (float16 safetensors) + ``out.json``: kind, config, target fingerprint, recipe, steps,
   acceptance.
"""
from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from .base import DraftHead, load_head, save_head, target_fingerprint, target_vocab_weights
from .distill_data import Sequence, chat_ids, self_asked_prompts, stdlib_modules, stdlib_prompts, stdlib_texts, \
    target_responses, teacher_features
from .eagle import EagleConfig, EagleHead
from .medusa import MedusaConfig, MedusaHeads
from .training import progress_bar, heldout_acceptance, train

HEADS = {"eagle": EagleHead, "medusa": MedusaHeads}
DATA_FIELDS = ("prompts", "self_asked", "asked_tokens", "texts", "text_tokens", "max_new_tokens", "sampled_fraction",
               "heldout_fraction", "seed")


@dataclass(frozen=True)
class Recipe:
    """What ``distill`` builds and how it trains (stored in the head's JSON)."""

    prompts: int = 600  # made from the standard library
    self_asked: int = 1000  # asked by the target itself (distill_data.self_asked_prompts)
    asked_tokens: int = 64  # the longest self-asked user turn
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
    unroll: int = 3  # EAGLE: drafting steps trained at once
    noise: float = 0.1  # EAGLE: uniform noise on the input features, times their standard deviation
    medusa_heads: int = 4
    seed: int = 0


def new_head(kind: str, model: torch.nn.Module, vocab: int, draft_ids: torch.Tensor, recipe: Recipe) -> DraftHead:
    """An untrained head of ``kind`` for ``model``, drafting over ``draft_ids``, attached to the target."""
    if kind == "eagle":
        cfg = target_head_config(model, vocab, len(draft_ids))
        head = EagleHead(cfg)
    else:
        _, lm_head = target_vocab_weights(model, vocab)
        head = MedusaHeads(MedusaConfig(hidden=int(lm_head.shape[1]), num_heads=recipe.medusa_heads, vocab_size=vocab,
                                        draft_vocab=len(draft_ids), target=target_fingerprint(model, vocab)))
    head.draft_ids.copy_(draft_ids)
    return head.attach(*target_vocab_weights(model, vocab))


def continued_head(path: str | Path, kind: str, model: torch.nn.Module, vocab: int) -> DraftHead:
    """The saved ``kind`` head at ``path``, to be trained further on new data (its draft vocabulary kept),
    attached to the target; ``ValueError`` when it is another kind of head or was distilled from another model."""
    h = load_head(path, {kind: HEADS[kind]})
    target = target_fingerprint(model, vocab)
    if h.cfg.target != target:
        raise ValueError(f"distill: the head {path} to continue was distilled from another model ({h.cfg.target}); "
                         f"this one is {target}")
    return h.attach(*target_vocab_weights(model, vocab))


def target_head_config(model: torch.nn.Module, vocab: int, draft_vocab: int) -> EagleConfig:
    """An EAGLE head's shapes: one decoder layer like the target's (its HF config when it has one)."""
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


def distill(model: torch.nn.Module, tokenizer=None, *, out: str | Path, head: str = "eagle",
            recipe: Recipe = Recipe(), prompts: list | None = None, texts: list[list[int]] | None = None,
            data: str | Path | None = None, resume: bool = False, minutes: float | None = None,
            init: str | Path | None = None, progress: bool = True, log=print) -> dict:
    """Build the training set, train a ``head`` ("eagle" or "medusa") for ``model`` and write ``out`` (+
    ``out.json``).

    ``prompts`` / ``texts``: token-id lists instead of the standard-library ones (a model without a
    tokenizer needs both). ``data``: where the training set is cached (default ``<out>.data.pt``); one
    built by the same recipe for the same target is reused (an EAGLE and a Medusa head can share it).
    ``resume``: continue training from ``<out>.ckpt.pt``. ``init``: a head of this kind for this target to
    train further on this run's data (more data for a head without its first data set: the data phase is
    most of a run's time), instead of a new one; its draft vocabulary is kept and its record is stored
    under ``"init"``. Returns the record stored in the JSON's ``recipe``."""
    if head not in HEADS:
        raise ValueError(f"distill: head={head!r} is not one of {', '.join(HEADS)}")
    from ...compiler.options import BackendOptions
    from ...compiler.program import compile_decoder

    out = Path(out)
    data_file = Path(data) if data is not None else out.with_name(out.name + ".data.pt")
    t0 = time.perf_counter()
    # the target as the engine sees it (vocabulary, layers), and its features (the hidden_states pass)
    program = compile_decoder(model, BackendOptions(page_size=16, hidden_states=True, lowering="eager",
                                                    self_check=False))
    vocab = program.vocab_size
    h = continued_head(init, head, model, vocab) if init is not None else None  # (refused before the data phase)
    recipe_of_data = {k: v for k, v in asdict(recipe).items() if k in DATA_FIELDS}
    stored = torch.load(data_file, weights_only=False) if data_file.is_file() else None
    if stored is not None and stored["recipe"] == recipe_of_data and stored["target"] == target_fingerprint(model, vocab):
        sequences = [Sequence(**s) for s in stored["sequences"]]
        log(f"distill: {len(sequences)} sequences from {data_file}")
    else:
        if stored is not None:
            log(f"distill: {data_file} holds another recipe's or model's data; building it again")
        sequences = build_training_set(model, tokenizer, program, recipe, prompts, texts, progress, log)
        data_file.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"recipe": recipe_of_data, "target": target_fingerprint(model, vocab),
                    "sequences": [asdict(s) for s in sequences]}, data_file)
    data_seconds = time.perf_counter() - t0
    if h is None:
        torch.manual_seed(recipe.seed)
        h = new_head(head, model, vocab, draft_vocabulary(sequences, min(recipe.draft_vocab, vocab)), recipe)
    h.to(program.device)
    trained = train(h, sequences, recipe, out.with_name(out.name + ".ckpt.pt"), resume, minutes, progress)
    acceptance = heldout_acceptance(h, sequences)
    tokens = sum(len(s.ids) for s in sequences)
    record = {"recipe": asdict(recipe), "data": {"sequences": len(sequences), "tokens": tokens,
                                                 "heldout_sequences": sum(s.heldout for s in sequences),
                                                 "seconds": round(data_seconds, 1)},
              **trained,
              "heldout_acceptance_by_position": [round(a, 4) for a in acceptance],
              "heldout_chain_tokens_per_forward": round(1 + sum(acceptance), 3)}
    if init is not None:
        record["init"] = {"head": Path(init).name, "recipe": h.cfg.recipe}
    h.cfg = replace(h.cfg, recipe=record)
    save_head(h, out)
    log(f"distill: wrote {out} ({trained['steps']} steps, held-out acceptance by position "
        f"{[round(a, 3) for a in acceptance]}, chain tokens/forward {record['heldout_chain_tokens_per_forward']})")
    return record


def build_training_set(model, tokenizer, program, recipe: Recipe, prompts, texts, progress: bool,
                       log) -> list[Sequence]:
    """Prompts (the standard library's and the target's self-asked ones, or the given token ids) -> the
    target's answers, plus plain texts; then the target's features of all of them (``program``: the target
    compiled with ``hidden_states``, page size 16)."""
    from ..engine import Engine
    from .distill_data import heldout

    rng = random.Random(recipe.seed)
    if prompts is None or texts is None:
        if tokenizer is None:
            raise ValueError("distill without a tokenizer needs prompts and texts as token ids")
        modules = stdlib_modules(recipe.seed)
    engine = Engine(model, tokenizer, max_num_seqs=16, self_check=False, prefix_caching=False)
    if prompts is None:
        prompts = [(kind, chat_ids(tokenizer, text), held)
                   for kind, text, held in stdlib_prompts(modules, recipe.prompts, recipe.seed, recipe.heldout_fraction)]
        if recipe.self_asked:
            bar = progress_bar(None, 0, progress)  # (turns that run on are dropped and asked again)
            bar.set_description("self-asked prompts")
            prompts += self_asked_prompts(engine, tokenizer, recipe.self_asked, recipe.asked_tokens, recipe.seed,
                                          recipe.heldout_fraction, progress=bar.update)
            bar.close()
    else:
        prompts = [("chat", list(p), heldout(str(i), recipe.heldout_fraction)) for i, p in enumerate(prompts)]
    plain = stdlib_texts(modules, tokenizer, recipe.texts, recipe.text_tokens, recipe.heldout_fraction) \
        if texts is None else [Sequence(list(t), "text", rng.random() < recipe.heldout_fraction) for t in texts]
    log(f"distill: {len(prompts)} prompts ({sum(p[2] for p in prompts)} held out), {len(plain)} texts")
    bar = progress_bar(len(prompts), 0, progress)
    bar.set_description("target answers")
    answers = target_responses(engine, prompts, recipe.max_new_tokens, recipe.sampled_fraction, recipe.seed,
                               progress=bar.update)
    bar.close()
    del engine
    sequences = answers + plain
    bar = progress_bar(sum(len(s.ids) for s in sequences), 0, progress)
    bar.set_description("target features")
    teacher_features(program, 16, sequences, progress=bar.update)
    bar.close()
    return sequences
