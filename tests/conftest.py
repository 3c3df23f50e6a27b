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

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
