import os
import sys

# Triton decides at decoration time whether kernels run in the interpreter: set it before any
# specgraph/triton import so the Triton kernels can run on this CPU-only machine.
os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))  # tests/models.py

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
