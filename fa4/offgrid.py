"""fa4 against flash-attn-4 (and SDPA cuDNN where it takes the call) on shapes users run that the
standard grid of ``python -m fa4.bench`` leaves out: varlen batches, GQA / MQA, short and very long
sequences, prefill against a longer cache (GPU).

    python -m fa4.bench --offgrid [--cases NAME,NAME] [--mode fwd,bwd] [--deterministic] [--repeats N]
                                  [--arch sm80] [--set fwd.dynamic_sched=True --set bwd.kv_split=4 ...]
                                  [--variant "fwd.l2_section_mb=0" --variant "fwd.l2_section_mb=16 ..." --rounds 3]

Cases ending in ``-nomax`` make their varlen calls without ``max_seqlen_q`` / ``max_seqlen_k``, as
flash_attn.cute allows (fa4 then sizes its grids by the packed token count). Cases starting with
``mods-`` pass a user ``score_mod`` (with its ``score_mod_bwd``) / ``mask_mod`` (with ``aux_tensors``)
to fa4 and flash-attn-4 alike.
(``python -m fa4.offgrid`` and ``tools/offgrid.py`` are the same.) TFLOP/s count the (query, key)
pairs a mask keeps exactly (per sequence for varlen): forward ``4 * h * d * pairs``, backward 2.5x.
Medians of ``triton.testing.do_bench``; the backward is timed as in fa4.bench (forward once, then
``torch.autograd.grad`` with ``retain_graph``). ``maxdiff`` is each implementation's largest
difference from the first one's output / gradients (a sanity check, not the accuracy test).
flash-attn-4 is optional: n/a when it is not installed.

Tuning aids (they patch the family's ``make_config`` in this process): ``--set DIR.FIELD=VALUE``
replaces a field of fa4's config for that direction, to time a variant beside the peers;
``--variant "ITEM ITEM"`` (repeatable) times fa4 under each set of such items, interleaved with the
plain defaults over ``--rounds`` rounds in one process (the peers once per case and round, the
variants' order rotated per round); besides config fields an item may be ``bwd.section=N`` (the
backward's launch sections, ``LAUNCH_ORDER.section`` / ``det_section``, a runtime argument; the
rotated deterministic order ignores it: its sections are one pair per round).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import itertools
import random
import statistics
import sys

import torch

import fa4
from fa4 import bench

# name: (seqlens_q, seqlens_k (None: as q), heads, heads_k, head_dim, causal, varlen)
CASES = {
    "varlen-d128": ("mixed", None, 16, 16, 128, False, True),
    "varlen-d64": ("mixed", None, 32, 32, 64, False, True),
    "varlen-d128-causal": ("mixed", None, 16, 16, 128, True, True),
    "varlen-d64-causal": ("mixed", None, 32, 32, 64, True, True),
    "varlen-gqa-d128-causal": ("mixed", None, 32, 8, 128, True, True),
    "varlen-gqa-d64-causal": ("mixed", None, 32, 8, 64, True, True),
    "varlen-gqa-d256-causal": ("mixed", None, 8, 2, 256, True, True),
    "gqa-d64-s4k-causal": ([4096] * 4, None, 32, 8, 64, True, False),
    "gqa-d256-s4k-causal": ([4096] * 4, None, 8, 2, 256, True, False),
    "gqa8-d128-s4k-causal": ([4096] * 2, None, 64, 8, 128, True, False),  # Llama-3-70B's 64 / 8 heads
    "varlen-gqa8-d128-causal": ("mixed", None, 64, 8, 128, True, True),
    "varlen-gqa7-d128-causal": ("mixed", None, 28, 4, 128, True, True),  # Qwen2.5-7B's 28 / 4 heads
    "gqa7-d128-s4k-causal": ([4096] * 2, None, 28, 4, 128, True, False),
    "gqa-d128-s4k": ([4096] * 4, None, 32, 8, 128, False, False),
    "gqa-d128-s4k-causal": ([4096] * 4, None, 32, 8, 128, True, False),
    "mqa-d128-s8k-causal": ([8192] * 2, None, 16, 1, 128, True, False),
    "d128-s2k-causal": ([2048] * 8, None, 16, 16, 128, True, False),
    "d128-s512": ([512] * 32, None, 16, 16, 128, False, False),
    "d128-s32k-causal": ([32768], None, 16, 16, 128, True, False),
    "prefill-cache-d128": ([1024] * 4, [8192] * 4, 32, 8, 128, True, False),
    "varlen-decode": ([1] * 64, [8192] * 64, 32, 8, 128, False, True),
}
# flash_attn.cute-style calls without max_seqlen_q / max_seqlen_k (Hugging Face callers pass 0-dim
# GPU tensors): fa4 then sizes its grids by the packed token count, an upper bound (v0.29).
NOMAX = "-nomax"
CASES.update({name + NOMAX: CASES[name] for name in ("varlen-d128", "varlen-d128-causal", "varlen-gqa-d128-causal",
                                                     "varlen-decode")})


# User score / mask functions (fa4/mods.py; flash_attn.cute's conventions, so flash-attn-4 takes the
# same calls): name -> (shape case, the function's kwargs made for q). TFLOP/s count the window's pairs
# (what a mask_mod hides is counted too): the same count for every implementation. A mask_mod never
# comes with causal (flash_attn.cute ignores causal then; fa4 refuses the pair).
def _alibi(q):
    import cutlass.cute as cute

    @cute.jit
    def alibi(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return scores - (h + 1).to(cute.Float32) * 0.0625 * (q_idx - kv_idx).to(cute.Float32)
    return dict(score_mod=alibi, score_mod_bwd=_shift_bwd())


def _shift_bwd():
    """The derivative of a score plus a constant (the backward of the two bias cases)."""
    import cutlass.cute as cute

    @cute.jit
    def shift_bwd(grad, scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return grad
    return shift_bwd


def _doc_ids(q, doc: int = 1024):
    import cutlass.cute as cute

    b, s = q.shape[0], q.shape[1]
    g = torch.Generator(q.device).manual_seed(1)
    ids = torch.cumsum((torch.rand(b, s, device=q.device, generator=g) < 1.0 / doc).int(), dim=1).int()

    @cute.jit
    def same_doc(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        d = aux_tensors[0]
        # A one-element vector, as flash_attn.cute reads a mask_mod's result (fa4 takes a scalar too).
        return (kv_idx - kv_idx + (d[b[0], q_idx[0]] - d[b[0], kv_idx[0]])) == 0
    return dict(mask_mod=same_doc, aux_tensors=[ids])


def _rel_bias(q):
    import cutlass.cute as cute

    h, s = q.shape[2], q.shape[1]
    g = torch.Generator(q.device).manual_seed(2)
    table = torch.randn(h, 2 * s - 1, device=q.device, generator=g) * 0.5

    @cute.jit
    def rel_bias(scores, b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return scores + aux_tensors[0][h[0], q_idx[0] - kv_idx[0] + (s - 1)]
    return dict(score_mod=rel_bias, score_mod_bwd=_shift_bwd(), aux_tensors=[table])


def _block_doc(q, doc: int = 1024):
    """The document mask of :func:`_doc_ids` with flash_attn.cute's block lists (128 x 128 blocks:
    a (q, k) block pair of one document each is full, of documents that meet is a mask block,
    others are hidden), so a kernel that skips blocks computes about the documents' share."""
    import collections

    kw = _doc_ids(q, doc)
    ids, blk = kw["aux_tensors"][0], 128
    b, s = ids.shape
    first, last = ids.view(b, s // blk, blk)[..., 0], ids.view(b, s // blk, blk)[..., -1]
    meet = (first[:, :, None] <= last[:, None, :]) & (first[:, None, :] <= last[:, :, None])
    whole = meet & (first == last)[:, :, None] & (first == last)[:, None, :] & (first[:, :, None] == first[:, None, :])
    part = meet & ~whole

    def lists(sel):
        order = torch.argsort((~sel).int(), dim=-1, stable=True).int()
        return sel.sum(-1).int()[:, None], order[:, None]
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch as Lists
    except ImportError:
        Lists = collections.namedtuple("BlockSparseTensorsTorch", "mask_block_cnt mask_block_idx full_block_cnt "
                                       "full_block_idx block_size")
    (mc, mi), (fc, fi) = lists(part), lists(whole)
    return dict(kw, block_sparse_tensors=Lists(mask_block_cnt=mc, mask_block_idx=mi, full_block_cnt=fc,
                                               full_block_idx=fi, block_size=(blk, blk)))


USER_FUNCS = {
    "mods-alibi-d128": (([8192] * 2, None, 16, 16, 128, False, False), _alibi),
    "mods-docmask-d128": (([8192] * 2, None, 16, 16, 128, False, False), _doc_ids),
    "mods-relbias-d128-causal": (([8192] * 2, None, 16, 16, 128, True, False), _rel_bias),
    # The same document mask with its block lists (block sparsity, fa4/block_sparse.py).
    "mods-blockdoc-d128": (([8192] * 2, None, 16, 16, 128, False, False), _block_doc),
}
CASES.update({name: case for name, (case, _) in USER_FUNCS.items()})


def mixed_lengths(total: int = 16384, lo: int = 128, hi: int = 4096, seed: int = 0) -> list[int]:
    """Random sequence lengths in [lo, hi] (odd ones included) summing to ``total``."""
    rng, out = random.Random(seed), []
    while sum(out) < total:
        out.append(min(rng.randint(lo, hi), total - sum(out)))
    return out


def pairs(sq: int, sk: int, causal: bool) -> int:
    """(query, key) pairs a bottom-right causal mask keeps (all when not causal)."""
    if not causal:
        return sq * sk
    return sum(max(0, min(sk, i + sk - sq + 1)) for i in range(sq))


def build(case, device="cuda", dtype=torch.bfloat16, seed=0):
    lq, lk, h, hk, d, causal, varlen = case
    lq = mixed_lengths() if lq == "mixed" else lq
    lk = lk or lq
    g = torch.Generator(device).manual_seed(seed)
    if varlen:
        q = torch.randn(sum(lq), h, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(sum(lk), hk, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(sum(lk), hk, d, device=device, dtype=dtype, generator=g)
    else:
        q = torch.randn(len(lq), lq[0], h, d, device=device, dtype=dtype, generator=g)
        k = torch.randn(len(lk), lk[0], hk, d, device=device, dtype=dtype, generator=g)
        v = torch.randn(len(lk), lk[0], hk, d, device=device, dtype=dtype, generator=g)
    flops = 4 * h * d * sum(pairs(a, b, causal) for a, b in zip(lq, lk))
    return q, k, v, lq, lk, causal, varlen, flops


def callers(q, k, v, lq, lk, causal, varlen, deterministic, arch=None, max_seqlen=True, extra=None):
    """name -> forward callable (returns out) on leaves that may require grad. ``max_seqlen=False``:
    varlen calls without max_seqlen_q / max_seqlen_k (the ``-nomax`` cases). ``extra``: keyword
    arguments of fa4's and flash-attn-4's calls (user functions; SDPA is then left out)."""
    out = {}
    extra = extra or {}
    opts = fa4.KernelOptions(arch=arch) if arch else None
    cu = lambda ls: torch.tensor([0] + list(itertools.accumulate(ls)), dtype=torch.int32, device=q.device)  # noqa: E731
    cq, ck = cu(lq), cu(lk)
    if varlen:
        kw = dict(cu_seqlens_q=cq, cu_seqlens_k=ck, causal=causal, deterministic=deterministic)
        if max_seqlen:
            kw.update(max_seqlen_q=max(lq), max_seqlen_k=max(lk))
        out["fa4"] = lambda: fa4.flash_attn_varlen_func(q, k, v, kernel_options=opts, **kw)[0]
        try:
            from flash_attn.cute import flash_attn_varlen_func as peer
            out["flash-attn-4"] = lambda: peer(q, k, v, **kw)[0]
        except ImportError:
            pass
    else:
        out["fa4"] = lambda: fa4.flash_attn_func(q, k, v, causal=causal, deterministic=deterministic,
                                                 kernel_options=opts, **extra)[0]
        try:
            from flash_attn.cute import flash_attn_func as peer
            out["flash-attn-4"] = lambda: peer(q, k, v, causal=causal, deterministic=deterministic, **extra)[0]
        except ImportError:
            pass
        if not deterministic and not extra and (not causal or q.shape[1] == k.shape[1]):
            from torch.nn.attention import SDPBackend, sdpa_kernel
            from torch.nn.functional import scaled_dot_product_attention as sdpa

            qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
            gqa = dict(enable_gqa=True) if q.shape[2] != k.shape[2] else {}

            def cudnn():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return sdpa(qt, kt, vt, is_causal=causal, **gqa).transpose(1, 2)
            out["sdpa-cudnn"] = cudnn
    return out


def parse_items(items) -> dict:
    """["fwd.a=1", "bwd.section=4"] -> {"fwd": {"a": 1}, "bwd": {...}, "section": 4 or None}."""
    over: dict = {"fwd": {}, "bwd": {}, "section": None}
    for item in items:
        key, _, value = item.partition("=")
        direction, _, field = key.partition(".")
        if direction not in ("fwd", "bwd") or not field or not value:
            raise SystemExit(f"--set / --variant: {item!r} is not DIR.FIELD=VALUE with DIR fwd or bwd")
        if (direction, field) == ("bwd", "section"):
            over["section"] = int(value)
        else:
            over[direction][field] = ast.literal_eval(value)
    return over


class Overrides:
    """The families' make_config wrapped once; :meth:`use` swaps which fields (and backward launch
    sections) apply, and clears fa4's plan cache so the next call takes them."""

    def __init__(self, family: str):
        self.mods = {d: importlib.import_module(f"fa4.{d}.{family}") for d in ("fwd", "bwd")}
        self.current = parse_items([])
        self.originals = {d: mod.make_config for d, mod in self.mods.items()}
        for direction, mod in self.mods.items():
            make = mod.make_config

            def wrapped(*a, make=make, direction=direction, **k):
                fields = self.current[direction]
                cfg = make(*a, **k)
                return dataclasses.replace(cfg, **fields) if fields else cfg
            mod.make_config = wrapped
        order = getattr(self.mods["bwd"], "LAUNCH_ORDER", None)
        self.order, self.saved = order, ((order.section, order.det_section) if order else None)

    def restore(self) -> None:
        """The families' own make_config and launch sections again."""
        for direction, mod in self.mods.items():
            mod.make_config = self.originals[direction]
        if self.order is not None:
            self.order.section, self.order.det_section = self.saved
        fa4.ops._plans.clear()

    def use(self, over: dict) -> None:
        self.current = over
        if self.order is not None:
            sec = over["section"]
            self.order.section, self.order.det_section = self.saved if sec is None else (sec, sec)
        fa4.ops._plans.clear()


def time_one(fn, leaves, dout, mode, timer, repeats):
    """(ms, results) of one implementation; the backward is timed as in fa4.bench."""
    if mode == "fwd":
        with torch.no_grad():
            run = fn
            res = [fn()]
    else:
        o = fn()
        run = lambda o=o: torch.autograd.grad(o, leaves, dout, retain_graph=True)  # noqa: E731
        res = list(run())
    return statistics.median(timer(run) for _ in range(repeats)), res


def cell_label(impl: str, text: str) -> str:
    """A timing's label: a peer's name, ``fa4``, or ``fa4[overrides]`` for a variant (the peers run
    beside whichever variant a round puts first, so only fa4's own cells take the variant's name)."""
    return f"fa4[{text}]" if text and impl == "fa4" else impl


def main(argv=None) -> int:
    """Run the survey (``argv``: the command line after ``--offgrid``); the exit code (2 without a GPU)."""
    ap = argparse.ArgumentParser(prog="python -m fa4.bench --offgrid", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--mode", default="fwd,bwd")
    ap.add_argument("--deterministic", action="store_true")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--arch", help="fa4's kernel family (KernelOptions.arch), e.g. sm80; default: the GPU's own")
    ap.add_argument("--set", action="append", default=[], metavar="DIR.FIELD=VALUE",
                    help="override a field of fa4's fwd / bwd config, e.g. fwd.dynamic_sched=True")
    ap.add_argument("--variant", action="append", default=[], metavar='"DIR.FIELD=VALUE ..."',
                    help="a set of overrides timed beside the defaults (with --set on top), interleaved")
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args(sys.argv[1:] if argv is None else list(argv))
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        ap.error(f"--cases: unknown {unknown}; the cases are {list(CASES)}")
    if not torch.cuda.is_available():
        print(bench.NO_GPU_MESSAGE, file=sys.stderr)
        return bench.EXIT_NO_GPU
    if args.arch:
        family = args.arch.replace("sm_", "sm").replace("sm90a", "sm90")
    else:  # the family fa4 dispatches to on this GPU (the modules the overrides must patch)
        from fa4.arch import resolve

        family = (resolve("bwd", torch.cuda.get_device_capability(), None, warn=False).family
                  if torch.cuda.is_available() else "sm90")
    hooks = Overrides(family)
    variants = [("", args.set)] + [(text, args.set + text.split()) for text in args.variant]
    timer = bench.default_timer()
    modes = args.mode.split(",")
    print(f"{'case':<26} {'dir':<4} " + "impl: TFLOP/s (ms, maxdiff)")
    for rnd in range(args.rounds):
        for name in args.cases.split(","):
            q, k, v, lq, lk, causal, varlen, flops = build(CASES[name])
            for mode in modes:
                leaves = [t.detach().requires_grad_(mode == "bwd") for t in (q, k, v)]
                dout = torch.randn_like(q)
                cells, ref = [], None
                # Rotated per round, so no variant always runs first (the first timing of a call
                # has read low); the peers run with whichever comes first.
                shift = rnd % len(variants)
                for vi, (text, items) in enumerate(variants[shift:] + variants[:shift]):
                    hooks.use(parse_items(items))
                    fns = callers(*leaves, lq, lk, causal, varlen, args.deterministic, args.arch,
                                  max_seqlen=not name.endswith(NOMAX),
                                  extra=USER_FUNCS[name][1](q) if name in USER_FUNCS else None)
                    for impl, fn in fns.items():
                        if vi and impl != "fa4":
                            continue  # the peers once per case and round
                        label = cell_label(impl, text)
                        try:
                            ms, res = time_one(fn, leaves, dout, mode, timer, args.repeats)
                        except Exception as e:  # noqa: BLE001 - a peer may refuse a shape
                            cells.append(f"{label}: n/a ({type(e).__name__}: {str(e)[:60]})")
                            continue
                        ref = ref or res
                        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(res, ref))
                        tf = flops * (2.5 if mode == "bwd" else 1.0) / (ms * 1e-3) / 1e12
                        cells.append(f"{label}: {tf:.1f} ({ms:.3f}, {diff:.1e})")
                hooks.use(parse_items(args.set))
                tag = f"{name}" + (f" r{rnd + 1}" if args.rounds > 1 else "")
                print(f"{tag:<26} {mode:<4} " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
