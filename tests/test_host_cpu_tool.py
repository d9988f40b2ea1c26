"""tools/host_cpu.py (the host time per repeated call, kernels stubbed) runs on the CPU and imports
the tree it is given, not an installed fa4 (a smoke test: its timings are not asserted)."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_host_cpu_tool_runs():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "host_cpu.py"), ROOT, "--rounds", "1",
                          "--calls", "4"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.endswith("(min of 1 rounds)")]
    assert len(rows) == 3 and all(line.startswith(ROOT) for line in rows), run.stdout
    assert any("flash_attn_with_kvcache" in line for line in rows)
