"""Time forward config variants (sm90 by default, ``--family sm80`` too) on the standard grid
(GPU): every candidate is compiled in parallel first (disk cache), then each grid row times the
default config and its variants with the median of ``triton.testing.do_bench``, fa4 only (peers:
``python -m fa4.bench``).

    python tools/sweep_fwd.py [--hdim 64,128] [--seqlen 8192] [--causal yes|no] [--window W] [--any-pair] [--repeat 3] [--jobs 15] VARIANT ...

A VARIANT is ``name:field=value,field=value`` of :class:`fa4.fwd.sm90.FwdSm90Config` fields, e.g.
``np:persistent=False,dynamic_sched=False`` (the plain grid; ``dynamic_sched`` needs ``persistent``) or
``n176:tile_n=176``; ``hd=64,128`` inside a variant limits it to those
head dims and ``causal=yes|no`` to one mask. ``--repeat N`` times every cell N times in interleaved
rounds (all cells once, then again) and prints the median, for choices within the run-to-run noise.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures as cf
import dataclasses

import torch


def _parse(spec):
    name, _, body = spec.partition(":")
    fields, hd, causal = {}, None, None
    for item in filter(None, body.split(",")):
        k, v = item.split("=", 1)
        if k == "hd":
            hd = [int(x) for x in v.split("/")]
        elif k == "causal":
            causal = v == "yes"
        else:
            fields[k] = ast.literal_eval(v)
    return name, fields, hd, causal


WINDOW = None  # --window W: the non-causal rows with a sliding window (W, 0) instead


def _problem(shape):
    from fa4.config import AttnProblem

    mask = dict(causal=shape.causal) if WINDOW is None else dict(local=True, window_left=WINDOW, window_right=0)
    return AttnProblem("bf16", shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.heads, shape.hdim,
                       shape.hdim, shape.hdim ** -0.5, **mask)


def _precompile(cfg):
    from fa4 import jit

    try:
        jit.precompile(cfg)
        return None
    except Exception as e:  # noqa: BLE001 - report and go on
        return f"{cfg.key()}: {type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    import importlib

    from fa4 import bench, jit

    ap = argparse.ArgumentParser()
    ap.add_argument("--hdim", type=bench._int_list)
    ap.add_argument("--seqlen", type=bench._int_list)
    ap.add_argument("--jobs", type=int, default=15)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--causal", choices=("yes", "no"))
    ap.add_argument("--family", default="sm90", help="forward family module: sm90 or sm80")
    ap.add_argument("--window", type=int, help="the non-causal rows with a sliding window (W, 0); TFLOP/s are then "
                    "nominal (the unmasked rows' FLOPs), for comparing variants only")
    ap.add_argument("--any-pair", action="store_true", help="every --hdim x --seqlen pair, not only the targets "
                    "grid's (the grid's sizes: 16k tokens, heads * head_dim = 2048)")
    ap.add_argument("variants", nargs="*")
    args = ap.parse_args()
    global WINDOW
    WINDOW = args.window
    if WINDOW is not None:
        if args.causal == "yes":
            ap.error("--window runs the non-causal rows with a window; it cannot take --causal yes")
        args.causal = "no"
    if args.any_pair and not (args.hdim and args.seqlen):
        ap.error("--any-pair needs --hdim and --seqlen")
    fam = importlib.import_module(f"fa4.fwd.{args.family}")
    variants = [("default", {}, None, None)] + [_parse(s) for s in args.variants]
    if args.any_pair:  # every (head dim, seqlen) pair asked for, with the grid's sizes (16k tokens, h * d = 2048)
        shapes = [bench.grid_shape(d, n, c) for d in args.hdim for n in args.seqlen for c in (False, True)]
    else:
        shapes = bench.select_grid(args.hdim, args.seqlen)
    plan = []
    if args.causal:
        shapes = [sh for sh in shapes if sh.causal == (args.causal == "yes")]
    if not shapes:  # (a GPU lease must not time nothing in silence)
        ap.error("no row of the targets grid has these --hdim / --seqlen / --causal values; --any-pair times "
                 "every pair asked for")
    for shape in shapes:
        base = fam.make_config(_problem(shape), None, "sm_90a", False)
        for name, fields, hd, causal in variants:
            if (hd and shape.hdim not in hd) or (causal is not None and causal != shape.causal):
                continue
            try:
                cfg = dataclasses.replace(base, **fields)
                jit.kernel_class(cfg).can_implement(cfg)
            except ValueError as e:
                print(f"skip {name} d{shape.hdim}: {e}")
                continue
            plan.append((shape, name, cfg))
    cfgs = list(dict.fromkeys(c for _, _, c in plan))
    with cf.ProcessPoolExecutor(args.jobs) as ex:
        for err in ex.map(_precompile, cfgs):
            if err:
                print("compile failed:", err)
    timer = bench.default_timer()
    from fa4 import ops

    rows: dict = {}
    inputs = {}
    names = [v[0] for v in variants]
    for rnd in range(args.repeat):
        for shape, name, cfg in plan:
            if shape not in inputs:
                q, k, v, _ = bench._inputs(shape, torch.bfloat16, "cuda", 0)
                inputs[shape] = (q, k, v, torch.empty_like(q))
            q, k, v, out = inputs[shape]
            problem = _problem(shape)
            cell = rows.setdefault(bench.shape_label(shape), {}).setdefault(name, [])
            try:
                fn = lambda: fam.run(cfg, problem, q, k, v, out, None)  # noqa: E731
                fn()
                cell.append(bench.tflops(shape, "fwd", timer(fn)))
            except Exception as e:  # noqa: BLE001
                cell.append(float("nan"))
                print(f"{name} {bench.shape_label(shape)}: {type(e).__name__}: {str(e)[:200]}")
        if args.repeat > 1 and rnd < args.repeat - 1:  # a run cut short still leaves its rounds so far
            print(f"-- after round {rnd + 1} of {args.repeat}")
            _print_table(rows, names)
    _print_table(rows, names)
    del ops


def _print_table(rows: dict, names: list) -> None:
    """One line per shape: each variant's median TFLOP/s over the rounds so far (and its range)."""
    print("shape | " + " | ".join(names))
    for label, cells in rows.items():
        out = []
        for n in names:
            vals = sorted(cells.get(n, []))
            out.append(f"{vals[len(vals) // 2]:.1f}" + (f" ({vals[0]:.0f}-{vals[-1]:.0f})" if len(vals) > 1 else "")
                       if vals else "-")
        print(label + " | " + " | ".join(out), flush=True)


if __name__ == "__main__":
    main()
