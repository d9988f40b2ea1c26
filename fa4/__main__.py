"""Command line: ``python -m fa4 compile --arch sm_80,sm_90a,sm_100a [--head-dim 64,128] [--jobs 2]``.

``compile`` builds every kernel variant fa4 has for the named archs into the disk cache (no GPU
needed: kernels compile with fake tensors) and prints a table: variant, arch, seconds, registers.
A cache built here is used by any machine of that arch with the same fa4 version, DSL version and
kernel sources (Note [Kernel source keys] in fa4/jit.py).
``cache`` prints where the cache lives and what it holds.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def _compile_one(cfg):
    from fa4 import jit

    try:
        return jit.precompile(cfg)
    except Exception as e:  # report and go on: one bad variant must not hide the others
        return {"kernel": type(cfg).__name__, "arch": cfg.arch, "key": cfg.key(), "error": f"{type(e).__name__}: {e}"}


def _short(cfg) -> str:
    d = cfg.describe()
    d.pop("arch", None)
    return " ".join(f"{k}={v}" for k, v in d.items() if v not in (False, None))


def cmd_compile(args) -> int:
    from fa4 import arch as _arch

    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    head_dims = {int(x) for x in args.head_dim.split(",")} if args.head_dim else None
    cfgs = []
    for a in archs:
        for cfg in _arch.all_variants(a):
            hd = getattr(cfg, "head_dim", None)
            if head_dims is None or hd is None or hd in head_dims:
                if args.kernel is None or args.kernel.lower() in type(cfg).__name__.lower():
                    cfgs.append(cfg)
    print(f"compiling {len(cfgs)} kernel variants for {', '.join(archs)} with {args.jobs} job(s)", flush=True)
    t0 = time.time()
    failed = 0
    with ProcessPoolExecutor(max_workers=args.jobs) as ex:
        for cfg, row in zip(cfgs, ex.map(_compile_one, cfgs)):
            if "error" in row:
                failed += 1
                print(f"FAIL {row['kernel']:<22} {row['arch']:<8} {row['error']}", flush=True)
                continue
            src = "cached" if row["cached"] else "built "
            print(f"{src} {row['kernel']:<22} {row['arch']:<8} {row['compile_seconds']:6.2f}s "
                  f"regs={row['registers']!s:<4} stack={row['frame_bytes']!s:<4} {_short(cfg)}", flush=True)
    print(f"{len(cfgs) - failed} ok, {failed} failed, {time.time() - t0:.1f}s wall", flush=True)
    return 1 if failed else 0


def cmd_cache(args) -> int:
    from fa4 import jit

    d = jit.cache_dir()
    entries = sorted(d.glob("*.o")) if d.exists() else []
    print(f"cache dir: {d} ({'enabled' if jit.disk_cache_enabled() else 'disabled by FA4_DISABLE_DISK_CACHE'})")
    print(f"entries: {len(entries)}, {sum(p.stat().st_size for p in entries) / 2**20:.1f} MiB")
    stale = jit.stale_entries(d)
    print(f"stale (built from sources that have changed since): {len(stale)}, "
          f"{sum(p.stat().st_size for p in stale) / 2**20:.1f} MiB")
    if args.prune:
        for obj in stale:
            for path in (obj, obj.with_suffix(".json"), obj.with_suffix(".lock")):
                path.unlink(missing_ok=True)
        print(f"pruned {len(stale)} entries")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m fa4")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="compile kernel variants into the disk cache")
    c.add_argument("--arch", default="sm_80,sm_90a,sm_100a", help="comma-separated targets")
    c.add_argument("--head-dim", default=None, help="only variants with these head dims")
    c.add_argument("--kernel", default=None, help="only variants whose config class name contains this")
    c.add_argument("--jobs", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    c.set_defaults(fn=cmd_compile)
    s = sub.add_parser("cache", help="show the disk cache")
    s.add_argument("--prune", action="store_true", help="remove the entries whose kernel's sources have changed")
    s.set_defaults(fn=cmd_cache)
    args = p.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
