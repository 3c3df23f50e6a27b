"""Loading a learned draft head (``runtime/heads``) for the engine's target: the file given, or the head of
that kind shipped for this very target (matched by its fingerprint)."""
from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from ..heads.base import DraftHead, load_head, target_fingerprint, target_vocab_weights
from ..sampling import probabilities
from ..token_tree import TreeBuilder
from .base import DraftContext, DraftRequest

SHIPPED = Path(__file__).resolve().parent.parent / "heads" / "shipped"


def shipped_head(target: dict, kind: str) -> Path:
    """The ``kind`` head shipped for the target of fingerprint ``target``; ``ValueError`` saying how to make one."""
    for cfg in sorted(SHIPPED.glob("*.safetensors.json")):
        stored = json.loads(cfg.read_text())
        if stored.get("kind") == kind and stored.get("target") == target:
            return cfg.with_name(cfg.name[:-len(".json")])
    raise ValueError(f"draft={kind!r}: no {kind} head is shipped for this model; make one with `specgraph distill "
                     f"--model <model> --head {kind} --out head.safetensors` and pass draft='{kind}:head.safetensors'")


def load_target_head(arg: str, ctx: DraftContext, cls: type[DraftHead]) -> DraftHead:
    """``draft="<kind>"`` (the shipped head) or ``"<kind>:PATH"``: the head, in the target's dtype and device
    (its linears stored in ``ctx.weight_dtype``, by default :func:`default_head_scheme`), attached to its
    embedding and LM head; a head made for another model is refused (other sizes) or warned about (same
    sizes, other weights)."""
    kind = cls.kind
    vocab = ctx.program.vocab_size
    target = target_fingerprint(ctx.model, vocab)
    path = Path(arg).expanduser() if arg else shipped_head(target, kind)
    embed, lm_head = target_vocab_weights(ctx.model, vocab)
    head = load_head(path, {kind: cls}, dtype=embed.dtype, device=ctx.device).attach(embed, lm_head)
    made_for = head.cfg.target.get("lm_head_digest")
    if made_for and made_for != target["lm_head_digest"]:
        warnings.warn(f"{kind} head {path} was distilled from another model with the same sizes: expect low "
                      f"acceptance (outputs stay exact)", RuntimeWarning, stacklevel=4)
    scheme = default_head_scheme(ctx.device) if ctx.weight_dtype is None else ctx.weight_dtype
    if scheme != "auto":
        head.quantize(scheme)
    head.source = path
    return head.eval()


def default_head_scheme(device: torch.device) -> str:
    """How a head's linears are stored when ``draft_weight_dtype`` is not given: ``"int8"`` on a CPU with the
    C++ quantized linear, else ``"auto"`` (float). Drafting streams the head's weights every draft step;
    measured on SmolLM2's shipped EAGLE head (Intel Xeon, 2 threads, 8 held-out prompts): int8 cut the draft
    time per verify 40% (tree ``static:2,1,1``: 19.6 -> 10.7 ms; chains of 2: 8.9 -> 5.5 ms) at the same
    tokens per forward (1.82 -> 1.80 on code, 1.34 -> 1.33 on chat)."""
    from ...kernels import cpu_kernels

    return "int8" if device.type == "cpu" and cpu_kernels.native_op("quant_linear") is not None else "auto"


def draw(head: DraftHead, r: DraftRequest, logits: torch.Tensor, qs: list[torch.Tensor]) -> int:
    """One draft token from a head's draft-vocabulary ``logits``: greedy, the best; sampling, one drawn from ``q``
    over the full vocabulary (zero outside the draft vocabulary), appended to ``qs`` for rejection sampling."""
    ids = head.draft_ids
    if r.params is None or r.params.greedy:
        return int(ids[torch.argmax(logits)])  # indexed where the logits are: one wait for the device
    full = logits.new_full((head.cfg.vocab_size,), float("-inf"))
    full[ids] = logits
    q = probabilities(full, r.params).cpu()  # (verification and the request's generator live on the host)
    qs.append(q)
    return int(torch.multinomial(q, 1, generator=r.generator))


def candidates(head: DraftHead, g: torch.Tensor, builder: TreeBuilder) -> list[tuple[int, float]]:
    """A tree node's candidate children from a head's feature ``g``: its most probable draft-vocabulary tokens,
    ``(token, probability)`` best first, as many as a level of ``builder``'s tree may keep."""
    return candidate_rows(head, g[None], max(builder.width, default=1))[0]


def candidate_rows(head: DraftHead, g: torch.Tensor, width: int) -> list[list[tuple[int, float]]]:
    """:func:`candidates` of each row of ``g [n, hidden]``, ``width`` each: one draft LM head product for every
    node of a tree level (it streams the draft vocabulary's weights once, not once per node)."""
    probs = torch.softmax(head.draft_logits(g).float(), dim=-1)
    top = torch.topk(probs, min(width, probs.shape[-1]), dim=-1)
    tokens = head.draft_ids[top.indices].tolist()
    return [list(zip(t, p)) for t, p in zip(tokens, top.values.tolist())]
