"""llama.cpp as a benchmark peer, on the same weights as specgraph (used when ``llama_cpp`` imports).

    pip install llama-cpp-python      # builds llama.cpp from source for this CPU (a few minutes)

On a VM whose CPU advertises AMX but does not let processes use the tile registers, the native
build's Q8_0/Q4_1 kernels crash (a general protection fault in libggml-cpu, seen on a Xeon with
amx_int8 under Firecracker); build without AMX, keeping every other SIMD level:

    CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
      -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
      -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install llama-cpp-python

The embedded model ships as a Q4_1 GGUF; specgraph dequantizes it to float32. llama.cpp's own
quantizer (``llama_model_quantize`` with requantizing allowed) turns the same file into an F32
(or Q8_0) GGUF, so both sides run the same weights. Converted files are cached beside
specgraph's model cache. Greedy decoding (``temp=0``), EOS ignored, one sequence at a time, each prefill cold.
"""
from __future__ import annotations

import ctypes
import importlib.util
import time
from pathlib import Path

from common import Run

FTYPES = {"f32": "LLAMA_FTYPE_ALL_F32", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0", "q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1"}


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def converted_gguf(source: Path, ftype: str, cache_dir: Path) -> Path:
    """``source`` requantized by llama.cpp to ``ftype`` ("f32", "q8_0", "q4_1"), made once and cached."""
    import llama_cpp

    dest = cache_dir / f"{source.stem}.llama-cpp-{ftype}.gguf"
    if dest.is_file():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, FTYPES[ftype])
    params.allow_requantize = True
    params.nthread = 2
    tmp = dest.with_suffix(".tmp")
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(tmp).encode(), ctypes.byref(params))
    if rc != 0 or not tmp.is_file():
        raise RuntimeError(f"llama_model_quantize({source} -> {ftype}) failed with code {rc}")
    tmp.rename(dest)
    return dest


def for_model(model: str, ftype: str, threads: int) -> "LlamaCpp":
    """llama.cpp on a known model's shipped GGUF (``specgraph.load_model``'s name), requantized to ``ftype``."""
    from specgraph.runtime.loader import default_cache_dir, find_smollm2_gguf

    return LlamaCpp(converted_gguf(find_smollm2_gguf(model), ftype, default_cache_dir() / "llama-cpp"), threads)


class LlamaCpp:
    """One llama.cpp model; :meth:`generate` matches the benchmark's runner signature (batch of 1)."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 2048):
        import llama_cpp

        self.path = path
        self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                                   verbose=False)
        self.version = getattr(llama_cpp, "__version__", "?")

    def generate(self, batch: list[list[int]], new_tokens: int) -> Run:
        if len(batch) != 1:
            raise ValueError("the llama.cpp runner decodes one sequence at a time")
        tokens: list[int] = []
        first = None
        # A cold prefill, as specgraph's timed calls have (their prefix cache is emptied first): llama-cpp-python
        # keeps the last call's tokens and, with reset=True, still reuses their longest common prefix with the
        # next prompt (the chat template's system prompt), which read as a time to first token of 129-146 ms
        # against specgraph's cold 181-212 until 2026-12-07. reset() forgets them.
        self.llm.reset()
        t0 = time.perf_counter()
        for tok in self.llm.generate(batch[0], temp=0.0, top_k=1, reset=True):  # greedy
            if first is None:
                first = time.perf_counter() - t0
            tokens.append(int(tok))
            if len(tokens) == new_tokens:
                break
        elapsed = time.perf_counter() - t0
        return Run(elapsed, [first if first is not None else elapsed], [tokens])
