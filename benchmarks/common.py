"""Measurement helpers shared by the benchmarks: RSS sampling, memory bandwidth, tables."""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field

import torch


# --------------------------------------------------------------------------- memory
def read_rss_bytes() -> int:
    """Current resident set size of this process (``VmRSS`` in ``/proc/self/status``); 0 if unavailable."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmRSS:"):
                    return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return 0


def _load_malloc_trim():
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_MALLOC_TRIM = _load_malloc_trim()


def release_free_memory() -> None:
    """Return free heap memory to the OS (glibc ``malloc_trim``), so RSS baselines are not inflated
    by memory an earlier mode freed but the allocator kept (later reuse would then be invisible)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


class RssSampler:
    """Samples VmRSS in a background thread; ``track(name)`` records peak-minus-baseline per name.

    ``getrusage`` maxrss is a process-lifetime high-water mark, useless once anything big ran.
    Instead each tracked segment starts from the RSS at its entry (the baseline) and keeps the
    highest sample seen until it exits. A name tracked several times (interleaved runs) keeps
    the largest segment delta. Free heap memory is handed back to the OS (``malloc_trim``) before
    each baseline, so a mode's working set shows even when it reuses memory an earlier run freed.
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self.available = read_rss_bytes() > 0
        self.peak_delta: dict[str, int] = {}
        self._peak = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> "RssSampler":
        if self.available:
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            rss = read_rss_bytes()
            with self._lock:
                if rss > self._peak:
                    self._peak = rss

    @contextlib.contextmanager
    def track(self, name: str):
        release_free_memory()
        base = read_rss_bytes()
        with self._lock:
            self._peak = base
        try:
            yield
        finally:
            end = read_rss_bytes()
            with self._lock:
                peak = max(self._peak, end)
            self.peak_delta[name] = max(self.peak_delta.get(name, 0), peak - base)

    def mib(self, name: str) -> float | None:
        if not self.available or name not in self.peak_delta:
            return None
        return self.peak_delta[name] / 2**20


# ------------------------------------------------------------------------ bandwidth
def measure_read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth in bytes/s: ``torch.sum`` over a ``gib`` GiB float32 tensor."""
    n = int(gib * 2**30) // 4
    x = torch.ones(n, dtype=torch.float32)  # written once, so every page is resident
    x.sum()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    del x
    return n * 4 / best


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights read per decode step at batch 1.

    ``model.parameters()`` yields a tied tensor once, so a tied embedding counts once: as the
    LM-head read (the embedding lookup itself only reads one row).
    """
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------- timing
@dataclass
class Run:
    """One timed generate call (one or more sequences)."""

    elapsed_s: float  # whole call
    first_token_s: list[float]  # per sequence, from the start of the call
    tokens: list[list[int]]  # new tokens per sequence

    @property
    def num_seqs(self) -> int:
        return len(self.tokens)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


@dataclass
class ModeResult:
    mode: str
    batch: int
    runs: list[Run] = field(default_factory=list)
    peak_rss_mib: float | None = None

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.runs)

    @property
    def elapsed_s(self) -> float:
        return sum(r.elapsed_s for r in self.runs)

    @property
    def ttft_s(self) -> float:
        firsts = [f for r in self.runs for f in r.first_token_s]
        return sum(firsts) / len(firsts) if firsts else float("nan")

    @property
    def decode_tok_s(self) -> float:
        """Tokens after each sequence's first / (call time - mean first-token time), summed over calls."""
        toks = sum(r.new_tokens - r.num_seqs for r in self.runs)
        secs = sum(r.elapsed_s - sum(r.first_token_s) / len(r.first_token_s) for r in self.runs)
        return toks / secs if secs > 0 else float("nan")

    @property
    def e2e_tok_s(self) -> float:
        return self.new_tokens / self.elapsed_s if self.elapsed_s > 0 else float("nan")

    def shape(self) -> str:
        seqs = sum(r.num_seqs for r in self.runs)
        per = {len(t) for r in self.runs for t in r.tokens}
        return f"{seqs}x{per.pop()}" if len(per) == 1 else f"{seqs} seqs/{self.new_tokens} tok"


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def chat_prompt_ids(tok, text: str) -> list[int]:
    """Token ids of ``text`` as one user turn under the tokenizer's chat template, ready for the reply."""
    templated = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    return tok(templated, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------- output
def format_table(headers: list[str], rows: list[list[str]], right: set[int] | None = None) -> str:
    right = right if right is not None else set(range(1, len(headers)))
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def fmt(x, spec: str = ".2f", none: str = "-") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return none
    return format(x, spec)


_T0 = time.perf_counter()


def quiet_torch(threads: int) -> None:
    """Benchmark set-up shared by the scripts: thread count, no tokenizer threads, no warnings or bars."""
    import warnings

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    import transformers

    transformers.logging.set_verbosity_error()
    try:
        transformers.utils.logging.disable_progress_bar()
    except AttributeError:
        pass


def print_report(lines: list[str], report: dict, json_path: str | None) -> None:
    """Print the benchmark's text report; with ``json_path``, also save ``report`` there as JSON."""
    print("\n".join(lines), flush=True)
    if json_path:
        write_json(json_path, report)
        print(f"\nresults saved to {json_path}")


def write_json(path: str, report: dict) -> None:
    """Save a benchmark's ``report`` as JSON (a file replaced whole: one stopped midway leaves the last)."""
    with open(path + ".part", "w") as f:
        json.dump(report, f, indent=1, default=str)
    os.replace(path + ".part", path)


def log(msg: str) -> None:
    """Progress on stderr (the results go to stdout), stamped with :func:`elapsed`."""
    print(f"[{elapsed():7.1f}s] {msg}", file=sys.stderr, flush=True)


def elapsed() -> float:
    """Seconds since this module was imported (about the process's start)."""
    return time.perf_counter() - _T0


def load_average() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def cpu_description() -> str:
    """``lscpu``'s model name and the SIMD flags that decide CPU kernels (printed with every result)."""
    model, flags = "unknown CPU", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown CPU":
                    model = value.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8")
    return f"{model}; {os.cpu_count()} CPUs; flags: {' '.join(f for f in wanted if f in flags) or 'none of ' + '/'.join(wanted)}"


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where ``a`` and ``b`` differ (None when they are equal)."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def cache_kwarg(model) -> str:
    """Name of a Hugging Face forward's KV-cache argument (``cache`` in recent transformers, else
    ``past_key_values``)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"
