"""Run one load in a child process with its address space capped and a timeout, and measure its peak memory.

For files made to exhaust memory: a loader that falls for one fails here within seconds (MemoryError at the cap, or
the timeout) instead of growing until the machine's OOM killer ends everything. The child imports ComfyUI and the
pack exactly as the test session does (``conftest``), points ComfyUI's model folders at the test's, runs ``setup``
(imports: they are not the load's memory), caps its address space at what it has mapped plus ``headroom_mb``,
resets its peak-RSS counter, runs ``statement`` and reports what happened and how much its resident memory peaked
above where it stood.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]

_CHILD = """
import json, resource, sys
sys.path.insert(0, {tests!r})
import conftest  # ComfyUI's core in CPU mode and the pack, as in the test session
import folder_paths

for name, path in {folders!r}.items():
    folder_paths.add_model_folder_path(name, path, is_default=True)
{setup}

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

cap = status("VmSize") + {headroom} * 2**20
resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # VmHWM (peak RSS) from now on
before = status("VmRSS")
try:
{statement}
    outcome = {{"outcome": "loaded"}}
except BaseException as e:
    outcome = {{"outcome": type(e).__name__, "message": str(e)}}
outcome["rss_growth_mb"] = (status("VmHWM") - before) / 2**20
print("BOUNDED " + json.dumps(outcome))
"""


def run_bounded(statement: str, *, setup: str = "", folders: dict[str, Path], headroom_mb: int = 512,
                timeout_s: float = 120.0) -> dict:
    """``{"outcome": "loaded" | exception name, "message": …, "rss_growth_mb": …}`` of ``statement`` run in a
    capped child; an AssertionError when the child does not finish within ``timeout_s`` or reports nothing."""
    code = _CHILD.format(tests=str(TESTS), folders={k: str(v) for k, v in folders.items()}, setup=setup,
                         headroom=headroom_mb, statement=textwrap.indent(statement, "    "))
    # Few malloc arenas: each thread's arena reserves 64 MiB of address space, which the cap would count.
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env=env)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"the load did not finish within {timeout_s:.0f} s") from e
    lines = [line for line in done.stdout.splitlines() if line.startswith("BOUNDED ")]
    assert lines, f"the child reported nothing (exit {done.returncode}): {done.stderr[-3000:]}"
    return json.loads(lines[-1][len("BOUNDED "):])
