"""Peak host memory (RSS) of one piece of work, measured in a fresh Python process (Linux).

Used by the loading-memory benchmark and its test. The child runs `setup` (imports: not counted), resets the
kernel's peak-RSS counter (/proc/self/clear_refs), runs `work`, and reports the peak RSS during the work minus
the RSS before it. `work` sets `result_bytes` (the bytes of what it built) and may set `device_bytes`.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

__all__ = ["measure", "can_reset_peak"]

# the child imports the same cupy_moe as this process (an installed one, or a checkout on PYTHONPATH)
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent)

_CHILD = r"""
import json, sys, time

def rss_kb(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")  # reset VmHWM (peak RSS) to the current RSS
        return True
    except OSError:
        return False

setup, work = sys.argv[1], sys.argv[2]
ns = {"args": sys.argv[3:], "device_bytes": None}
exec(setup, ns)
reset = reset_peak()
before = rss_kb("VmRSS")
t0 = time.perf_counter()
exec(work, ns)
seconds = time.perf_counter() - t0
peak = rss_kb("VmHWM")
print(json.dumps({"extra_peak_bytes": (peak - before) * 1024, "result_bytes": ns["result_bytes"],
                  "seconds": seconds, "peak_reset": reset, "device_bytes": ns["device_bytes"]}))
"""


def can_reset_peak() -> bool:
    """Whether this system can reset the peak-RSS counter (Linux /proc/self/clear_refs)."""
    return Path("/proc/self/clear_refs").exists()


def measure(setup: str, work: str, *args: str) -> dict:
    """Run `setup`, then `work` (Python source; `args` is sys.argv[3:] as `args`) in a fresh process.

    Returns {extra_peak_bytes, result_bytes, seconds, peak_reset, device_bytes}.
    """
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_PACKAGE_ROOT, os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, "-c", _CHILD, setup, work, *map(str, args)], capture_output=True,
                         text=True, env=env, check=False)
    if res.returncode:
        raise RuntimeError(f"measuring failed:\n{res.stderr}")
    return json.loads(res.stdout.strip().splitlines()[-1])
