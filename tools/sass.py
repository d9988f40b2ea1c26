"""SASS of a kernel config, compiled here on the CPU: registers, stack, and an opcode census.

    python tools/sass.py bwd --hd 256 [--arch sm_90a] [--set causal=True --set tile_n=128] [--out f.sass]

``bwd`` / ``bwd90`` / ``fwd`` / ``fwd90`` / ``post``: the sm80 or sm90 backward (its make_config for a head dim), the sm80
forward, the sm90 forward, or the backward's postprocess. ``--set`` overrides config fields (Python
literals). Prints the opcode counts
that matter for these kernels (MMA, ldmatrix, shared/global/local memory, reductions, barriers) so
two versions can be compared without a GPU; ``--out`` keeps the full listing. Needs nvdisasm (the
``nvidia-cuda-nvdisasm`` wheel).

The listing is the installed DSL flavor's ptxas's. The GPU machine's bundle has the cu13 flavor and
a default install here the cu12 one; their schedules differ (RESULTS v0.57). For the device's SASS,
run this from a venv (``--system-site-packages``) holding ``nvidia-cutlass-dsl``,
``nvidia-cutlass-dsl-libs-base``, ``-libs-core`` and ``-libs-cu13`` of the pinned version
(``pip install --ignore-installed --no-deps``); with no driver the DSL takes the newest flavor.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("kind", choices=("bwd", "bwd90", "fwd", "fwd90", "post"))
    ap.add_argument("--hd", type=int, default=128)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="field=value")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.setdefault("CUTE_DSL_ARCH", args.arch)

    from fa4.bwd import postprocess
    from fa4.bwd import sm80 as bwd
    from fa4.bwd import sm90 as bwd90
    from fa4.config import AttnProblem
    from fa4.fwd import sm80 as fwd
    from fa4.fwd import sm90 as fwd90
    from fa4.sass import count, disassemble, opcode_counts

    p = AttnProblem("bf16", 2, 1024, 1024, 8, 8, args.hd, args.hd, args.hd**-0.5, causal=args.causal)
    if args.kind == "fwd":
        cfg = fwd.make_config(p, None, args.arch, True)
    elif args.kind == "fwd90":
        cfg = fwd90.make_config(p, None, args.arch, True)
    elif args.kind == "bwd90":
        cfg = bwd90.make_config(p, None, args.arch, args.deterministic)
    else:
        cfg = bwd.make_config(p, None, args.arch, args.deterministic)
    cfg = dataclasses.replace(cfg, **{k: ast.literal_eval(v) for k, v in (s.split("=", 1) for s in args.set)})
    if args.kind == "post":
        cfg = postprocess.config_for(cfg)
    print(cfg.key())
    sass = disassemble(cfg)
    if args.out:
        open(args.out, "w").write(sass)
    ops = opcode_counts(sass)
    keys = ("HMMA", "HGMMA", "UTMALDG", "UTMASTG", "LDSM", "STSM", "LDS", "STS", "LDG", "STG", "LDGSTS", "RED", "REDG",
            "ATOM", "LDL", "STL", "BAR", "SYNCS", "MUFU", "SHFL", "USETMAXREG")
    summary = {k: count(ops, k) for k in keys}
    print("instructions:", sum(ops.values()), summary)


if __name__ == "__main__":
    main()
