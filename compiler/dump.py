"""Inspection dumps: every graph before/after each pass, the pass log, kernels, MLIR, memory formulas."""
from __future__ import annotations

import os
from pathlib import Path

import torch.fx as fx


class Dumper:
    """Writes numbered, readable artifacts into one folder."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._count = 0

    def write(self, name: str, text: str) -> Path:
        path = self.root / name
        path.write_text(text)
        return path

    def graph(self, tag: str, gm: fx.GraphModule) -> Path:
        """The graph as readable Python with shapes (sympy sizes for symbolic dims)."""
        self._count += 1
        code = gm.print_readable(print_output=False, include_stride=False, include_device=False)
        return self.write(f"{self._count:02d}_{tag}.py", code)

    def pass_log(self, records) -> Path:
        return self.write("pass_log.txt", "\n".join(r.line() for r in records) + "\n")

    def mlir(self, gm: fx.GraphModule, example_inputs: list) -> Path:
        """The graph in MLIR (torch dialect) through torch-mlir, or a note saying why not."""
        try:
            from torch_mlir import fx as mlir_fx
        except ImportError:
            return self.write("graph.mlir.txt", "torch-mlir is not installed: pip install 'specgraph[mlir]' "
                                                "(or torch-mlir) to get the MLIR dump.\n")
        try:
            module = mlir_fx.export_and_import(gm, *example_inputs, output_type="torch")
            return self.write("graph.mlir", str(module))
        except Exception as e:  # an op torch-mlir cannot import: say which, keep compiling
            return self.write("graph.mlir.txt", f"torch-mlir could not import this graph: {type(e).__name__}: {e}\n")
