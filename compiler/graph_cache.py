"""A persistent cache of transformed decoder graphs: capture and passes run once per machine, not per process.

Capturing SmolLM2 with Dynamo and running the passes and the self-check costs about 30 s; loading
the result costs about a second. An entry holds the transformed graph's code, the tensors the
passes created (fused weights, rotations, ALiBi slopes; the model's own weights are referenced by
name, never copied) and what the program needs to feed it (the typed signature, cache layout,
logits row). The key hashes everything the graph depends on: the model's class, config and
weights (every byte), the options that change the passes, and the versions of torch,
transformers and specgraph's own sources; any change is a miss. A program built with user
passes is not cached (a function's behaviour cannot be hashed).

``$SPECGRAPH_GRAPH_CACHE`` names the folder (default ``~/.cache/specgraph/graphs``); ``0`` turns the
cache off. Entries are written atomically (a temporary folder renamed into place).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.fx as fx

from ..passes.graph_utils import attr_value
from .options import BackendOptions

FORMAT = 1  # bump when an entry's layout changes
_ENV = "SPECGRAPH_GRAPH_CACHE"
_PACKAGE = Path(__file__).resolve().parent.parent  # the specgraph sources


def cache_dir() -> Path | None:
    """The cache folder, or None when ``$SPECGRAPH_GRAPH_CACHE=0``."""
    value = os.environ.get(_ENV, "")
    if value == "0":
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "specgraph" / "graphs"


def machine_fingerprint() -> str:
    """This CPU's model name and flags (``/proc/cpuinfo``; the platform elsewhere): measurements taken on
    one machine are reused only on the same kind."""
    try:
        lines = []
        with open("/proc/cpuinfo") as f:
            for line in f:  # the first CPU's two lines (the file repeats them per CPU)
                if line.startswith(("model name", "flags")):
                    lines.append(line)
                    if len(lines) == 2:
                        break
    except OSError:
        import platform

        lines = [platform.machine(), platform.processor()]
    return hashlib.blake2b("".join(lines).encode(), digest_size=8).hexdigest()


def measurement_path(key: str | None, name: str) -> Path | None:
    """Where a measurement ``name`` of the program cached under ``key`` on this machine is kept (None: no
    cache, or a program that is not cached)."""
    folder = cache_dir()
    if key is None or folder is None:
        return None
    return folder / "measurements" / f"{key}-{machine_fingerprint()}-{name}.json"


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON at ``path`` atomically (a temporary file renamed into place)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def read_json(path: Path):
    """What :func:`write_json` wrote at ``path``, or None (missing or unreadable)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


CODE_DIRS = ("compiler", "passes", "runtime", "kernels")  # what a compiled program depends on (not tests, benchmarks)


def _sources_digest() -> str:
    h = hashlib.blake2b(digest_size=16)
    paths = [p for d in CODE_DIRS for pattern in ("*.py", "*.cpp") for p in (_PACKAGE / d).glob(pattern)]
    for path in sorted(paths):  # (C++ kernels change plans)
        h.update(path.relative_to(_PACKAGE).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _weights_digest(model: torch.nn.Module) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(memoryview(t.detach().contiguous().cpu().view(torch.uint8).numpy()))  # no copy
    return h.hexdigest()


def cache_key(model: torch.nn.Module, options: BackendOptions, example_len: int) -> str | None:
    """The entry's name, or None when this program must not be cached (user passes, a dump wanted)."""
    if options.passes or options.dump_dir or options.check != "off":
        return None
    import transformers

    config = getattr(model, "config", None)
    parts = [str(FORMAT), torch.__version__, transformers.__version__, _sources_digest(),
             f"{type(model).__module__}.{type(model).__qualname__}",
             config.to_json_string() if hasattr(config, "to_json_string") else repr(config),
             options.kv_dtype, str(options.hot_window_tokens), options.weight_dtype, hashlib.blake2b(repr(options.weight_calibration).encode()).hexdigest(),
             str(options.page_size), str(options.self_check), str(example_len), str(options.tree_nodes),
             str(options.hidden_states),
             str(next(iter(model.parameters())).device), _weights_digest(model)]
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=20).hexdigest()


def save(key: str, program, model: torch.nn.Module) -> Path | None:
    """Write ``program``'s entry (returns its folder; None if the cache is off)."""
    folder = cache_dir()
    if folder is None:
        return None
    model_tensors = {(t.data_ptr(), tuple(t.shape), t.dtype): name for name, t in
                     list(model.named_parameters(remove_duplicate=False))
                     + list(model.named_buffers(remove_duplicate=False))}
    # get_attr target -> ("model", its name in the model) or ("own", the tensor the passes made)
    attrs = {}
    for node in program.gm.graph.nodes:
        if node.op != "get_attr":
            continue
        t = attr_value(program.gm, node.target)
        name = model_tensors.get((t.data_ptr(), tuple(t.shape), t.dtype))
        attrs[node.target] = ("model", name) if name is not None else ("own", t.detach().cpu())
    entry = {"code": program.gm.code, "attrs": attrs, "spec": program.cache_spec()}
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder, prefix=".tmp-"))
    torch.save(entry, tmp / "entry.pt")
    final = folder / key
    try:
        tmp.rename(final)
    except OSError:  # another process wrote it first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def load(key: str, model: torch.nn.Module) -> dict | None:
    """The entry's graph module (rebuilt over ``model``'s own weights) and program spec, or None."""
    folder = cache_dir()
    path = folder / key / "entry.pt" if folder is not None else None
    if path is None or not path.exists():
        return None
    entry = torch.load(path, map_location="cpu", weights_only=False, mmap=True)
    params = dict(model.named_parameters(remove_duplicate=False))
    params.update(model.named_buffers(remove_duplicate=False))
    device = next(iter(model.parameters())).device
    root = torch.nn.Module()
    for target, (kind, value) in entry["attrs"].items():
        tensor = params[value] if kind == "model" else value.to(device)
        _set_attr(root, target, tensor)
    signature = entry["spec"]["signature"]
    for name, spec in signature.items():  # a lifted tensor (not a host scalar) goes where the model is
        if isinstance(spec.value, torch.Tensor) and spec.value.dim() > 0:
            signature[name] = dataclasses.replace(spec, value=spec.value.to(device))
    return {"gm": _graph_module(root, entry["code"]), "spec": entry["spec"]}


def retraced(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` as :func:`load` gives it back (re-traced from its code), over ``gm``'s own tensors."""
    root = torch.nn.Module()
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            _set_attr(root, node.target, attr_value(gm, node.target))
    return _graph_module(root, gm.code)


def _set_attr(root: torch.nn.Module, target: str, tensor: torch.Tensor) -> None:
    *path, leaf = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, torch.nn.Module())
        mod = getattr(mod, part)
    if isinstance(tensor, torch.nn.Parameter):
        mod.register_parameter(leaf, tensor)
    else:
        mod.register_buffer(leaf, tensor)


def _graph_module(root: torch.nn.Module, code: str) -> fx.GraphModule:
    """Re-trace the saved code over ``root`` (what pickling a GraphModule does)."""
    from torch.fx.graph_module import _forward_from_src

    forward = _forward_from_src("import torch\nimport operator\nimport math\n" + code, {}, {})
    cls = type("CachedDecoder", (torch.nn.Module,), {"forward": forward})
    traced = cls()
    traced.__dict__.update(root.__dict__)
    graph = fx.Tracer().trace(traced)
    return fx.GraphModule(traced, graph, class_name="CachedDecoder")
