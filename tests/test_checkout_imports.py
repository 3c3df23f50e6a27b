"""Run from the checkout's root (``python -m pytest``, ``python -c``), Python puts the root on
sys.path, where the ``kernels/`` folder (installed as ``specgraph.kernels``) is importable under the
bare name ``kernels`` and would shadow Hugging Face's ``kernels`` package, which transformers
>= 5.25 requires and imports. The bare name must reach the installed package, or, without one,
stay inert (no second registration of the specgraph:: ops)."""
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = """
import json
import kernels
from transformers import LlamaConfig  # noqa: F401  (imports transformers' hub-kernels integration)
import specgraph.kernels
import torch
print(json.dumps({
    "file": kernels.__file__,
    "has_specgraph_modules": hasattr(kernels, "registry"),
    "ops_registered": hasattr(torch.ops.specgraph, "paged_attention"),
}))
"""


def _hf_kernels_installed() -> bool:
    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def test_the_bare_name_kernels_run_from_the_checkout_root_is_not_this_folder():
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    probe = json.loads(run.stdout.strip().splitlines()[-1])
    assert probe["ops_registered"]
    assert not probe["has_specgraph_modules"]
    ours = Path(probe["file"]).resolve().parent == ROOT / "kernels"
    assert ours != _hf_kernels_installed(), probe
