"""A step's logits as the host reads them: each row's target token, and whole rows only where a request reads them.

Plain decoding and the verification of a deterministic draft (n-gram lookup, a token tree's candidates)
read one thing of a row: the target's own token there, its argmax or, sampled, its draw with the uniform of
the output position the row decides (``sampling.PositionNoise``). On a GPU those tokens are picked where the
logits are, and only they come back: 4 ints instead of 4 x 49152 floats (0.8 MB) after a batch-4 SmolLM2
decode step, (k + 1) times that for a verify. Whole rows come to the host only for a request that returns
logprobs or verifies a sampled draft by rejection (it reads ``p / q``). On the CPU the rows are views, and a
sampled row's draw is made when verification reaches it: a verify whose first draft is rejected draws 1 of
its k + 1 rows.

``argmax`` is the first of equal maxima on every device and in NumPy, and a row's draw reads that row alone,
so where a token is picked changes no token on the CPU. On a GPU a draw's float64 cumulative sum may round
differently from the host's, which moves a draw only when its uniform falls within rounding of a token's
edge (CUDA's logits are not batch-invariant anyway); so on a GPU a sampled request that asks for logprobs
(drawn on the host) may, that rarely, draw differently from one that does not.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .proposers.base import Draft
from .sampling import SamplingParams, draw, probabilities
from .token_tree import node_depths


@dataclass
class RowsWanted:
    """What the host reads of one sequence's ``count`` rows: the target's token of each (greedy: the argmax;
    sampled: the draw of ``uniforms[m]`` from row ``m``), and the rows themselves if ``whole``."""

    count: int
    params: SamplingParams
    uniforms: list[float] = field(default_factory=list)
    whole: bool = False


def rows_wanted(request, draft: Draft | None, count: int) -> RowsWanted:
    """The :class:`RowsWanted` of a scheduled request (``params``, ``noise``, ``output_ids``, ``logprobs``) whose
    step has ``count`` logits rows and verifies ``draft`` (None: none). Row ``m`` decides output position
    ``len(output_ids)`` plus step node ``m``'s depth (a chain's ``m``)."""
    params = request.params
    whole = request.logprobs is not None or (not params.greedy and draft is not None and draft.probs is not None
                                             and draft.parents is None)  # rejection sampling reads p / q
    if params.greedy or not count:
        return RowsWanted(count, params, whole=whole)
    depths = node_depths(draft.parents) if draft is not None and draft.parents is not None else range(count)
    draws = request.noise.draws(len(request.output_ids), max(depths) + 1)
    return RowsWanted(count, params, [draws[d] for d in depths], whole)


class TargetRows:
    """One sequence's rows of the step's logits. ``token(m)``: the target's own token after step node ``m``;
    ``logits``: the rows ``[count, V]`` on the host (None where only the tokens came back)."""

    def __init__(self, wanted: RowsWanted, tokens: list[int | None], logits: torch.Tensor | None):
        self.wanted, self._tokens, self.logits = wanted, tokens, logits

    def __len__(self) -> int:
        return self.wanted.count

    def token(self, m: int) -> int:
        token = self._tokens[m]
        if token is None:  # a sampled row on the host: drawn when first read
            token = self._tokens[m] = draw(self.whole()[m], self.wanted.params, self.wanted.uniforms[m])
        return token

    def whole(self) -> torch.Tensor:
        """The rows themselves (asked for a request whose :class:`RowsWanted` did not want them: a bug in the
        caller, not a fallback)."""
        if self.logits is None:
            raise RuntimeError("these logits rows were not brought to the host (their RowsWanted said the "
                               "request reads only the target's tokens)")
        return self.logits


def host_rows(logits: torch.Tensor, wanted: Sequence[RowsWanted]) -> list[TargetRows]:
    """Split the step's ``logits [sum of counts, V]`` into each sequence's :class:`TargetRows`. From a device:
    every row's token in one copy of ints, and the rows of the sequences that want them whole in one more."""
    starts = [0]
    for w in wanted:
        starts.append(starts[-1] + w.count)
    if logits.device.type == "cpu":
        return [TargetRows(w, row_argmax(logits[a:b]) if w.params.greedy else [None] * w.count, logits[a:b])
                for w, a, b in zip(wanted, starts, starts[1:])]
    return rows_from_device(logits, wanted, starts)


def rows_from_device(logits: torch.Tensor, wanted: Sequence[RowsWanted], starts: Sequence[int]) -> list[TargetRows]:
    """:func:`host_rows` for logits on a device (``starts``: each sequence's first row, then the total)."""
    picks = logits.argmax(dim=-1) if starts[-1] else logits.new_zeros(0, dtype=torch.long)
    drawn: dict[SamplingParams, list[int]] = {}  # sequences drawn on the device, by their sampling (one call each)
    for i, w in enumerate(wanted):
        if w.count and not w.params.greedy and not w.whole:
            drawn.setdefault(w.params, []).append(i)
    for params, members in drawn.items():
        index = _row_index(starts, members, logits.device)
        picks[index] = device_draws(logits[index], params, [u for i in members for u in wanted[i].uniforms])
    tokens = picks.tolist()
    vocab = logits.shape[-1]
    # a row with no finite CDF (NaN logits) draws past the last token: drawn again on the host, as plain decoding is
    redraw = {i for i, (w, a, b) in enumerate(zip(wanted, starts, starts[1:])) if any(t >= vocab for t in tokens[a:b])}
    picked = [i for i, w in enumerate(wanted) if w.count and (w.whole or i in redraw)]
    rows = fetch_rows(logits, starts, picked) if picked else {}
    out = []
    for i, (w, a, b) in enumerate(zip(wanted, starts, starts[1:])):
        on_host = not w.params.greedy and (w.whole or i in redraw)
        out.append(TargetRows(w, [None] * w.count if on_host else tokens[a:b], rows.get(i)))
    return out


def device_draws(rows: torch.Tensor, params: SamplingParams, uniforms: Sequence[float]) -> torch.Tensor:
    """:func:`~.sampling.draw` of each row with its uniform, where the rows are (``[n]`` token ids; ``V`` where
    the row has no finite CDF, which :func:`rows_from_device` draws again on the host)."""
    cdf = probabilities(rows, params).double().cumsum(dim=-1)  # [n, V]
    u = torch.tensor(list(uniforms), dtype=torch.float64, device=rows.device).view(-1, 1)
    return torch.searchsorted(cdf, cdf[:, -1:] * u, right=True).view(-1)


def fetch_rows(logits: torch.Tensor, starts: Sequence[int], picked: Sequence[int]) -> dict[int, torch.Tensor]:
    """Sequence ``i``'s rows ``starts[i]:starts[i + 1]`` for each ``i`` in ``picked``, on the host, in one copy."""
    fetched, rows, at = logits[_row_index(starts, picked, logits.device)].cpu(), {}, 0
    for i in picked:
        n = starts[i + 1] - starts[i]
        rows[i], at = fetched[at:at + n], at + n
    return rows


def _row_index(starts: Sequence[int], members: Sequence[int], device: torch.device) -> torch.Tensor:
    """The rows of sequences ``members`` (sequence ``i``'s: ``starts[i]:starts[i + 1]``), in order, on ``device``."""
    return torch.tensor([r for i in members for r in range(starts[i], starts[i + 1])], device=device)


def row_argmax(logits: torch.Tensor) -> list[int]:
    """Each row's argmax (the first of equal maxima). On the CPU through NumPy where it takes the dtype: its
    SIMD argmax took 11 us over 4 x 49152 float32 logits where ``torch.argmax`` took 131 (2 threads, an
    Intel Xeon with AVX-512), about 0.5% of a batch-4 SmolLM2 decode step."""
    if logits.device.type == "cpu" and logits.dtype in _NUMPY_DTYPES:
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return logits.argmax(dim=-1).tolist()


_NUMPY_DTYPES = (torch.float32, torch.float64, torch.float16)
