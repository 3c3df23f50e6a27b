import os
import sys

# Triton decides at decoration time whether kernels run in the interpreter: set it before any
# specgraph/triton import so the Triton kernels can run on this CPU-only machine.
os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines in tests run the eager lowering (an Inductor compile costs 10-20 s per tiny model);
# tests/test_inductor_lowering.py and the slow SmolLM2 tests ask for the generated-code lowerings.
os.environ.setdefault("SPECGRAPH_LOWERING", "eager")
# every test captures for itself (tests that inspect the analysis need it); test_graph_cache turns it on
os.environ["SPECGRAPH_GRAPH_CACHE"] = "0"
sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py
# The README's test command runs pytest-xdist workers: each gets its share of the cores (OpenMP
# threads that outnumber the cores spin against each other and slow every test many times over).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // _WORKERS))

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKERS > 1:
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    """Files with slow tests (the real SmolLM2, one module-wide engine) first: xdist hands out whole
    files (``--dist loadfile``) in this order, so one worker starts on the longest while the others
    share the rest, instead of it starting last and running alone."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
