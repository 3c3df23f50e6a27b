"""``specgraph`` command line: generate (streaming), chat (interactive), serve (OpenAI-compatible
HTTP), dump (inspection artifacts), bench.

Bad arguments print one line (``specgraph: error: ...``) and exit with status 2.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

from .text_stream import TextStream

DEFAULT_MODEL = "smollm2-135m-instruct"


class UsageError(Exception):
    """A bad argument or model name: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse prints usage + message; one line is enough
        raise UsageError(f"{self.prog}: {message}")


def _load(args):
    from .loader import load_model

    try:
        return load_model(args.model)
    except (ValueError, ModuleNotFoundError) as e:
        raise UsageError(str(e)) from e


def _with_progress(what: str, fn):
    """Run ``fn(progress)`` while stderr shows the stage it reported and the time taken so far."""
    done = threading.Event()
    t0 = time.perf_counter()
    stage = ["starting"]
    tty = sys.stderr.isatty()

    def progress(name: str) -> None:
        stage[0] = name
        if not tty:
            sys.stderr.write(f"{what}: {name} ({time.perf_counter() - t0:.0f} s)\n")
            sys.stderr.flush()

    def tick():
        while not done.wait(0.5):
            sys.stderr.write(f"\r{what}: {stage[0]} ... {time.perf_counter() - t0:.0f} s" + " " * 10)
            sys.stderr.flush()

    sys.stderr.write(f"{what} (the generated code then compiles in the background; requests run meanwhile)\n")
    ticker = threading.Thread(target=tick, daemon=True)
    if tty:
        ticker.start()
    try:
        return fn(progress)
    finally:
        done.set()
        sys.stderr.write(f"\r{what}: done in {time.perf_counter() - t0:.1f} s" + " " * 40 + "\n")


def _engine(args, model, tokenizer):
    import torch

    from .engine import Engine

    if args.threads:
        torch.set_num_threads(args.threads)
    kwargs = dict(kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype, page_size=args.page_size, prefix_caching=args.prefix_caching,
                  weight_calibration=None if args.weight_calibration == "none" else "builtin",
                  max_num_seqs=args.max_num_seqs, dump_dir=getattr(args, "dump_dir", None), draft=args.draft,
                  num_draft_tokens=args.num_draft_tokens, draft_tree=args.draft_tree,
                  adaptive=args.adaptive if args.draft else None, kv_hot_window=args.kv_hot_window,
                  lowering=args.lowering,
                  compile_in_background=True)  # answer at once on the eager lowering, switch when compiled
    if args.num_blocks:
        kwargs["num_blocks"] = args.num_blocks
    try:
        return _with_progress(f"compiling {args.model}",
                              lambda progress: Engine(model, tokenizer=tokenizer, progress=progress, **kwargs))
    except ValueError as e:
        raise UsageError(str(e)) from e


def _chat_template(tokenizer, messages) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def _printer(tokenizer):
    """An ``on_token`` that prints the text as it becomes final."""
    text = TextStream(tokenizer)

    def on_token(token: int) -> None:
        sys.stdout.write(text.add(token))
        sys.stdout.flush()

    return on_token


def _print_stats(engine) -> None:
    stats = engine.stats
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in stats.items()}, indent=1),
          file=sys.stderr)


def cmd_generate(args) -> int:
    model, tokenizer = _load(args)
    engine = _engine(args, model, tokenizer)
    prompt = args.prompt if args.raw else _chat_template(tokenizer, [{"role": "user", "content": args.prompt}])
    show = _printer(tokenizer)
    engine.generate(prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                    top_k=args.top_k, seed=args.seed, on_token=lambda _, token: show(token))
    print()
    _print_stats(engine)
    return 0


def cmd_chat(args) -> int:
    """Multi-turn chat: each turn's prompt is the whole conversation, so the prefix cache serves
    the earlier turns' blocks and only the new message is prefilled."""
    model, tokenizer = _load(args)
    engine = _engine(args, model, tokenizer)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("chat with the model; an empty line or Ctrl-D ends", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        show = _printer(tokenizer)
        result = engine.generate(_chat_template(tokenizer, messages), max_new_tokens=args.max_new_tokens,
                                 temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                 on_token=lambda _, token: show(token))[0]
        print()
        s = engine.stats
        print(f"[{len(result.token_ids)} tokens, {s['tokens_per_second']:.1f} tok/s, "
              f"{result.cached_tokens}/{result.prompt_tokens} prompt tokens from the prefix cache]", file=sys.stderr)
        messages.append({"role": "assistant", "content": result.text})
    return 0


def cmd_serve(args) -> int:
    try:
        import uvicorn

        from .server import build_app
    except ModuleNotFoundError as e:
        raise UsageError(f"serving needs FastAPI and uvicorn ({e}); pip install fastapi uvicorn prometheus-client")
    model, tokenizer = _load(args)
    engine = _engine(args, model, tokenizer)
    name = args.served_model_name or args.model
    app = build_app(engine, model_name=name, max_pending=args.max_pending, shutdown_timeout=args.shutdown_timeout)
    print(f"serving {name} on http://{args.host}:{args.port}/v1 (Ctrl-C stops)", file=sys.stderr)
    # Ctrl-C: in-flight requests get --shutdown-timeout seconds to finish, then are cancelled (blocks freed)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=args.shutdown_timeout)
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


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1; got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0; got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0; got {value}")
    return value


def _engine_options(p: argparse.ArgumentParser) -> None:
    from ..compiler.options import KV_DTYPES, LOWERINGS, PAGE_SIZES, WEIGHT_DTYPES

    p.add_argument("--model", default=DEFAULT_MODEL, help="model name, .gguf file or HF folder")
    p.add_argument("--kv-dtype", default="auto", choices=KV_DTYPES,
                   help="fp8/int4: older pages quantized (hot/cold); adaptive: quantized only under pool pressure")
    p.add_argument("--kv-hot-window", type=int, default=None,
                   help="tokens per sequence kept in the model's dtype under fp8/int4/adaptive (default 32; 0: none)")
    p.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES,
                   help="storage of the linears' weights (int8/int4/fp8/bfloat16: quantized at compile time)")
    p.add_argument("--weight-calibration", default="builtin", choices=("builtin", "none"),
                   help="int8/fp8 codes chosen by GPTQ on a built-in text (builtin) or rounded to nearest (none)")
    p.add_argument("--page-size", type=int, default=16, choices=PAGE_SIZES)
    p.add_argument("--lowering", default=None, choices=LOWERINGS,
                   help="generated code (inductor, the default) or the graph op by op (eager)")
    p.add_argument("--draft", default=None, help="speculative decoding: ngram, ngram:N or layer_skip:K")
    p.add_argument("--num-draft-tokens", type=_positive, default=4,
                   help="drafts per step: the most, chosen per step by measured acceptance and cost (see --no-adaptive)")
    p.add_argument("--draft-tree", default=None, metavar="SHAPE",
                   help="draft token trees, verified in one forward: static:W1,W2,... or dynamic:N (no controller)")
    p.add_argument("--no-adaptive", dest="adaptive", action="store_false",
                   help="draft --num-draft-tokens every step instead of letting the controller choose")
    p.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false")
    p.add_argument("--num-blocks", type=_positive, default=None, help="KV pool blocks (default: 256 MiB)")
    p.add_argument("--max-num-seqs", type=_positive, default=8)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")


def _sampling_options(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=_positive, default=max_new_tokens)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)


def cmd_distill(args) -> int:
    from dataclasses import replace

    from .heads.distill import Recipe, distill

    given = {"prompts": args.prompts, "self_asked": args.self_asked, "texts": args.texts,
             "max_new_tokens": args.max_new_tokens, "steps": args.steps, "draft_vocab": args.draft_vocab, "seed": args.seed, "lr": args.lr}
    recipe = replace(Recipe(), **{k: v for k, v in given.items() if v is not None})
    model, tok = _load(args)
    distill(model, tok, out=args.out, head=args.head, recipe=recipe, data=args.data, resume=args.resume,
            minutes=args.minutes, init=args.init,
            log=lambda line: print(line, file=sys.stderr))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specgraph", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text with the embedded SmolLM2 (or --model)")
    gen.add_argument("prompt")
    _engine_options(gen)
    _sampling_options(gen, 128)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    gen.add_argument("--dump-dir", default=None)
    gen.set_defaults(fn=cmd_generate)

    chat = sub.add_parser("chat", help="interactive multi-turn chat (streaming, prefix cache across turns)")
    _engine_options(chat)
    _sampling_options(chat, 256)
    chat.add_argument("--system", default=None, help="system prompt")
    chat.set_defaults(fn=cmd_chat)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _engine_options(serve)
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as model (default --model)")
    serve.add_argument("--max-pending", type=_positive, default=256, help="queued + running requests before 429")
    serve.add_argument("--shutdown-timeout", type=float, default=10.0,
                       help="seconds in-flight requests may take to finish on shutdown before they are cancelled")
    serve.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    serve.set_defaults(fn=cmd_serve)

    dump = sub.add_parser("dump", help="write every graph, the pass log and kernels to a folder")
    dump.add_argument("--model", default=DEFAULT_MODEL)
    dump.add_argument("--dump-dir", default="specgraph_dump")
    dump.add_argument("--page-size", type=int, default=16)
    dump.add_argument("--mlir", action="store_true")
    dump.set_defaults(fn=cmd_dump)

    distill = sub.add_parser("distill", help="train a draft head (EAGLE or Medusa) for a model from data it builds itself")
    distill.add_argument("--model", default=DEFAULT_MODEL)
    distill.add_argument("--head", default="eagle", choices=("eagle", "medusa"))
    distill.add_argument("--out", required=True, help="the head's .safetensors (its config goes to OUT.json)")
    distill.add_argument("--prompts", type=_positive, default=None, help="prompts the target answers")
    distill.add_argument("--self-asked", type=_non_negative, default=None,
                         help="prompts the target asks itself (0: only the standard library's)")
    distill.add_argument("--texts", type=_positive, default=None, help="plain-text sequences")
    distill.add_argument("--max-new-tokens", type=_positive, default=None, help="tokens per answer")
    distill.add_argument("--steps", type=_positive, default=None, help="training steps")
    distill.add_argument("--draft-vocab", type=_positive, default=None, help="tokens the head drafts from")
    distill.add_argument("--seed", type=int, default=None)
    distill.add_argument("--minutes", type=float, default=None, help="train for about this many minutes: the learning-rate schedule ends at the steps that fit")
    distill.add_argument("--data", default=None,
                         help="the training set's cache (default OUT.data.pt; reused when made by the same recipe)")
    distill.add_argument("--resume", action="store_true", help="continue training from OUT.ckpt.pt")
    distill.add_argument("--init", default=None,
                         help="a head of this kind for this model to train further on this run's data")
    distill.add_argument("--lr", type=_positive_float, default=None, help="peak learning rate")
    distill.set_defaults(fn=cmd_distill)

    bench = sub.add_parser("bench", help="run benchmarks/bench_decode.py (arguments pass through)")
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        code = args.fn(args)
    except UsageError as e:
        print(f"specgraph: error: {e}", file=sys.stderr)
        return 2
    _leave_background_compile(code)
    return code


def _leave_background_compile(code: int) -> None:
    """A one-shot command that finished before the background compile did exits now, without
    waiting for it (the compile is abandoned: interpreter shutdown under a thread in the middle of
    native code would abort the process)."""
    program = sys.modules.get("specgraph.compiler.program")  # (not imported: nothing was compiled)
    if program is not None and any(t.name == program.COMPILE_THREAD and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
