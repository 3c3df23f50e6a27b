"""The main job: SmolLM2-135M-Instruct through specgraph: generation, speculative decoding, cache figures.

    bash .ci/setup.sh && .venv/bin/python examples/demo.py
"""
from __future__ import annotations

import argparse
import time

import torch

import specgraph

CODE = ["Write a Python function that returns the n-th Fibonacci number.",
        "Write a Python function that checks whether a string is a palindrome."]
CHAT = ["What is the capital of France?", "Give me three tips for sleeping better."]
SYSTEM = ("You are a careful assistant. Answer briefly and precisely. When you write code, write idiomatic "
          "Python with a docstring. " * 8)


def chat(tok, text: str, system: str | None = None) -> str:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    model, tok = specgraph.load_model("smollm2-135m-instruct")
    print(f"loaded SmolLM2-135M-Instruct in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    progress = lambda stage: print(f"  compiling: {stage} ({time.perf_counter() - t0:.0f} s)", flush=True)  # noqa: E731
    engine = specgraph.Engine(model, tokenizer=tok, page_size=16, prefix_caching=True, progress=progress)
    print(f"compiled (capture + passes + generated code) in {engine.compile_seconds:.1f} s; "
          f"{engine.program.num_layers} attention sites rewritten to paged attention; {engine.program.step_plan}")

    prompts = [chat(tok, p) for p in CODE + CHAT]
    results = engine.generate(prompts, max_new_tokens=args.max_new_tokens)
    for question, r in zip(CODE + CHAT, results):
        print(f"\n### {question}\n{r.text.strip()}\n[{len(r.token_ids)} tokens, {r.finish_reason}]")
    s = engine.stats
    print(f"\nbatch of {len(prompts)}: {s['generated_tokens']} tokens in {s['elapsed_s']:.1f} s = "
          f"{s['tokens_per_second']:.1f} tokens/s, time to first token {s['time_to_first_token_s'] * 1e3:.0f} ms, "
          f"{s['target_forwards']} forwards")

    # speculative decoding: the EAGLE head shipped for SmolLM2 drafts a token tree from the target's own
    # hidden states; one target forward verifies the whole tree (lossless: the output is plain greedy's)
    spec = specgraph.Engine(model, tokenizer=tok, draft="eagle", progress=progress)
    for p in CODE:  # batch 1, as a chat user would run it
        prompt = chat(tok, p)
        plain = engine.generate(prompt, max_new_tokens=args.max_new_tokens)[0]
        plain_tps = engine.stats["tokens_per_second"]
        drafted = spec.generate(prompt, max_new_tokens=args.max_new_tokens)[0]
        s = spec.stats
        print(f"\nspeculative decoding (EAGLE head, tree {s['draft_tree']}) on {p[:48]!r}...: "
              f"{s['tokens_per_second']:.1f} tokens/s vs {plain_tps:.1f} without ({s['tokens_per_second'] / plain_tps:.2f}x); "
              f"{s['mean_accepted_tokens']:.2f} tokens per target forward, {s['tree_nodes_verified']} tree nodes "
              f"verified, drafting {s['draft_s'] / max(s['elapsed_s'], 1e-9):.0%} of the time, output identical: "
              f"{plain.token_ids == drafted.token_ids}")

    # prefix caching: two requests sharing a long system prompt
    engine.generate(chat(tok, CHAT[0], SYSTEM), max_new_tokens=8)
    cold = engine.stats["time_to_first_token_s"]
    engine.generate(chat(tok, CHAT[1], SYSTEM), max_new_tokens=8)
    warm = engine.stats
    print(f"shared {len(tok(SYSTEM)['input_ids'])}-token system prompt: first request TTFT {cold * 1e3:.0f} ms, "
          f"second {warm['time_to_first_token_s'] * 1e3:.0f} ms ({warm['cached_prompt_tokens']} prompt tokens "
          f"from the prefix cache)")
    print(f"prefix-cache hit rate {warm['prefix_cache_hit_rate']:.1%}, KV pool {warm['kv_pool_tokens']} tokens "
          f"({warm['kv_bytes_per_token']} bytes/token), peak pool use {warm['kv_pool_peak_usage']:.1%}")


if __name__ == "__main__":
    main()
