"""Cold compile time of single kernel variants, one at a time in one process (no disk cache):

    python tools/compile_time.py

The first compile of a process also pays for loading the DSL's compiler; it is reported separately.
"""
import os
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from fa4 import jit  # noqa: E402
from fa4.config import AttnProblem  # noqa: E402
from fa4.fwd import sm80, sm90  # noqa: E402

t0 = time.time()
warm = sm90.variants("sm_90a")[3]
jit.compile_uncached(warm)
print(f"first compile of the process (includes compiler start-up): {time.time() - t0:.2f}s", flush=True)
for d in (64, 128, 256):
    for causal in (False, True):
        p = AttnProblem("bf16", 2, 4096, 4096, 8, 8, d, d, d ** -0.5, causal=causal)
        for mod in (sm90, sm80):
            cfg = mod.make_config(p, None, "sm_90a", True)
            t = time.time()
            jit.compile_uncached(cfg)
            print(f"{mod.__name__.split('.')[-1]} d{d} causal={causal}: {time.time() - t:.2f}s", flush=True)
