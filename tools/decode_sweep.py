"""Decode sweep (issue 9): fa4's forward on the decode shapes, contiguous and paged (16-row pages,
shuffled), over K/V stages and split counts; median of triton's do_bench, microseconds and K + V
TB/s.  ``python3 tools/decode_sweep.py [--order | --grid | --pdl]``: with ``--pdl``, the split calls'
combine launched early and not (``pdl_check``); with ``--grid``, the decode tile's K
rows, stages and grid (``grid_check``); with ``--order``, only the default config,
paged with the pages shuffled and in order (does the page order, i.e. DRAM locality, cost the
paged cache its last percent?). (v0.12 removed ``--pages-ahead``, the timing of a rejected option.)"""
import itertools
import sys

import torch
import triton

import fa4
from fa4.bench import DECODE_SHAPES, PAGE_SIZE, paged_cache
from fa4.testing import random_qkv


def order_check():
    for shape in DECODE_SHAPES:
        q, k, v = random_qkv(shape.batch, 1, shape.seqlen_k, shape.heads, shape.hk, shape.hdim, torch.bfloat16,
                             "cuda", seed=0)
        cells = [f"contig {triton.testing.do_bench(lambda: fa4.flash_attn_func(q, k, v), warmup=25, rep=300) * 1e3:6.1f} us"]
        for shuffle in (True, False):
            kc, vc, table, used = paged_cache(k, v, PAGE_SIZE, shuffle)
            ms = triton.testing.do_bench(lambda: fa4.flash_attn_varlen_func(q, kc, vc, page_table=table,
                                                                            seqused_k=used), warmup=25, rep=300)
            cells.append(f"paged16 {'shuffled' if shuffle else 'in order'} {ms * 1e3:6.1f} us")
            del kc, vc
        print(f"b{shape.batch} sk{shape.seqlen_k}: " + "; ".join(cells), flush=True)


def decode_calls(layouts):
    """``{shape: {layout: call}}`` over DECODE_SHAPES: fa4's default forward on one random decode step
    per shape, K / V contiguous (``contig``), in a shuffled paged cache of 16-row pages (``paged16``),
    or contiguous with ``seqused_k`` (``seqused``); ``layouts`` picks and orders them."""
    data = {}
    for shape in DECODE_SHAPES:
        q, k, v = random_qkv(shape.batch, 1, shape.seqlen_k, shape.heads, shape.hk, shape.hdim, torch.bfloat16,
                             "cuda", seed=0)
        kc, vc, table, used = paged_cache(k, v, PAGE_SIZE)
        calls = {"contig": lambda q=q, k=k, v=v: fa4.flash_attn_func(q, k, v),
                 "paged16": lambda q=q, kc=kc, vc=vc, t=table, u=used: fa4.flash_attn_varlen_func(
                     q, kc, vc, page_table=t, seqused_k=u),
                 "seqused": lambda q=q, k=k, v=v, u=used: fa4.flash_attn_varlen_func(q, k, v, seqused_k=u)}
        data[shape] = {name: calls[name] for name in layouts}
    return data


def grid_check(rounds: int = 3):
    """``--grid``: the decode shapes, contiguous and paged (16-row pages), over the tile's K rows and
    grid, interleaved rounds: the default, the prefill tiles' blocks and grid (``sm90.DECODE_GRID``
    off: 128-row blocks, persistent; the dynamic grid for paged rows with seqused_k), the 64-row
    blocks on the persistent grid, and 128-row blocks one CTA per tile. Since v0.28 the default is
    64-row blocks one CTA per tile for contiguous calls; since v0.29 calls with seqused_k (paged, or
    the contiguous cache with seqused_k, ``seqused``) take the table's 128-row blocks one CTA per tile
    (so there "default" and "128-row blocks" are the same config)."""
    import dataclasses

    from fa4.fwd import sm90

    make = sm90.make_config
    variants = [("default", None, {}), ("prefill grid", False, {}),
                ("persistent", None, dict(persistent=True)), ("128-row blocks", None, dict(tile_n=128))]
    data = decode_calls(("contig", "paged16", "seqused"))
    for rnd in range(rounds):
        for shape, calls in data.items():
            for layout, call in calls.items():
                cells = []
                for name, grid, over in variants[rnd % len(variants):] + variants[:rnd % len(variants)]:
                    if grid is not None:
                        sm90.DECODE_GRID = grid
                    sm90.make_config = lambda *a, over=over, **kw: dataclasses.replace(make(*a, **kw), **over)
                    fa4.ops._plans.clear()
                    try:
                        ms = triton.testing.do_bench(call, warmup=25, rep=300)
                        cell = f"{ms * 1e3:6.1f} us"
                    except Exception as e:  # noqa: BLE001 - a variant may not fit shared memory
                        cell = f"n/a ({type(e).__name__}: {str(e)[:50]})"
                    cells.append(f"{name}: {cell}")
                    sm90.DECODE_GRID = True
                sm90.make_config = make
                fa4.ops._plans.clear()
                print(f"r{rnd + 1} b{shape.batch} sk{shape.seqlen_k} {layout}: " + "; ".join(cells), flush=True)


def pdl_check(rounds: int = 5):
    """``--pdl``: the decode shapes, contiguous and paged (16-row pages), with the split
    call's combine launched as a programmatic dependent of the forward (``sm90.SPLIT_PDL``, Note
    [Combine launched early] in fa4/combine.py) and without, interleaved rounds (the order rotated per
    round). Shapes whose default does not split print the same config twice."""
    from fa4.fwd import sm90

    data = decode_calls(("contig", "paged16"))
    default = sm90.SPLIT_PDL
    modes = [False, True]
    for rnd in range(rounds):
        for shape, calls in data.items():
            for layout, call in calls.items():
                cells = []
                for on in modes[rnd % 2:] + modes[:rnd % 2]:
                    sm90.SPLIT_PDL = on
                    fa4.ops._plans.clear()
                    ms = triton.testing.do_bench(call, warmup=25, rep=300)
                    cells.append(f"pdl={on}: {ms * 1e3:6.2f} us")
                sm90.SPLIT_PDL = default
                fa4.ops._plans.clear()
                print(f"r{rnd + 1} b{shape.batch} sk{shape.seqlen_k} {layout}: " + "; ".join(cells), flush=True)


if "--pdl" in sys.argv:
    pdl_check()
    sys.exit(0)
if "--order" in sys.argv:
    order_check()
    sys.exit(0)
if "--grid" in sys.argv:
    grid_check()
    sys.exit(0)

for shape in DECODE_SHAPES:
    q, k, v = random_qkv(shape.batch, 1, shape.seqlen_k, shape.heads, shape.hk, shape.hdim, torch.bfloat16, "cuda",
                         seed=0)
    kc, vc, table, used = paged_cache(k, v, PAGE_SIZE)
    for stages, splits in itertools.product((2, 3), (None, 1, 2, 4)):
        opts = fa4.KernelOptions(num_stages=stages)
        calls = {
            "contig": lambda: fa4.flash_attn_func(q, k, v, num_splits=splits, kernel_options=opts),
            "paged16": lambda: fa4.flash_attn_varlen_func(q, kc, vc, page_table=table, seqused_k=used,
                                                          num_splits=splits, kernel_options=opts),
        }
        cells = []
        for name, fn in calls.items():
            ms = triton.testing.do_bench(fn, warmup=25, rep=200)
            cells.append(f"{name} {ms * 1e3:6.1f} us {shape.kv_bytes / ms / 1e9:4.2f} TB/s")
        print(f"b{shape.batch} sk{shape.seqlen_k} stages={stages} splits={splits}: " + "; ".join(cells), flush=True)
