"""Capture cost of SmolLM2 (compile_decoder: Dynamo + passes, no self-check, eager lowering) and the share of it
spent re-propagating fake values after the passes (refresh_meta), one thread, float and int4 caches.

    .venv/bin/python benchmarks/capture_refresh_ab.py      # run at two commits to compare
"""
import importlib
import os
import pkgutil
import subprocess
import time

os.environ["SPECGRAPH_GRAPH_CACHE"] = "0"  # capture every time
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

import specgraph  # noqa: E402
import specgraph.passes as passes  # noqa: E402
from specgraph.compiler.options import BackendOptions  # noqa: E402
from specgraph.compiler.program import compile_decoder  # noqa: E402
from specgraph.passes import graph_utils  # noqa: E402

refresh_times: list[float] = []
original_refresh = graph_utils.refresh_meta


def timed_refresh(gm) -> None:
    start = time.perf_counter()
    original_refresh(gm)
    refresh_times.append(time.perf_counter() - start)


def main() -> None:
    torch.set_num_threads(1)
    print(subprocess.run("lscpu | grep -E 'Model name|Flags'", shell=True, capture_output=True, text=True).stdout)
    for info in pkgutil.iter_modules(passes.__path__):  # the passes import refresh_meta by name
        module = importlib.import_module(f"specgraph.passes.{info.name}")
        if getattr(module, "refresh_meta", None) is original_refresh:
            module.refresh_meta = timed_refresh
    model, _ = specgraph.load_model("smollm2-135m-instruct")
    for kv_dtype in ("auto", "int4"):
        refresh_times.clear()
        torch._dynamo.reset()
        start = time.perf_counter()
        compile_decoder(model, BackendOptions(lowering="eager", self_check=False, kv_dtype=kv_dtype))
        total = time.perf_counter() - start
        each = ", ".join(f"{t:.2f}" for t in refresh_times)
        print(f"kv_dtype={kv_dtype}: compile_decoder {total:.1f} s, refresh_meta {sum(refresh_times):.1f} s "
              f"({len(refresh_times)} calls: {each})", flush=True)


if __name__ == "__main__":
    main()
