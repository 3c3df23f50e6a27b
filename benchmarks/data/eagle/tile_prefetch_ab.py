"""The panel kernel's prefetch distance for a register tile's rows (verifies), 16 against 32 panel rows ahead
(longer row blocks, the prompts' prefill chunks, set alike: the plain engine's speed shows what that moves),
in one process: the same EAGLE engine (default shape, ``adaptive=False``) and a plain one generate each held-out
prompt under both settings in turn (the order flipping every round), so the machine's drift is shared.

    .venv/bin/python benchmarks/data/eagle/tile_prefetch_ab.py

(2026-12-07, AMD EPYC with AVX2, 2 threads, with one distance for every call of more than 1 row, set to the same
values: eagle 48.5 tok/s at 32 and 52.9 at 16, none 42.1 and 42.0: eagle/none 1.15x and 1.26x; 16 faster for
eagle on 14 of 16 prompt runs.)
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import specgraph  # noqa: E402
from common import cpu_description  # noqa: E402
from prompts import HELDOUT_CHAT_PROMPTS, HELDOUT_CODE_PROMPTS  # noqa: E402
from specgraph.kernels import cpu_kernels  # noqa: E402


def main() -> None:
    torch.set_num_threads(2)
    print(f"cpu: {cpu_description()}; threads {torch.get_num_threads()}")
    model, tok = specgraph.load_model()

    def chat(p):
        return tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)

    engines = {"eagle": specgraph.Engine(model, tokenizer=tok, draft="eagle", adaptive=False),
               "none": specgraph.Engine(model, tokenizer=tok)}
    for e in engines.values():
        e.generate([chat("hi")], max_new_tokens=8)
    module = cpu_kernels.load()
    chosen = module.set_panel_prefetch(0, 0, 0)
    module.set_panel_prefetch(*chosen)
    print("the build's choice (1 row, a tile's rows, more):", chosen)
    settings = {"tile 32": (chosen[0], 32, 32), "tile 16": (chosen[0], 16, 16)}
    speed = {(s, name): [] for s in settings for name in engines}
    for round_ in range(2):
        for p in HELDOUT_CODE_PROMPTS[:4] + HELDOUT_CHAT_PROMPTS[:4]:
            for s in settings if round_ % 2 == 0 else list(settings)[::-1]:
                module.set_panel_prefetch(*settings[s])
                for name, e in engines.items():
                    t0 = time.perf_counter()
                    r = e.generate([chat(p)], max_new_tokens=96)[0]
                    speed[s, name].append(len(r.token_ids) / (time.perf_counter() - t0))
    module.set_panel_prefetch(*chosen)
    for s in settings:
        eagle, none = statistics.mean(speed[s, "eagle"]), statistics.mean(speed[s, "none"])
        print(f"{s}: eagle {eagle:.1f} tok/s, none {none:.1f} tok/s, eagle/none {eagle / none:.3f}")
    r = [a / b for a, b in zip(speed["tile 16", "eagle"], speed["tile 32", "eagle"])]
    print(f"eagle at 16 over 32 per prompt run: median {statistics.median(r):.3f}, faster in {sum(x > 1 for x in r)}"
          f" of {len(r)}")


if __name__ == "__main__":
    main()
