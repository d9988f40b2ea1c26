"""Cold compile time of single kernel variants, one at a time in one process:

    python tools/compile_time.py [--reps N]   # N > 1: the sm90 defaults N more cold rounds each
    python tools/compile_time.py --ab fold_first [--reps 3] [--family sm80] [--local]   # causal (or window
        (1024, 0)) configs, FIELD off / on in turn

Each variant goes the way a first call takes it (``jit.get_kernel`` on an empty disk cache):
compiled without a host engine, exported to the cache and loaded back (Note [Export without an
engine] in fa4/jit.py); the seconds include all three. The first compile of a process also pays
for loading the DSL's compiler; it is reported separately.
"""
import atexit
import dataclasses
import os
import shutil
import sys
import tempfile
import time

os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
os.environ["FA4_CACHE_DIR"] = tempfile.mkdtemp(prefix="fa4-compile-time-")
atexit.register(shutil.rmtree, os.environ["FA4_CACHE_DIR"], True)
os.environ.pop("FA4_DISABLE_DISK_CACHE", None)

from fa4 import jit  # noqa: E402
from fa4.config import AttnProblem  # noqa: E402
from fa4.fwd import sm80, sm90  # noqa: E402

t0 = time.time()
jit.get_kernel(sm90.variants("sm_90a")[3])
print(f"first compile of the process (includes compiler start-up): {time.time() - t0:.2f}s", flush=True)


def _ab(field: str, reps: int, mod, local: bool = False) -> None:
    """The causal (``local``: window (1024, 0)) configs of forward family ``mod`` (separate loops) with ``field``
    False and True, compiled in turn
    ``reps`` times each, cold (memory and disk caches emptied before each): the compiles'
    medians and minima, which a single run's noise on a shared host does not give."""
    import statistics

    for d in (64, 128, 256):
        kw = dict(local=True, window_left=1024, window_right=0) if local else dict(causal=True)
        p = AttnProblem("bf16", 2, 4096, 4096, 8, 8, d, d, d ** -0.5, **kw)
        base = dataclasses.replace(mod.make_config(p, None, "sm_90a", True), one_step_loop=False)
        times = {False: [], True: []}
        for _ in range(reps):
            for on in (False, True):
                jit._memory.clear()
                shutil.rmtree(os.environ["FA4_CACHE_DIR"], ignore_errors=True)
                os.makedirs(os.environ["FA4_CACHE_DIR"])
                t = time.time()
                jit.get_kernel(dataclasses.replace(base, **{field: on}))
                times[on].append(time.time() - t)
        print(f"{mod.__name__.split('.')[-1]} d{d} {'local' if local else 'causal'} {field} off / on: median {statistics.median(times[False]):.2f} / "
              f"{statistics.median(times[True]):.2f}s, min {min(times[False]):.2f} / {min(times[True]):.2f}s",
              flush=True)


if "--ab" in sys.argv:
    _ab(sys.argv[sys.argv.index("--ab") + 1], int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 3,
        sm80 if "--family" in sys.argv and sys.argv[sys.argv.index("--family") + 1] == "sm80" else sm90,
        "--local" in sys.argv)
    sys.exit(0)


def _last_parts():
    """(compile, export, load) seconds of the last cold get_kernel (jit's stats), or None."""
    last = jit._stats.last or {}
    if last.get("event") != "compile" or "load_seconds" not in last:
        return None
    exp = last.get("export_seconds", 0.0)
    return last["seconds"] - exp, exp, last["load_seconds"]


def _split() -> str:
    parts = _last_parts()
    return " (compile {:.2f}, export {:.2f}, load {:.2f})".format(*parts) if parts else ""


def _cold(cfg) -> float:
    """Seconds of one cold ``get_kernel(cfg)``: memory and disk caches emptied first."""
    jit._memory.clear()
    shutil.rmtree(os.environ["FA4_CACHE_DIR"], ignore_errors=True)
    os.makedirs(os.environ["FA4_CACHE_DIR"])
    t = time.time()
    jit.get_kernel(cfg)
    dt = time.time() - t
    _parts.setdefault(cfg, []).append(_last_parts() or (dt, 0.0, 0.0))
    return dt


_parts = {}  # cfg -> [(compile, export, load)] of the cold rounds


# --reps N (N > 1): each sm90 default below compiled cold N times in turn (rounds), its median and
# minimum printed after its first time; one run's noise on a shared host decides nothing (v0.59).
_reps = int(sys.argv[sys.argv.index("--reps") + 1]) if "--reps" in sys.argv else 1
_defaults = []
for d in (64, 128, 256):
    for causal in (False, True):
        p = AttnProblem("bf16", 2, 4096, 4096, 8, 8, d, d, d ** -0.5, causal=causal)
        for mod in (sm90, sm80):
            cfg = mod.make_config(p, None, "sm_90a", True)
            t = time.time()
            jit.get_kernel(cfg)
            print(f"{mod.__name__.split('.')[-1]} d{d} causal={causal}: {time.time() - t:.2f}s{_split()}", flush=True)
            if mod is sm90:
                _defaults.append((f"sm90 d{d} causal={causal}", cfg))
if _reps > 1:
    import statistics

    _times = {name: [] for name, _ in _defaults}
    for _ in range(_reps):
        for name, cfg in _defaults:
            _times[name].append(_cold(cfg))
    for name, cfg in _defaults:
        ts = _times[name]
        print(f"{name}, {_reps} cold rounds: median {statistics.median(ts):.2f}s, min {min(ts):.2f}s "
              f"({' '.join(f'{t:.2f}' for t in ts)}); medians of compile / export / load "
              f"{' / '.join(f'{statistics.median(x):.2f}' for x in zip(*_parts[cfg]))}s", flush=True)
_timed = {cfg for _, cfg in _defaults}
# The masked sm90 kernels over the 2 s bar, with one step body (one_step_loop) beside (v0.29; d64 since v0.43)
# and the first block folded into the masked loop (fold_first, v0.44).
for d in (64, 128, 192, 256):
    for mask in ("causal", "local"):
        kw = dict(causal=True) if mask == "causal" else dict(local=True, window_left=1024, window_right=0)
        cfg = sm90.make_config(AttnProblem("bf16", 2, 4096, 4096, 8, 8, d, d, d ** -0.5, **kw), None, "sm_90a", True)
        for how in ("", "one_step_loop", "fold_first"):
            c = dataclasses.replace(cfg, one_step_loop=how == "one_step_loop", fold_first=how == "fold_first")
            if c in _timed or c in jit._memory:
                print(f"sm90 d{d} {mask} {how or 'separate first block'}: the default, timed above", flush=True)
                continue
            t = time.time()
            jit.get_kernel(c)
            print(f"sm90 d{d} {mask} {how or 'separate first block'}: {time.time() - t:.2f}s", flush=True)
