"""The on-disk float cache of a GGUF model: its folder name, its validation and its atomic build.

A cache folder holds a Hugging Face checkpoint (``config.json``, ``model.safetensors``, tokenizer
files) and :data:`META_FILE`, which records the cache format, the source file it was built from and
every file's size; :func:`cache_problem` says why a folder cannot be used (missing, stale, truncated,
corrupt). :func:`build_cache` writes a new one into a temporary folder and renames it into place, so
a crash or a concurrent build never leaves a half-written cache behind. What goes into the folder
(the GGUF conversion) is :mod:`specgraph.runtime.loader`'s business.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

CACHE_FORMAT = 1
META_FILE = "specgraph_cache.json"
WEIGHTS_FILE = "model.safetensors"


def gguf_cache_name(gguf: Path) -> str:
    """The cache folder name of a GGUF file: its stem and a hash of its name, size and mtime."""
    st = gguf.stat()
    key = f"{gguf.name}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in gguf.stem)
    return f"gguf-{stem}-{digest}"


def safetensors_problem(path: Path) -> str | None:
    """None if the safetensors header opens and covers the whole file, else the reason."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if not list(f.keys()):
                return "it holds no tensors"
    except Exception as e:  # SafetensorError, OSError, ...
        return f"{type(e).__name__}: {e}"
    return None


def cache_problem(folder: Path, source: dict) -> str | None:
    """None if ``folder`` is a complete cache for ``source``, else why not."""
    if not folder.is_dir():
        return "missing"
    meta_path = folder / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except FileNotFoundError:
        return f"{META_FILE} missing (incomplete or foreign folder)"
    except (OSError, ValueError) as e:
        return f"{META_FILE} unreadable ({e})"
    if meta.get("format") != CACHE_FORMAT:
        return f"cache format {meta.get('format')!r} != {CACHE_FORMAT}"
    src = meta.get("source", {})
    for k in ("name", "size"):
        if src.get(k) != source.get(k):
            return (
                f"stale: built from {src.get('name')!r} ({src.get('size')} bytes), "
                f"source is {source.get('name')!r} ({source.get('size')} bytes)"
            )
    files = meta.get("files") or {}
    required = {"config.json", WEIGHTS_FILE, "tokenizer_config.json"}
    if not required <= set(files) or not ({"tokenizer.json", "vocab.json"} & set(files)):
        return f"{META_FILE} does not list config, weights and tokenizer files"
    for fname, size in files.items():
        p = folder / fname
        if not p.is_file():
            return f"{fname} missing"
        if p.stat().st_size != size:
            return f"{fname} is {p.stat().st_size} bytes, expected {size} (truncated or modified)"
    try:
        json.loads((folder / "config.json").read_text())
    except ValueError as e:
        return f"config.json is not valid JSON ({e})"
    problem = safetensors_problem(folder / WEIGHTS_FILE)
    if problem:
        return f"{WEIGHTS_FILE} unreadable ({problem})"
    return None


def fsync_tree(folder: Path) -> None:
    for p in folder.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clean_stale_tmp(final: Path) -> None:
    """Remove temp folders left by interrupted conversions of processes that are gone."""
    prefix = f".{final.name}.tmp-"
    for p in final.parent.glob(prefix + "*"):
        try:
            pid = int(p.name[len(prefix):].split("-", 1)[0])
        except ValueError:
            continue
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue  # still running: maybe converting right now
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        shutil.rmtree(p, ignore_errors=True)


def build_cache(final: Path, source: dict, convert: Callable[[Path], dict]) -> dict:
    """Fill ``final`` atomically: ``convert(folder)`` writes the model files into a temporary folder
    (returning extra metadata), which is checked, synced and renamed into place; a folder another
    process completed first wins."""
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
    try:
        extra = convert(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir()) if p.is_file()}
        meta = {
            "format": CACHE_FORMAT,
            "source": source,
            "files": files,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **extra,
        }
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        fsync_tree(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for f in tmp.iterdir():
            os.chmod(f, 0o666 & ~umask)
        os.chmod(tmp, 0o777 & ~umask)
        if final.exists() or final.is_symlink():
            if cache_problem(final, source) is None:  # someone else finished first
                shutil.rmtree(tmp, ignore_errors=True)
                return json.loads((final / META_FILE).read_text())
            trash = final.parent / f".{final.name}.tmp-{os.getpid()}-old-{time.time_ns()}"
            os.rename(final, trash)
            shutil.rmtree(trash, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if cache_problem(final, source) is None:  # lost a race to another process
                shutil.rmtree(tmp, ignore_errors=True)
                return json.loads((final / META_FILE).read_text())
            raise
        return meta
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
