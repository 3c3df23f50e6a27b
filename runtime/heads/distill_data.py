"""The training set of ``specgraph distill``, built offline from what every fresh machine has after setup.

* **Prompts** (:func:`stdlib_prompts`): code tasks from the standard library's functions (name,
  arguments and the first line of the docstring: "Write a Python function `name(args)` that ...")
  and chat tasks from its module and function docstrings ("Explain ...", "Summarize ...").
* **Self-asked prompts** (:func:`self_asked_prompts`, the Magpie recipe, Xu et al. 2024): the target
  writes user turns itself, sampled from its chat template cut where a user's message starts (after a
  few generic openers, half of them coding tasks). They cover what an assistant is asked far more
  widely than the standard library does: the shipped head trained on stdlib prompts alone agreed with
  the target on the first draft 42% of the time on unseen code prompts and 19% on unseen chat prompts,
  against 57% on its own held-out split.
* **Texts** (:func:`stdlib_texts`): pieces of the standard library's source, and its docstrings as prose.
* **Responses** (:func:`target_responses`): the target's own answers to the prompts, in its chat
  template, greedy and sampled (what the head will draft at inference).
* **Features** (:func:`teacher_features`): the target's last hidden state of every token of every
  sequence, teacher-forced through the specgraph program (``hidden_states`` pass).

Everything is seeded: the same machine (same Python, same target) gives the same set. The held-out
split is chosen by a hash of the module a prompt comes from, so no module feeds both splits.
"""
from __future__ import annotations

import ast
import hashlib
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages", "ensurepip"}


@dataclass
class Sequence:
    """One training sequence: ``ids``, the target's features ``[len, hidden]`` (after
    :func:`teacher_features`), where the answer starts (``prompt_len``; 0 for plain text) and whether
    the answer is the target's greedy one (then each answer token is the target's argmax)."""

    ids: list[int]
    kind: str  # "code" | "chat" | "text"
    heldout: bool
    prompt_len: int = 0
    greedy: bool = False
    feats: torch.Tensor | None = None


def heldout(name: str, fraction: float) -> bool:
    return int(hashlib.blake2b(name.encode(), digest_size=4).hexdigest(), 16) / 2 ** 32 < fraction


def stdlib_modules(seed: int) -> list[tuple[str, ast.Module, str]]:
    """``(module name, syntax tree, source)`` of the standard library's Python files, shuffled by ``seed``."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        out.append((".".join(rel.with_suffix("").parts), tree, source))
    random.Random(seed).shuffle(out)
    return out


def _first_line(doc: str | None) -> str:
    line = (doc or "").strip().split("\n\n")[0].replace("\n", " ").strip()
    return " ".join(line.split())


def stdlib_prompts(modules, count: int, seed: int, heldout_fraction: float) -> list[tuple[str, str, bool]]:
    """``count`` prompts ``(kind, text, heldout)``, about half code tasks and half chat tasks."""
    rng = random.Random(seed)
    code, chat = [], []
    for name, tree, _ in modules:
        held = heldout(name, heldout_fraction)
        mod_doc = _first_line(ast.get_docstring(tree))
        if 40 <= len(mod_doc) <= 400:
            chat.append(("chat", rng.choice([f"Explain in simple terms what this Python module is for: {mod_doc}",
                                             f"Summarize in a few sentences, with an example use: {mod_doc}",
                                             f"What is the `{name}` module of Python used for?"]), held))
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            doc = _first_line(ast.get_docstring(node))
            if not 20 <= len(doc) <= 200:
                continue
            args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
            task = doc[0].lower() + doc[1:] + ("" if doc.endswith((".", "!", "?")) else ".")
            code.append(("code", rng.choice([f"Write a Python function `{node.name}({args})` that does this: {task}",
                                             f"Implement `{node.name}({args})` in Python. It should: {task} "
                                             f"Add a short docstring.",
                                             f"Write Python code for `{node.name}({args})`: {task}"]), held))
            if rng.random() < 0.15:
                chat.append(("chat", f"What does the Python function `{name}.{node.name}` do? Its documentation "
                                     f"says: {doc}", held))
    rng.shuffle(code)
    rng.shuffle(chat)
    half = count // 2
    return code[:half] + chat[:count - half]


def stdlib_texts(modules, tokenizer, count: int, length: int, heldout_fraction: float) -> list[Sequence]:
    """``count`` plain-text sequences of ``length`` tokens: source pieces and docstrings, alternately."""
    out = []
    for i, (name, tree, source) in enumerate(modules):
        if len(out) >= count:
            break
        if i % 2:
            docs = [ast.get_docstring(n) for n in ast.walk(tree)
                    if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef))]
            text = "\n\n".join(d for d in docs if d)
        else:
            text = source
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:length]
        if len(ids) >= length // 2:
            out.append(Sequence(ids, "text", heldout(name, heldout_fraction)))
    return out


CODE_OPENERS = ("Write a Python function", "Write a Python class", "Write a Python script", "Write a function",
                "Write a SQL query", "Write a JavaScript", "Write a shell script", "Implement", "Fix", "Refactor",
                "Explain this code", "How do I", "In Python,", "Here is my code")
CHAT_OPENERS = ("", "", "", "What", "How", "Can you", "Why", "Write", "I")


def user_turn_prefix(tokenizer) -> str | None:
    """The chat template's text up to where a user's message starts (None without a chat template)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    marker = "\x00USER\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False,
                                         add_generation_prompt=True)
    return text[:text.index(marker)] if marker in text else None


def self_asked_prompts(engine, tokenizer, count: int, max_tokens: int, seed: int, heldout_fraction: float,
                       batch: int = 16, progress=None) -> list[tuple[str, list[int], bool]]:
    """``count`` prompts ``(kind, ids in the chat template, heldout)`` the target asks itself: its user-turn
    prefix plus an opener (alternately a coding one, ``kind`` "code", and a general one, "chat"), continued by
    sampling (temperature 1, top-p 0.95) up to the end of the turn. Turns that run past ``max_tokens`` or
    have under 4 tokens are dropped, so a few more than ``count`` are asked for."""
    prefix = user_turn_prefix(tokenizer)
    if prefix is None:
        raise ValueError("distill: self-asked prompts need a tokenizer with a chat template")
    rng = random.Random(seed)
    out: list[tuple[str, list[int], bool]] = []
    round_ = 0
    while len(out) < count and round_ < 4:
        want = count - len(out)
        plan = [("code", rng.choice(CODE_OPENERS)) if i % 2 == 0 else ("chat", rng.choice(CHAT_OPENERS))
                for i in range(want + want // 8 + 1)]
        for i in range(0, len(plan), batch):
            if len(out) >= count:
                break
            part = plan[i:i + batch]
            asked = [tokenizer(prefix + opener, add_special_tokens=False)["input_ids"] for _, opener in part]
            results = engine.generate(asked, max_new_tokens=max_tokens, temperature=1.0, top_p=0.95,
                                      seed=seed * 7919 + round_ * 100_003 + i)
            for (kind, opener), res in zip(part, results):
                if res.finish_reason != "stop" or len(res.token_ids) < 4 or len(out) >= count:  # (the last batch)
                    continue
                text = (opener + tokenizer.decode(res.token_ids, skip_special_tokens=True)).strip()
                out.append((kind, chat_ids(tokenizer, text), heldout(f"self-asked:{len(out)}", heldout_fraction)))
            if progress is not None:
                progress(len(part))
        round_ += 1
    return out


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """The prompt in the target's chat template, ready for the assistant's answer."""
    if getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                               add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def target_responses(engine, prompts: list[tuple[str, list[int], bool]], max_new_tokens: int,
                     sampled_fraction: float, seed: int, batch: int = 16, progress=None) -> list[Sequence]:
    """The target's answers (``engine``: a plain specgraph Engine of the target) to ``(kind, prompt ids,
    heldout)``: greedy, and a ``sampled_fraction`` sampled at temperature 0.8. Held-out ones are greedy."""
    rng = random.Random(seed)
    plan = [(kind, ids, held, held or rng.random() >= sampled_fraction) for kind, ids, held in prompts]
    out = []
    for greedy in (True, False):
        group = [p for p in plan if p[3] == greedy]
        for i in range(0, len(group), batch):
            part = group[i:i + batch]
            results = engine.generate([ids for _, ids, _, _ in part], max_new_tokens=max_new_tokens,
                                      temperature=0.0 if greedy else 0.8, seed=seed + i)
            for (kind, ids, held, _), res in zip(part, results):
                out.append(Sequence(ids + res.token_ids, kind, held, prompt_len=len(ids), greedy=greedy))
            if progress is not None:
                progress(len(part))
    return out


@torch.no_grad()
def teacher_features(program, page: int, sequences: list[Sequence], chunk: int = 256, progress=None) -> None:
    """Fill each sequence's ``feats`` (float16 ``[len, hidden]``) with the target's last hidden states,
    through ``program`` (compiled with ``hidden_states`` and page size ``page``) and a scratch cache."""
    from ...compiler.program import AttentionMetadata

    longest = max(len(s.ids) for s in sequences)
    blocks = -(-longest // page) + 1
    device = program.device
    cache = program.new_kv_cache(blocks + 1, device=device)
    table = list(range(1, blocks + 1))
    for s in sequences:
        rows = []
        for start in range(0, len(s.ids), chunk):
            n = min(chunk, len(s.ids) - start)
            meta = AttentionMetadata.build([(table, start, n)], page, [[n - 1]])
            _, hidden = program(torch.tensor(s.ids[start:start + n], device=device), meta, cache, return_hidden=True)
            rows.append(hidden.to(torch.float16).cpu())
        s.feats = torch.cat(rows)
        if progress is not None:
            progress(len(s.ids))
