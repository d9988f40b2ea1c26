"""Where the host's time of one attention call goes (issue 8: the backward's do_bench figure includes
the host's time where the host is behind the device). Per implementation and row: the host's time per
call while the device is kept busy (``torch.cuda._sleep`` first, so no call waits for the device), and
a cProfile of those calls (the top functions by own time). ``python3 tools/host_profile.py [fwd|bwd]
d,s,causal ...``."""
import cProfile
import io
import pstats
import sys

import torch

from bwd_profile import host_us, row_inputs
from fa4.bench import _results, fa4_impl, flash_attn4_impl, sdpa_impl


def busy_profile(fn, calls: int, top: int) -> str:
    """A cProfile of ``calls`` calls of ``fn`` on this thread, the device kept busy (no call waits for
    it), its ``top`` functions by own time."""
    prof = cProfile.Profile()
    torch.cuda._sleep(int(2e9))
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def main(direction, rows):
    for row in rows:
        d, s, causal, _, q, k, v, dout = row_inputs(row)
        print(f"== {direction} d{d} s{s} causal={bool(causal)}", flush=True)
        for impl in (fa4_impl({}, False), fa4_impl({}, True, name="fa4-det"), flash_attn4_impl(False),
                     sdpa_impl("cudnn", "CUDNN_ATTENTION")):
            prepared = impl.setup(q, k, v, bool(causal), direction == "bwd")
            with prepared.context():
                fn, _ = _results(prepared, direction, dout)
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                times = sorted(host_us(fn, 30, busy=True) for _ in range(3))
                print(f"{impl.name:14s} host per call (us, 3 rounds): {' / '.join(f'{t:.1f}' for t in times)}",
                      flush=True)
                if impl.name.startswith("fa4") and impl.name != "fa4-det":
                    print(busy_profile(fn, 30, 22), flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    direction = args.pop(0) if args and args[0] in ("fwd", "bwd") else "bwd"
    main(direction, args or ["128,1024,1"])
