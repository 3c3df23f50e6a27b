"""What a request comes in and goes out as: prompts to token ids, results, EOS ids, and
calibration text to token ids (the Engine's input and output, apart from its scheduling)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GenerationResult:
    """One prompt's output: new tokens only (EOS included when it ended the sequence)."""

    token_ids: list[int]
    text: str | None
    finish_reason: str  # "stop" (EOS or a stop string) or "length"
    prompt_tokens: int
    cached_tokens: int


def eos_ids(model: torch.nn.Module, tokenizer) -> set[int]:
    """The token ids that end a sequence: the tokenizer's EOS and the model's generation config's."""
    ids = set()
    for src in (getattr(tokenizer, "eos_token_id", None), getattr(getattr(model, "generation_config", None),
                                                                  "eos_token_id", None)):
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple)):
            ids.update(int(i) for i in src)
    return ids


def calibration_ids(calibration, weight_dtype: str, tokenizer) -> tuple[int, ...]:
    """``Engine(weight_calibration=...)`` -> the token ids for ``BackendOptions`` (() when the weight
    dtype has nothing to calibrate)."""
    from ..compiler.calibration import builtin_calibration_ids, calibrates

    if calibration is None or not calibrates(weight_dtype):
        return ()
    if isinstance(calibration, str):
        if tokenizer is None:
            if calibration == "builtin":
                return ()  # nothing to tokenize the built-in text with: nearest rounding
            raise ValueError("weight_calibration given as text needs a tokenizer; pass token ids instead")
        if calibration == "builtin":
            return builtin_calibration_ids(tokenizer)
        return tuple(tokenizer(calibration, add_special_tokens=False)["input_ids"])
    return tuple(calibration)


def encode_prompts(prompts, tokenizer, vocab: int) -> list[list[int]]:
    """A prompt or a list of prompts (text, or token ids in ``[0, vocab)``) -> lists of token ids."""
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    out = []
    for p in prompts:
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError("string prompts need a tokenizer: Engine(model, tokenizer=...)")
            ids = tokenizer(p, add_special_tokens=False)["input_ids"]
        else:
            ids = [int(t) for t in p]
        if not ids:
            raise ValueError("empty prompt")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got min {min(ids)} max {max(ids)}")
        out.append(ids)
    return out
