"""Static check of every source file, benchmarks and examples included: no undefined names,
no unused imports left by a refactor (the benchmarks only run by hand, so nothing else would
notice that one lost an import)."""
from pathlib import Path

import pytest
from pyflakes.api import checkPath
from pyflakes.reporter import Reporter

ROOT = Path(__file__).resolve().parent.parent
DIRS = ["compiler", "passes", "runtime", "kernels", "benchmarks", "examples"]


class _Collect(Reporter):
    def __init__(self):
        self.messages: list[str] = []

    def unexpectedError(self, filename, msg):
        self.messages.append(f"{filename}: {msg}")

    def syntaxError(self, filename, msg, lineno, offset, text):
        self.messages.append(f"{filename}:{lineno}: {msg}")

    def flake(self, message):
        line = Path(message.filename).read_text().splitlines()[message.lineno - 1]
        if "noqa" not in line:  # deliberate side-effect imports are marked
            self.messages.append(str(message))


@pytest.mark.parametrize("folder", DIRS)
def test_no_undefined_names_or_unused_imports(folder):
    reporter = _Collect()
    for path in sorted((ROOT / folder).rglob("*.py")):
        checkPath(str(path), reporter)
    problems = [m for m in reporter.messages if "undefined name" in m or "imported but unused" in m]
    assert not problems, "\n".join(problems)
