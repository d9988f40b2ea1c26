"""Tuning sweep on a GPU machine: time fa4's kernels under config overrides, in one process.

    python tools/sweep.py PLAN [--jobs 12]

PLAN names a list in PLANS below. Every experiment is (shape, direction, overrides): the overrides
replace fields of the config that ``make_config`` returns (any field, not only those KernelOptions
exposes), so tile shapes, stages and warp layouts can be compared without editing the tuning
tables. All configs are first compiled in parallel into the disk cache, then timed one by one
(median of triton.testing.do_bench), each checked against torch SDPA (flash backend) so a fast
wrong config is visible. Prints one table; the best rows feed the tuning tables by hand.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

import fa4
import fa4.bwd.sm80 as bwd_mod
import fa4.ops
import fa4.fwd.sm80 as fwd_mod
from fa4 import jit
from fa4.validate import check_dense

SM80 = fa4.KernelOptions(arch="sm80")
GRID = [  # (b, s, h, d, causal) of targets.md: 16k tokens, h*d = 2048
    (16, 1024, 16, 128, False), (16, 1024, 16, 128, True), (4, 4096, 16, 128, False), (4, 4096, 16, 128, True),
    (2, 8192, 16, 128, False), (2, 8192, 16, 128, True), (1, 16384, 16, 128, False), (1, 16384, 16, 128, True),
    (2, 8192, 32, 64, False), (2, 8192, 32, 64, True), (2, 8192, 8, 256, False), (2, 8192, 8, 256, True),
]
S128 = [(2, 8192, 16, 128, False), (2, 8192, 16, 128, True), (16, 1024, 16, 128, True)]
S64 = [(2, 8192, 32, 64, False), (2, 8192, 32, 64, True)]
S256 = [(2, 8192, 8, 256, False), (2, 8192, 8, 256, True)]


def _exp(shapes, direction, variants, deterministic=False):
    return [(s, direction, v, deterministic) for s in shapes for v in variants]


PLANS = {
    "bwd": (
        _exp(S128, "bwd", [{}, dict(tile_m=128, tile_n=128, atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=4, num_stages=1),
                           dict(tile_m=64, tile_n=128, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4),
                           dict(tile_m=64, tile_n=128, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2),
                           dict(tile_m=64, tile_n=64, num_threads=128, atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2),
                           dict(tile_m=128, tile_n=64, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=4),
                           dict(num_stages=1)])
        + _exp(S128[:2], "bwd", [{}], deterministic=True)
        + _exp(S64, "bwd", [{}, dict(tile_m=64, tile_n=128, atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2),
                            dict(tile_m=128, tile_n=64, atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=4)])
        + _exp(S256, "bwd", [{}, dict(tile_m=64, tile_n=64, atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2),
                             dict(tile_m=32, tile_n=128, atom_m_sdp=1, atom_n_dkv=4, atom_m_dq=1)])
    ),
    "fwd": (
        _exp(S128, "fwd", [{}, dict(tile_n=32), dict(tile_m=64, tile_n=64), dict(num_stages=2),
                           dict(tile_m=128, tile_n=128, num_threads=256), dict(q_in_regs=True),
                           dict(exp2_emu_frac=0.25), dict(rescale_threshold=0.0)])
        + _exp(S64, "fwd", [{}, dict(tile_n=64), dict(num_stages=2), dict(exp2_emu_frac=0.25)])
        + _exp(S256, "fwd", [{}, dict(tile_m=64, num_threads=128), dict(tile_n=32), dict(num_stages=2)])
    ),
    "bwd2": (
        _exp(S256, "bwd", [{}, dict(atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2), dict(atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2),
                           dict(atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2), dict(atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2,
                                                                               num_stages=1)])
        + _exp(S128[:2], "bwd", [dict(atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2), dict(atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=2)])
        + _exp(S64, "bwd", [dict(atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=2), dict(atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=4)])
    ),
    "det2": (
        _exp(S128[:2] + S64 + S256, "bwd", [{}, {"_det_section": 1}, {"_det_section": 16}, {"_det_section": 10**6}],
             deterministic=True)
        + _exp([(1, 8192, 2, 128, False), (1, 8192, 2, 128, True)], "bwd", [{}], deterministic=False)
        + _exp([(1, 8192, 2, 128, False), (1, 8192, 2, 128, True)], "bwd", [{}, {"_det_section": 1}],
               deterministic=True)
    ),
    "v2": (  # dq_accum in fragment order (all rows) + causal launch sections
        _exp(GRID, "bwd", [{}])
        + _exp([g for g in GRID if g[4]], "bwd", [{"_section": 1}, {"_section": 4}, {"_section": 16}, {"_section": 10**6}])
    ),
    "det3": _exp(GRID, "bwd", [{"_det_section": n} for n in (2, 4, 8, 16, 32)], deterministic=True),
    "det4": (  # LPT + downward m_blocks: defaults side by side, then section sizes
        _exp(GRID, "bwd", [{}]) + _exp(GRID, "bwd", [{}], deterministic=True)
        + _exp([g for g in GRID if g[4]], "bwd", [{"_det_section": 4}, {"_det_section": 64}], deterministic=True)
        + _exp([g for g in GRID if not g[4]], "bwd", [{"_det_section": 16}, {"_det_section": 10**6}],
               deterministic=True)
    ),
    "v2b": (  # hdim 256 warp layouts with the fragment-order dq_accum; deterministic causal sections
        _exp(S256, "bwd", [{}, dict(atom_m_sdp=2, atom_n_dkv=2, atom_m_dq=2), dict(atom_m_sdp=4, atom_n_dkv=4, atom_m_dq=4),
                           dict(atom_m_sdp=2, atom_n_dkv=4, atom_m_dq=2), dict(atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=4),
                           dict(num_stages=1)])
        + _exp([g for g in GRID if g[4]], "bwd", [{}, {"_det_section": 16}, {"_det_section": 256}], deterministic=True)
    ),
    "d192": _exp([(2, 8192, 8, 192, False), (2, 8192, 8, 192, True)], "bwd",
                 [{}, dict(atom_m_sdp=4, atom_n_dkv=2, atom_m_dq=2)]),
    "grid": _exp(GRID, "fwd", [{}]) + _exp(GRID, "bwd", [{}]),
    "emu": _exp(GRID, "fwd", [dict(exp2_emu_frac=0.25), dict(rescale_threshold=0.0),
                              dict(exp2_emu_frac=0.25, rescale_threshold=0.0)]),
    "det": _exp(GRID, "bwd", [{}], deterministic=True),
}


def _problem(shape):
    b, s, h, d, causal = shape
    q = torch.empty(b, s, h, d, dtype=torch.bfloat16, device="meta")
    from fa4.validate import allow_any_device

    with allow_any_device():
        return check_dense(q, q, q, None, causal, (None, None), 0.0)


def _configs(shape, direction, over, deterministic):
    over = {k: v for k, v in over.items() if not k.startswith("_")}
    p = _problem(shape)
    if direction == "fwd":
        return [dataclasses.replace(fwd_mod.make_config(p, SM80, "sm_90a", False), **over)]
    return [dataclasses.replace(bwd_mod.make_config(p, SM80, "sm_90a", deterministic), **over)]


def _precompile(cfg):
    try:
        return jit.precompile(cfg)
    except Exception as e:
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _timed(fn):
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def run_experiment(shape, direction, over, deterministic):
    b, s, h, d, causal = shape
    orig = fwd_mod.make_config if direction == "fwd" else bwd_mod.make_config
    mod = fwd_mod if direction == "fwd" else bwd_mod
    det_section, section = over.get("_det_section"), over.get("_section")
    over = {k: v for k, v in over.items() if not k.startswith("_")}
    order = bwd_mod.LAUNCH_ORDER
    old_sections = order.det_section, order.section
    order.det_section, order.section = det_section, section

    def patched(*a, **k):
        return dataclasses.replace(orig(*a, **k), **over)

    mod.make_config = patched
    fa4.ops._plans.clear()  # configs are planned once per call signature: re-plan with the overrides
    try:
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        flops = 4 * b * h * s * s * d / (2 if causal else 1)
        qt, kt, vt = (t.detach().transpose(1, 2).requires_grad_() for t in (q, k, v))
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)
        if direction == "fwd":
            with torch.no_grad():
                out, _ = fa4.flash_attn_func(q, k, v, causal=causal, kernel_options=SM80)
                ms = _timed(lambda: fa4.flash_attn_func(q, k, v, causal=causal, kernel_options=SM80))
            diff = float((out - ref.transpose(1, 2)).abs().max())
        else:
            out, _ = fa4.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic, kernel_options=SM80)
            g = torch.randn_like(out)
            grads = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
            ms = _timed(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
            rg = torch.autograd.grad(ref, (qt, kt, vt), g.transpose(1, 2))
            diff = max(float((a - r.transpose(1, 2)).abs().max()) for a, r in zip(grads, rg))
            flops *= 2.5
        return ms, flops / ms / 1e9, diff
    finally:
        mod.make_config = orig
        fa4.ops._plans.clear()
        order.det_section, order.section = old_sections


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("plans", help="comma-separated names of PLANS")
    ap.add_argument("--jobs", type=int, default=12)
    args = ap.parse_args()
    exps = [e for name in args.plans.split(",") for e in PLANS[name]]
    cfgs = {c.key(): c for e in exps for c in _configs(*e)}
    print(f"{len(exps)} experiments, {len(cfgs)} configs to compile", flush=True)
    with ProcessPoolExecutor(args.jobs) as ex:
        for row in ex.map(_precompile, cfgs.values()):
            if "error" in row:
                print("compile error:", row["error"], flush=True)
    print(f"{'shape':<26} {'dir':<4} {'det':<3} {'TFLOP/s':>8} {'ms':>8} {'maxdiff':>8}  overrides", flush=True)
    for shape, direction, over, det in exps:
        try:
            ms, tf, diff = run_experiment(shape, direction, over, det)
            print(f"{str(shape):<26} {direction:<4} {'y' if det else 'n':<3} {tf:8.1f} {ms:8.3f} {diff:8.1e}  {over}",
                  flush=True)
        except Exception as e:
            print(f"{str(shape):<26} {direction:<4} ERR {type(e).__name__}: {str(e)[:200]}  {over}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
