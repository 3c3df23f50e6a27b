"""The typed seam between the passes and the program: every runtime input of a decoder graph has a role.

A pass that adds a graph input declares it here (:meth:`DecoderSignature.add`) with its role (the
token ids, positions, cache slots, block tables, a layer's K or V cache, ...);
``DecoderProgram`` feeds each input by its role and refuses a graph with an input nobody declared,
instead of freezing it at an example value. Inputs the capture itself has (the token ids, the
symbolic length, values Dynamo lifted out of the model) are declared by the ``annotate`` pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch.fx as fx


class Role(str, Enum):
    TOKENS = "tokens"  # the token ids, [1, N]
    LENGTH = "length"  # the symbolic stream length N (a SymInt input)
    STATIC = "static"  # a value Dynamo lifted out of the model: fed its captured value every call
    POSITIONS = "positions"  # [N] each token's position in its sequence
    SLOTS = "slots"  # [N] the cache slot each token's K/V is written to (< 0: none)
    BLOCK_TABLES = "block_tables"  # [S, max_blocks]
    SEQ_LENS = "seq_lens"  # [S] cached tokens per sequence, this step's included
    QUERY_START = "query_start_loc"  # [S + 1] where each sequence's tokens start in the stream
    CACHE_ROWS = "cache_rows"  # [S] a contiguous cache's row per sequence (paging replaces it)
    LOGITS_INDICES = "logits_indices"  # [M] stream rows whose logits are wanted
    TREE_MASK = "tree_mask"  # [N, W] int32 each token's ancestor bits in its step's token tree
    CACHE = "cache"  # one layer's cache tensor: a part of CACHE_PARTS


# a layer's cache tensors, in allocation order: K and V (quantized: their data, then their params),
# and for a hot/cold cache (kernels/hot_cold.py) the hot pages after them
CACHE_PARTS = ("k", "v", "k_scale", "v_scale", "k_hot", "v_hot")


class SignatureError(ValueError):
    """A decoder graph input without a declared role, or a declared input the graph lacks."""


@dataclass(frozen=True)
class InputSpec:
    role: Role
    layer: int | None = None  # CACHE only
    part: str | None = None  # CACHE only: one of CACHE_PARTS
    value: Any = None  # STATIC only: the captured value


@dataclass
class DecoderSignature:
    """Placeholder name -> :class:`InputSpec`, kept in step with the graph by the passes."""

    specs: dict[str, InputSpec] = field(default_factory=dict)

    def declare(self, node: fx.Node, role: Role, layer: int | None = None, part: str | None = None,
                value: Any = None) -> fx.Node:
        if node.op != "placeholder":
            raise SignatureError(f"{node.name} is not a graph input")
        if (role == Role.CACHE) != (layer is not None and part in CACHE_PARTS):
            raise SignatureError(f"{node.name}: a cache input needs a layer and a part in {CACHE_PARTS}")
        self.specs[node.name] = InputSpec(role, layer, part, value)
        return node

    def add(self, gm: fx.GraphModule, name: str, fake_val: Any, role: Role, layer: int | None = None,
            part: str | None = None) -> fx.Node:
        """Append a graph input (``meta["val"] = fake_val``) and declare its role."""
        from ..passes.graph_utils import add_input

        return self.declare(add_input(gm, name, fake_val), role, layer, part)

    def remove(self, gm: fx.GraphModule, node: fx.Node) -> None:
        """Erase an input (it must be unused) and its declaration."""
        if node.users:
            raise SignatureError(f"input {node.name} is still used by {list(node.users)}")
        gm.graph.erase_node(node)
        self.specs.pop(node.name, None)

    def input(self, gm: fx.GraphModule, role: Role) -> fx.Node:
        """The one input with ``role`` (SignatureError if there is none)."""
        for node in gm.graph.nodes:
            if node.op == "placeholder" and node.name in self.specs and self.specs[node.name].role == role:
                return node
        raise SignatureError(f"the graph has no {role.value} input (the pass that adds it has not run)")

    def caches(self, gm: fx.GraphModule) -> dict[int, dict[str, fx.Node]]:
        """layer -> part -> cache input node."""
        out: dict[int, dict[str, fx.Node]] = {}
        for node in gm.graph.nodes:
            spec = self.specs.get(node.name)
            if node.op == "placeholder" and spec is not None and spec.role == Role.CACHE:
                out.setdefault(spec.layer, {})[spec.part] = node
        return dict(sorted(out.items()))

    def validate(self, gm: fx.GraphModule, runtime_roles: set[Role]) -> list[InputSpec]:
        """Each graph input's spec, in placeholder order; SignatureError for an undeclared input, a
        declared one the graph lacks, or a role the program cannot feed."""
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        missing = [n for n in names if n not in self.specs]
        if missing:
            raise SignatureError(f"graph inputs {missing} have no declared role: a pass added them with add_input "
                                 "instead of DecoderSignature.add, so the program cannot feed them")
        stale = sorted(set(self.specs) - set(names))
        if stale:
            raise SignatureError(f"declared inputs {stale} are not in the graph (erase them with "
                                 "DecoderSignature.remove)")
        unfed = sorted({self.specs[n].role.value for n in names} - {r.value for r in runtime_roles})
        if unfed:
            raise SignatureError(f"the program cannot feed inputs with roles {unfed}")
        return [self.specs[n] for n in names]
