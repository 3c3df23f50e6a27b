"""One process at a time builds the C++ extension, and a build that died leaves nothing to wait on.

``torch.utils.cpp_extension`` guards a build with a file named ``lock`` in the build directory, created
exclusively and removed when the build ends. A process killed mid-build (Ctrl-C in a benchmark, a CI
timeout) never removes it, and every later ``load_inline`` of that extension then polls it forever,
silently: an Engine sat 16 minutes at "compiling" until the file was deleted by hand.

:func:`exclusive_build` takes an ``flock`` on a file of its own beside torch's before the build starts.
The kernel drops an ``flock`` when its process dies, however it dies, so while one is held every other
specgraph process waits on it (and says so), and once this process holds it no live specgraph process
is building: a ``lock`` file still there was left by a dead one, and is removed with a warning that
names it.
"""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from typing import Iterator

try:
    import fcntl
except ImportError:  # not POSIX: torch's lock alone, as before
    fcntl = None

#: our own lock, beside torch's ``lock`` in the extension's build directory
OWN_LOCK = "specgraph-build.flock"
TORCH_LOCK = "lock"


@contextlib.contextmanager
def exclusive_build(build_directory: str) -> Iterator[None]:
    """Hold the build directory's specgraph lock for the block (waiting for another process's build, if
    one holds it), with any ``lock`` file a dead build left removed first."""
    if fcntl is None:
        yield
        return
    os.makedirs(build_directory, exist_ok=True)
    with open(os.path.join(build_directory, OWN_LOCK), "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"specgraph: waiting for another process that is building the C++ CPU kernels "
                  f"({os.path.join(build_directory, OWN_LOCK)})", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            remove_stale_torch_lock(build_directory)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def remove_stale_torch_lock(build_directory: str) -> None:
    """Remove torch's ``lock`` file if present (call only while holding :func:`exclusive_build`'s lock: then
    its builder is dead), warning that names it."""
    path = os.path.join(build_directory, TORCH_LOCK)
    try:
        os.remove(path)
    except FileNotFoundError:
        return
    warnings.warn(f"specgraph: removed {path}, left by a build of the C++ CPU kernels that was killed; "
                  f"torch would have waited on it forever")
