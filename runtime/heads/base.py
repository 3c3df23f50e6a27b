"""What every learned draft head shares: the target's vocabulary tensors, the reduced draft vocabulary,
the target's fingerprint, and storage (safetensors + a JSON config naming the head's kind).

A head drafts over ``draft_ids`` (the most frequent next tokens of its training data, as FR-Spec and
EAGLE-3 do): its LM head is the target's rows for them, gathered once at :meth:`DraftHead.attach`
(the target's tensors are used by reference, never saved). Verification stays exact over the full
vocabulary.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

FORMAT = 1


class DraftHead(nn.Module):
    """A head module: ``kind`` names it in the stored config; ``cfg`` (a dataclass with ``hidden``,
    ``vocab_size``, ``draft_vocab``, ``target`` and ``recipe``) is stored beside the weights."""

    kind = ""
    uses_embedding = False  # reads the target's token embedding (attach keeps it)

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.register_buffer("draft_ids", torch.arange(cfg.draft_vocab, dtype=torch.long))
        self.embed: torch.Tensor | None = None  # [vocab, hidden]: the target's, by reference
        self.draft_lm: torch.Tensor | None = None  # [draft_vocab, hidden]: the target's LM head rows of draft_ids
        self.compute_dtype: torch.dtype | None = None  # the float dtype of its features (its weights' at attach)
        self.weight_scheme: str | None = None  # how its linears are stored (None: float; see quantize)
        self.source: Path | None = None  # the file it was loaded from (see identity)
        self._draft_lm_product: nn.Module | None = None

    def identity(self) -> str | None:
        """Its kind, file digest and weight storage, naming measurements kept across engine builds
        (``runtime/shape_choice.py``); None for a head not loaded from a file."""
        if self.source is None:
            return None
        digest = hashlib.blake2b(Path(self.source).read_bytes(), digest_size=8).hexdigest()
        return f"{self.kind}-{digest}-{self.weight_scheme or 'float'}"

    def attach(self, embed: torch.Tensor, lm_head: torch.Tensor) -> "DraftHead":
        """Use the target's token embedding and LM head (``[vocab, hidden]`` each); clear errors on a mismatch."""
        cfg = self.cfg
        for name, w in (("embedding", embed), ("LM head", lm_head)):
            if w.shape != (cfg.vocab_size, cfg.hidden):
                raise ValueError(f"{self.kind} head for vocabulary {cfg.vocab_size} and hidden size {cfg.hidden}; "
                                 f"the target's {name} is {tuple(w.shape)}: this head was made for another model")
        self.embed = embed.detach() if self.uses_embedding else None
        self.compute_dtype = next(self.parameters()).dtype
        self.draft_lm = lm_head.detach().index_select(0, self.draft_ids.to(lm_head.device)).to(self.compute_dtype)
        return self

    def quantize(self, scheme: str) -> "DraftHead":
        """Store every linear of the head, and its draft LM head, in ``scheme`` (``int8``, ``int4``, ``fp8`` or
        ``bfloat16``: ``kernels/quant_linear.py``), computed by ``specgraph::quant_linear``. Drafting streams
        these weights once per draft step, so int8 reads a quarter of float32's bytes; the drafts may change
        a little, verification stays exact. Call after :meth:`attach`."""
        if self.draft_lm is None:
            raise RuntimeError(f"attach the {self.kind} head to its target before quantizing it")
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(module, name, QuantizedLinear(child.weight, child.bias, scheme))
        self._draft_lm_product = QuantizedLinear(self.draft_lm, None, scheme)
        self.weight_scheme = scheme
        return self

    def draft_logits(self, g: torch.Tensor) -> torch.Tensor:
        """``[..., draft_vocab]`` logits over the draft vocabulary of features ``g``."""
        if self._draft_lm_product is not None:
            return self._draft_lm_product(g)
        return g @ self.draft_lm.T


class QuantizedLinear(nn.Module):
    """``nn.Linear``'s product over a weight stored in a ``specgraph::quant_linear`` scheme."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scheme: str):
        super().__init__()
        from ...kernels.quant_linear import quantize_weight

        codes, scales = quantize_weight(weight, scheme)
        self.scheme = scheme
        self.register_buffer("codes", codes.to(weight.device))
        self.register_buffer("scales", None if scales is None else scales.to(weight.device))
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self._op = _quant_linear_op(weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._op(x.contiguous(), self.codes, self.scales, self.bias, self.scheme)


def _quant_linear_op(device: torch.device):
    """The C++ kernel's native op on CPU (no Python between the call and the kernel), else the kernel
    registry's direct call (the compiled graphs' two ways to the same op)."""
    from ...compiler.lowering import direct_call
    from ...kernels import cpu_kernels

    native = cpu_kernels.native_op("quant_linear") if device.type == "cpu" else None
    if native is not None:
        return native
    importlib.import_module("specgraph.kernels")  # registers quant_linear's implementations
    return direct_call("quant_linear")


# ------------------------------------------------------------------ the target
def target_vocab_weights(model: nn.Module, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's token embedding and LM head weights (``[vocab, hidden]`` each), by structure: the
    ``nn.Embedding`` with ``vocab`` rows and the last ``nn.Linear`` with ``vocab`` outputs."""
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding) and m.num_embeddings == vocab]
    heads = [m for m in model.modules() if isinstance(m, nn.Linear) and m.out_features == vocab]
    if not embeds or not heads:
        raise ValueError(f"a draft head needs the target's token embedding and LM head ({vocab} rows); found "
                         f"{len(embeds)} embedding(s) and {len(heads)} LM head(s)")
    if heads[-1].bias is not None:
        raise ValueError("a draft head drafts with the target's LM head: one with a bias is not supported")
    return embeds[0].weight, heads[-1].weight


def target_fingerprint(model: nn.Module, vocab: int) -> dict:
    """What identifies the target a head was distilled from: its sizes and a digest of its LM head (rounded to
    bfloat16 first, so the same model loaded in float32 or in bfloat16 is the same target)."""
    _, lm = target_vocab_weights(model, vocab)
    rounded = lm.detach().to(torch.bfloat16).view(torch.int16).contiguous().cpu().numpy()
    digest = hashlib.blake2b(rounded.tobytes(), digest_size=8).hexdigest()
    return {"vocab_size": vocab, "hidden": int(lm.shape[1]), "lm_head_digest": digest}


# ------------------------------------------------------------------- storage
def config_path(path: str | Path) -> Path:
    path = Path(path)
    return path.with_name(path.name + ".json")


def save_head(head: DraftHead, path: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """``path`` (``.safetensors``) + ``path.json`` (kind and config); weights in ``dtype``, draft ids int32."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.int32) if k == "draft_ids" else v.to(dtype)).contiguous()
               for k, v in head.state_dict().items()}
    save_file(tensors, str(path), metadata={"format": str(FORMAT), "kind": head.kind})
    config_path(path).write_text(json.dumps({"format": FORMAT, "kind": head.kind, **asdict(head.cfg)}, indent=1))
    return path


def load_head(path: str | Path, kinds: dict[str, type], dtype: torch.dtype = torch.float32,
              device="cpu") -> DraftHead:
    """A saved head of one of ``kinds`` (kind -> its ``DraftHead`` class, whose ``config_class`` parses the
    JSON); ``ValueError`` naming the file when it is missing, malformed, of another format or kind."""
    from safetensors.torch import load_file

    path = Path(path)
    cfg_file = config_path(path)
    if not path.is_file() or not cfg_file.is_file():
        raise ValueError(f"draft head {path}: needs {path.name} and {cfg_file.name} (made by `specgraph distill`)")
    try:
        raw = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"draft head {path}: {cfg_file.name} is malformed: {e}") from e
    kind, fmt = raw.pop("kind", None), raw.pop("format", None)
    if fmt != FORMAT or kind not in kinds:
        raise ValueError(f"draft head {path}: it is a {kind!r} head of format {fmt}, not "
                         f"{' or '.join(map(repr, kinds))} of format {FORMAT}")
    try:
        cls = kinds[kind]
        head = cls(cls.config_class(**raw))
        tensors = load_file(str(path))
        odd = set(head.state_dict()) ^ set(tensors)
        if odd:
            raise ValueError(f"tensors {sorted(odd)} missing or unexpected")
        head.load_state_dict({k: v.to(torch.long) if k == "draft_ids" else v for k, v in tensors.items()})
    except Exception as e:  # (safetensors raises its own error type for a damaged file)
        raise ValueError(f"draft head {path} is malformed: {e}") from e
    return head.to(device=device, dtype=dtype)
