"""``specgraph`` command line: generate (streaming), dump (inspection artifacts), bench."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _load(args):
    from .loader import load_model

    return load_model(args.model)


def _chat(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)


def cmd_generate(args) -> int:
    import torch

    from .engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = _load(args)
    print(f"compiling {args.model} (first run captures and runs the passes, ~30 s) ...", file=sys.stderr)
    engine = Engine(model, tokenizer=tokenizer, kv_dtype=args.kv_dtype, page_size=args.page_size,
                    dump_dir=args.dump_dir)
    prompt = args.prompt if args.raw else _chat(tokenizer, args.prompt)
    emitted = []

    def stream(_, token):
        emitted.append(token)
        text = tokenizer.decode(emitted, skip_special_tokens=True)
        prev = tokenizer.decode(emitted[:-1], skip_special_tokens=True)
        sys.stdout.write(text[len(prev):])
        sys.stdout.flush()

    engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, on_token=stream)
    print()
    stats = engine.stats
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}, indent=1),
          file=sys.stderr)
    return 0


def cmd_dump(args) -> int:
    from ..compiler.options import BackendOptions
    from ..compiler.program import compile_decoder

    model, _ = _load(args)
    t0 = time.perf_counter()
    program = compile_decoder(model, BackendOptions(dump_dir=args.dump_dir, page_size=args.page_size, mlir=args.mlir))
    print(f"compiled in {time.perf_counter() - t0:.1f} s; artifacts in {args.dump_dir}:")
    for record in program.compiled.context.log:
        print("  " + record.line())
    for name in sorted(os.listdir(args.dump_dir)):
        print("  " + name)
    return 0


def cmd_bench(args) -> int:
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "bench_decode.py")
    return subprocess.call([sys.executable, script, *args.rest])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the embedded SmolLM2 (or --model)")
    gen.add_argument("prompt")
    gen.add_argument("--model", default="smollm2-135m-instruct", help="model name, .gguf file or HF folder")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--kv-dtype", default="auto")
    gen.add_argument("--page-size", type=int, default=16)
    gen.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--dump-dir", default=None)
    gen.set_defaults(fn=cmd_generate)

    dump = sub.add_parser("dump", help="write every graph, the pass log and kernels to a folder")
    dump.add_argument("--model", default="smollm2-135m-instruct")
    dump.add_argument("--dump-dir", default="specgraph_dump")
    dump.add_argument("--page-size", type=int, default=16)
    dump.add_argument("--mlir", action="store_true")
    dump.set_defaults(fn=cmd_dump)

    bench = sub.add_parser("bench", help="run benchmarks/bench_decode.py (arguments pass through)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(fn=cmd_bench)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
