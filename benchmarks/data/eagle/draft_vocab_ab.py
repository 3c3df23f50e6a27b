"""Does a larger draft vocabulary raise the EAGLE head's acceptance? The head predicts the target's feature and
drafts over the target's own LM-head rows of its draft vocabulary (8,192 tokens, the most frequent in its
training data), so the vocabulary can grow at inference without training: here to the union with the first
16,384 token ids. On the tuning prompts (``REPLAY_*``), 4.5% of the target's greedy code tokens and 12.3% of its
chat tokens lie outside the 8,192, and two thirds of those fall in the union. One EAGLE engine (default shape,
``adaptive=False``) generates each prompt with both vocabularies in turn (order flipping every round).

    .venv/bin/python benchmarks/data/eagle/draft_vocab_ab.py
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import specgraph  # noqa: E402
from common import chat_prompt_ids, cpu_description  # noqa: E402
from prompts import REPLAY_CHAT_PROMPTS, REPLAY_CODE_PROMPTS  # noqa: E402
from specgraph.runtime.heads.base import QuantizedLinear, target_vocab_weights  # noqa: E402

UPTO = 16384


def main() -> None:
    torch.set_num_threads(2)
    print(f"cpu: {cpu_description()}; threads {torch.get_num_threads()}")
    model, tok = specgraph.load_model()
    engine = specgraph.Engine(model, tokenizer=tok, draft="eagle", adaptive=False)
    engine.generate([chat_prompt_ids(tok, "hi")], max_new_tokens=8)
    head = engine.speculation.proposer.head
    _, lm_head = target_vocab_weights(model, engine.program.vocab_size)

    def vocabulary(ids):  # (draft_ids, draft LM head rows, their product in the head's weight scheme)
        ids = torch.tensor(sorted(ids), dtype=torch.long)
        rows = lm_head.detach().index_select(0, ids).to(head.compute_dtype)
        return ids, rows, QuantizedLinear(rows, None, head.weight_scheme) if head.weight_scheme else None

    shipped = head.draft_ids.tolist()
    variants = {"shipped": vocabulary(shipped), f"with ids < {UPTO}": vocabulary(set(shipped) | set(range(UPTO)))}
    print({name: len(v[0]) for name, v in variants.items()})
    speed = {(name, kind): [] for name in variants for kind in ("code", "chat")}
    tokens_per_forward = {key: [] for key in speed}
    outputs: dict = {}
    for round_ in range(2):
        for kind, prompts in (("code", REPLAY_CODE_PROMPTS), ("chat", REPLAY_CHAT_PROMPTS)):
            for i, p in enumerate(prompts):
                for name in variants if round_ % 2 == 0 else list(variants)[::-1]:
                    head.draft_ids, head.draft_lm, head._draft_lm_product = variants[name]
                    engine.reset_stats()
                    t0 = time.perf_counter()
                    r = engine.generate([chat_prompt_ids(tok, p)], max_new_tokens=128)[0]
                    speed[name, kind].append(len(r.token_ids) / (time.perf_counter() - t0))
                    tokens_per_forward[name, kind].append(engine.stats["mean_accepted_tokens"])
                    outputs.setdefault((kind, i), set()).add(tuple(r.token_ids))
    print("greedy tokens identical with both vocabularies:", all(len(v) == 1 for v in outputs.values()))
    base, grown = variants
    for kind in ("code", "chat"):
        for name in variants:
            print(f"{kind} {name}: {statistics.mean(speed[name, kind]):.1f} tok/s, tokens per forward "
                  f"{statistics.mean(tokens_per_forward[name, kind]):.3f}")
        r = [a / b for a, b in zip(speed[grown, kind], speed[base, kind])]
        print(f"  {kind}: grown over shipped per run: median {statistics.median(r):.3f}, faster in "
              f"{sum(x > 1 for x in r)} of {len(r)}")


if __name__ == "__main__":
    main()
