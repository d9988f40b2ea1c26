"""Benchmark fa4 against its peers, side by side in one run: ``python -m fa4.bench --help``.

Throughput mode (default): FlashAttention's standard grid from ``docs/targets.md`` -- bf16,
batch * seqlen = 16384 tokens, heads * head_dim = 2048 -- forward and/or backward, in TFLOP/s
(forward ``4 * b * h * sq * sk * d``, halved when causal; backward 2.5x the forward) from the median
of ``triton.testing.do_bench`` (CUDA events when triton is missing). The backward is timed alone:
the forward runs once, then ``torch.autograd.grad(out, (q, k, v), dout, retain_graph=True)`` is timed.

Latency mode (``--latency``): tiny and decode shapes, 2000 forward calls timed end to end with the
host clock between two synchronizations, in microseconds per call.

Decode mode (``--decode``): the decode shapes of issue 9 (one query per sequence, 32 q / 8 kv heads,
d128, bf16), forward with default arguments, in microseconds per call (median of do_bench) and the
bandwidth of the K + V bytes each call must read; a row ``copy`` measures the GPU's copy bandwidth
(``dst.copy_(src)`` of 1 GiB, bytes read + written per second) in the same run, and ``fa4/copy``
is fa4's K + V bandwidth over it. ``fa4-paged16`` runs fa4 on the same K/V in a paged cache of
16-row pages (vLLM's layout, pages shuffled), with its own ``paged/best`` (over the fastest peer on
the contiguous cache) and ``paged/copy``; ``flash-attn-4-paged16`` runs flash-attn-4 on that same
paged cache (when importable), and ``paged/peer`` is fa4's paged speed over it. ``fa4-kvcache16`` is
a ``flash_attn_with_kvcache`` step on that cache (one token appended, then the attention), and
``kvcache/paged`` its time over ``fa4-paged16``'s.

Implementations: fa4 (``fa4.flash_attn_func``), torch SDPA with the flash (FA2) and the cuDNN
backends, and flash-attn-4 (``flash_attn.cute``) when importable. Each one's output (and, for the
backward, its gradients) is compared once per row with SDPA-flash's; the max abs difference is a
column, so a fast but wrong kernel shows. A failure of one implementation is reported in its cell
("n/a" when unsupported, "ERR" otherwise, with the reason under the table) and the others still run.
fa4 numbers are only ever measured, never estimated.

The bar (throughput mode): issues 7 and 8 ask fa4 for 1.05x the best of cuDNN and flash-attn-4 in
every row, or, where that would pass 95% of the bf16 matmul rate measured in the same run, 95% of
that rate (``docs/targets.md``: the physical limit is near). The run times a bf16 ``8192^3``
``torch.matmul`` on random data after the grid, with the rows' timer and repeats; the header line
``# bf16 matmul`` gives it, and the column ``fa4/bar`` is fa4's speed over the row's bar
(``min(1.05 * best, 0.95 * matmul)``): 1.00x or more meets it.

Results: an aligned table on stdout, and CSV, JSON and a PNG bar plot (when matplotlib is
installed) in ``--out``, each with a header (GPU, versions, date). Without a CUDA GPU it prints a
message and exits with code 2.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime
import importlib.metadata
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional

import torch

import fa4
from fa4.testing import random_qkv

TOKENS = 16384
"""batch * seqlen of every grid row."""
MODEL_DIM = 2048
"""heads * head_dim of every grid row."""
GRID: tuple[tuple[int, int], ...] = ((64, 8192), (128, 1024), (128, 4096), (128, 8192), (128, 16384), (256, 8192))
"""(head_dim, seqlen) rows of the targets table; each is run non-causal and causal."""
LATENCY_CALLS = 2000
FA4 = "fa4"
FA4_NONDET = "fa4-nondet"  # with --deterministic: fa4's own non-deterministic backward, same row
FA4_PAGED = "fa4-paged16"  # with --decode: fa4 on the same K/V in a paged cache of 16-row pages
PEER_PAGED = "flash-attn-4-paged16"  # with --decode: flash-attn-4 on that paged cache
FA4_KVCACHE = "fa4-kvcache16"  # with --decode: a flash_attn_with_kvcache step (append + attention) on that cache
PAGE_SIZE = 16
OWN = (FA4_NONDET, FA4_PAGED, FA4_KVCACHE)  # fa4's own extra columns: never counted as peers
PAGED = (FA4_PAGED, PEER_PAGED, FA4_KVCACHE)  # the paged-cache columns: compared with each other, not in fa4/best
EXIT_NO_GPU = 2
NO_GPU_MESSAGE = (
    "fa4.bench: no CUDA GPU is visible (torch.cuda.is_available() is False); run the benchmark on the GPU machine."
)

Timer = Callable[[Callable[[], Any]], float]
"""Measures a zero-argument callable; returns milliseconds per call."""


# --------------------------------------------------------------------------------------------
# Shapes, FLOPs, grid selection
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """One benchmark problem: q ``(batch, seqlen_q, heads, hdim)``, k/v ``(batch, seqlen_k, heads, hdim)``."""

    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    hdim: int
    causal: bool = False
    heads_k: int = 0  # 0: heads (MHA)

    @property
    def hk(self) -> int:
        return self.heads_k or self.heads

    @property
    def kv_bytes(self) -> int:
        """K + V bytes of one call (16-bit)."""
        return 2 * 2 * self.batch * self.seqlen_k * self.hk * self.hdim


LATENCY_SHAPES = (Shape(1, 128, 512, 16, 128), Shape(8, 1, 512, 32, 128))
"""(b, sq, sk, h, d) of the latency rows of the targets table: tiny, and decode."""
DECODE_SHAPES = (Shape(64, 1, 8192, 32, 128, heads_k=8), Shape(8, 1, 32768, 32, 128, heads_k=8))
"""The decode rows of issue 9: one query per sequence, GQA 32 / 8, d128."""
COPY_BYTES = 1 << 30
MATMUL_N = 8192  # the bf16 matmul of the bar: MATMUL_N^3, random data (docs/targets.md)
BAR_OVER_BEST, BAR_OVER_MATMUL = 1.05, 0.95  # issues 7 / 8: 1.05x the best peer, capped at 95% of the matmul rate


def grid_shape(hdim: int, seqlen: int, causal: bool) -> Shape:
    """The grid problem of a (head_dim, seqlen) row: 16384 tokens, heads * head_dim = 2048."""
    return Shape(TOKENS // seqlen, seqlen, seqlen, MODEL_DIM // hdim, hdim, causal)


def select_grid(
    hdims: Optional[Sequence[int]] = None, seqlens: Optional[Sequence[int]] = None, causal: str = "both"
) -> list[Shape]:
    """Grid rows whose head_dim is in ``hdims`` and seqlen in ``seqlens`` (None = all), in table order.

    ``causal``: "no", "yes" or "both" (non-causal first). Only (head_dim, seqlen) pairs of the
    targets table are run, since the peers' reference numbers exist only for those.
    """
    flags = {"no": (False,), "yes": (True,), "both": (False, True)}[causal]
    return [
        grid_shape(d, s, c)
        for d, s in GRID
        if (hdims is None or d in hdims) and (seqlens is None or s in seqlens)
        for c in flags
    ]


def flops(shape: Shape, direction: str) -> float:
    """FLOPs of one call: forward ``4 * b * h * sq * sk * d`` (halved when causal), backward 2.5x."""
    fwd = 4.0 * shape.batch * shape.heads * shape.seqlen_q * shape.seqlen_k * shape.hdim
    if shape.causal:
        fwd /= 2
    return fwd * (2.5 if direction == "bwd" else 1.0)


def tflops(shape: Shape, direction: str, ms: float) -> float:
    """TFLOP/s of a call to ``direction`` on ``shape`` that takes ``ms`` milliseconds."""
    return flops(shape, direction) / (ms * 1e-3) / 1e12


# --------------------------------------------------------------------------------------------
# Implementations
# --------------------------------------------------------------------------------------------


class Prepared(NamedTuple):
    """An implementation bound to one problem.

    ``run()`` is the timed forward call; it returns the output in the implementation's layout,
    ``(b, h, s, d)`` when ``bhsd`` else ``(b, s, h, d)``. ``inputs`` are the q, k, v it reads, in
    that layout (leaf tensors requiring grad when the backward is wanted). ``context()`` is entered
    around the check and the timing, so per-call settings (an SDPA backend) stay out of the timed call.
    """

    run: Callable[[], torch.Tensor]
    inputs: tuple[torch.Tensor, ...]
    bhsd: bool
    context: Callable[[], AbstractContextManager] = contextlib.nullcontext


@dataclass(frozen=True)
class Impl:
    """A named attention implementation; ``setup(q, k, v, causal, requires_grad)`` binds it to inputs.

    ``q, k, v`` come in ``(b, s, h, d)``; any layout change happens in ``setup``, outside the timing.
    """

    name: str
    setup: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool, bool], Prepared]


def _leaves(tensors: Sequence[torch.Tensor], requires_grad: bool, bhsd: bool) -> tuple[torch.Tensor, ...]:
    """Fresh leaf views of ``(b, s, h, d)`` tensors, transposed to ``(b, h, s, d)`` when ``bhsd`` (no copy)."""
    views = (t.detach().transpose(1, 2) if bhsd else t.detach() for t in tensors)
    return tuple(t.requires_grad_(requires_grad) for t in views)


def _to_bshd(t: torch.Tensor, bhsd: bool) -> torch.Tensor:
    """``(b, h, s, d) -> (b, s, h, d)`` when ``bhsd``; the transposition is its own inverse."""
    return t.transpose(1, 2) if bhsd else t


def fa4_impl(option_kwargs: dict[str, Any], deterministic: bool, name: str = FA4) -> Impl:
    """fa4's ``flash_attn_func``, with ``fa4.KernelOptions(**option_kwargs)`` when any option is set."""

    def setup(q, k, v, causal, requires_grad):
        call = getattr(fa4, "flash_attn_func", None)
        if call is None:
            raise NotImplementedError("fa4.flash_attn_func does not exist yet")
        options = None
        if option_kwargs:
            if not hasattr(fa4, "KernelOptions"):
                raise NotImplementedError(f"fa4.KernelOptions does not exist; cannot pass {option_kwargs}")
            options = fa4.KernelOptions(**option_kwargs)
        q, k, v = _leaves((q, k, v), requires_grad, bhsd=False)

        def run():
            return call(q, k, v, causal=causal, deterministic=deterministic, kernel_options=options)[0]

        return Prepared(run, (q, k, v), bhsd=False)

    return Impl(name, setup)


def sdpa_impl(name: str, backend: str) -> Impl:
    """torch SDPA restricted to one backend (``SDPBackend.<backend>``), on ``(b, h, s, d)`` views."""

    def setup(q, k, v, causal, requires_grad):
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.functional import scaled_dot_product_attention

        if causal and q.shape[1] != k.shape[1]:
            raise NotImplementedError("SDPA's is_causal is top-left aligned; fa4's is bottom-right")
        chosen = getattr(SDPBackend, backend)
        qt, kt, vt = _leaves((q, k, v), requires_grad, bhsd=True)
        gqa = {"enable_gqa": True} if q.shape[2] != k.shape[2] else {}

        def run():
            return scaled_dot_product_attention(qt, kt, vt, is_causal=causal, **gqa)

        return Prepared(run, (qt, kt, vt), bhsd=True, context=lambda: sdpa_kernel(chosen))

    return Impl(name, setup)


def flash_attn4_impl(deterministic: bool) -> Impl:
    """flash-attn-4's ``flash_attn.cute.flash_attn_func`` (n/a when not installed)."""

    def setup(q, k, v, causal, requires_grad):
        from flash_attn.cute import flash_attn_func

        q, k, v = _leaves((q, k, v), requires_grad, bhsd=False)

        def run():
            return flash_attn_func(q, k, v, causal=causal, deterministic=deterministic)[0]

        return Prepared(run, (q, k, v), bhsd=False)

    return Impl("flash-attn-4", setup)


def paged_cache(k: torch.Tensor, v: torch.Tensor, page_size: int, shuffle: bool = True):
    """The batched ``k, v (b, s_k, h_k, d)`` as a paged cache (vLLM's layout): ``(kc, vc, table,
    used)`` with ``kc, vc (b * pages, page_size, h_k, d)``, pages in a random order (``shuffle``,
    seeded) or in order, ``table`` int32 ``(b, pages)`` and ``used`` = s_k per sequence."""
    b, sk = k.shape[:2]
    pages = -(-sk // page_size)
    pad = pages * page_size - sk
    kp = torch.nn.functional.pad(k, (0, 0, 0, 0, 0, pad)).reshape(b * pages, page_size, *k.shape[2:])
    vp = torch.nn.functional.pad(v, (0, 0, 0, 0, 0, pad)).reshape(b * pages, page_size, *v.shape[2:])
    if shuffle:
        perm = torch.randperm(b * pages, device=k.device, generator=torch.Generator(k.device).manual_seed(0))
    else:
        perm = torch.arange(b * pages, device=k.device)
    kc, vc = torch.empty_like(kp), torch.empty_like(vp)
    kc[perm], vc[perm] = kp, vp  # page i of the unpaged order lives at perm[i]
    used = torch.full((b,), sk, dtype=torch.int32, device=k.device)
    return kc, vc, perm.reshape(b, pages).to(torch.int32), used


def paged_impl(name: str, varlen_func: Callable[[], Callable], page_size: int = PAGE_SIZE) -> Impl:
    """``varlen_func()``'s ``flash_attn_varlen_func`` (imported at setup, so a missing peer is n/a)
    on the same K/V scattered into a paged cache (:func:`paged_cache`, pages shuffled,
    ``page_table`` + ``seqused_k``); the cache is built outside the timing."""

    def setup(q, k, v, causal, requires_grad):
        if requires_grad:
            raise NotImplementedError("paged K/V is forward only")
        func = varlen_func()
        kc, vc, table, used = paged_cache(k, v, page_size)

        def run():
            return func(q, kc, vc, page_table=table, seqused_k=used, causal=causal)[0]

        return Prepared(run, (q, k, v), bhsd=False)

    return Impl(name, setup)


def fa4_paged_impl(page_size: int = PAGE_SIZE, name: str = FA4_PAGED) -> Impl:
    """fa4 on the paged cache (:func:`paged_impl`)."""
    return paged_impl(name, lambda: fa4.flash_attn_varlen_func, page_size)


def fa4_kvcache_impl(page_size: int = PAGE_SIZE, name: str = FA4_KVCACHE) -> Impl:
    """A decode step through :func:`fa4.flash_attn_with_kvcache` on the paged cache of
    :func:`paged_impl`: each sequence's last token appended again at its own position (the cache
    stays the same, so the output is the plain call's), then the attention: the composition's cost
    over ``fa4-paged16`` (Note [KV cache calls])."""

    def setup(q, k, v, causal, requires_grad):
        if requires_grad:
            raise NotImplementedError("the KV cache call is forward only")
        kc, vc, table, used = paged_cache(k, v, page_size)
        k_new, v_new, lens = k[:, -1:].contiguous(), v[:, -1:].contiguous(), used - 1

        def run():
            return fa4.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, cache_seqlens=lens, block_table=table,
                                               causal=causal)

        return Prepared(run, (q, k, v), bhsd=False)

    return Impl(name, setup)


def peer_paged_impl(page_size: int = PAGE_SIZE, name: str = PEER_PAGED) -> Impl:
    """flash-attn-4 on the paged cache (:func:`paged_impl`); n/a when not installed."""

    def varlen_func():
        from flash_attn.cute import flash_attn_varlen_func

        return flash_attn_varlen_func

    return paged_impl(name, varlen_func, page_size)


def peer_impls(deterministic: bool) -> list[Impl]:
    """The peers of the targets table: SDPA flash (FA2), SDPA cuDNN, flash-attn-4."""
    return [
        sdpa_impl("sdpa-flash", "FLASH_ATTENTION"),
        sdpa_impl("sdpa-cudnn", "CUDNN_ATTENTION"),
        flash_attn4_impl(deterministic),
    ]


# --------------------------------------------------------------------------------------------
# Timers
# --------------------------------------------------------------------------------------------


def cuda_event_timer(fn: Callable[[], Any], warmup: int = 5, iters: int = 30) -> float:
    """Median milliseconds of ``iters`` calls, each between two CUDA events (triton's fallback)."""
    for _ in range(warmup):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    torch.cuda.synchronize()
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def default_timer() -> Timer:
    """The median of ``triton.testing.do_bench``, or :func:`cuda_event_timer` when triton is missing."""
    try:
        from triton.testing import do_bench
    except ImportError:
        print("fa4.bench: triton is not installed; timing with CUDA events (median of 30 calls)", file=sys.stderr)
        return cuda_event_timer
    return lambda fn: float(do_bench(fn, return_mode="median"))


def host_timer(
    fn: Callable[[], Any],
    calls: int = LATENCY_CALLS,
    warmup: int = 20,
    sync: Callable[[], None] = torch.cuda.synchronize,
) -> float:
    """Milliseconds per call of ``calls`` back-to-back calls, host clock between two ``sync()``."""
    for _ in range(warmup):
        fn()
    sync()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e3 / calls


def latency_timer() -> Timer:
    """The latency timer: :func:`host_timer` with the targets' 2000 calls."""
    return lambda fn: host_timer(fn, LATENCY_CALLS)


def repeated(timer: Timer, repeats: int) -> Timer:
    """A timer reporting the median of ``repeats`` measurements of ``timer``."""
    if repeats <= 1:
        return timer
    return lambda fn: statistics.median(timer(fn) for _ in range(repeats))


# --------------------------------------------------------------------------------------------
# Running the grid
# --------------------------------------------------------------------------------------------


@dataclass
class Record:
    """One (implementation, shape, direction) measurement.

    ``status``: "ok", "n/a" (not supported or not installed) or "error"; ``ms``: milliseconds per
    call; ``maxdiff``: max abs difference of the outputs (fwd) or of dq, dk, dv (bwd) against the
    reference implementation, None when either could not run.
    """

    impl: str
    direction: str
    shape: Shape
    status: str
    ms: Optional[float] = None
    maxdiff: Optional[float] = None
    reason: str = ""

    @property
    def tflops(self) -> Optional[float]:
        """TFLOP/s, None without a timing."""
        return tflops(self.shape, self.direction, self.ms) if self.ms is not None else None


def _results(prepared: Prepared, direction: str, dout: torch.Tensor) -> tuple[Callable[[], Any], list[torch.Tensor]]:
    """The callable to time for ``direction`` and its results in ``(b, s, h, d)`` (out, or dq, dk, dv)."""
    if direction == "fwd":
        return prepared.run, [_to_bshd(prepared.run(), prepared.bhsd)]
    out = prepared.run()
    grad_out = _to_bshd(dout, prepared.bhsd)

    def backward():
        return torch.autograd.grad(out, prepared.inputs, grad_out, retain_graph=True)

    return backward, [_to_bshd(g, prepared.bhsd) for g in backward()]


def _max_abs_diff(results: Sequence[torch.Tensor], reference: Sequence[torch.Tensor]) -> float:
    """Largest ``|a - b|`` over pairs of tensors; NaN when any result holds NaN."""
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(results, reference)]
    return max(diffs, key=lambda x: math.inf if math.isnan(x) else x)


def _failure(impl: str, direction: str, shape: Shape, exc: BaseException, maxdiff: Optional[float]) -> Record:
    """A record for an implementation that raised: "n/a" when unsupported or missing, else "error"."""
    status = "n/a" if isinstance(exc, (NotImplementedError, ImportError)) else "error"
    reason = f"{type(exc).__name__}: {exc}".strip().splitlines()[0]
    return Record(impl, direction, shape, status, maxdiff=maxdiff, reason=reason)


def measure(
    impl: Impl,
    shape: Shape,
    direction: str,
    tensors: tuple[torch.Tensor, ...],
    reference: Optional[list[torch.Tensor]],
    timer: Timer,
) -> Record:
    """Check ``impl`` once against ``reference`` (when given), then time it; failures become records."""
    q, k, v, dout = tensors
    maxdiff = None
    try:
        prepared = impl.setup(q, k, v, shape.causal, direction == "bwd")
        with prepared.context():
            fn, results = _results(prepared, direction, dout)
            maxdiff = _max_abs_diff(results, reference) if reference is not None else None
            ms = timer(fn)
    except Exception as exc:  # one implementation's failure must not stop the others
        return _failure(impl.name, direction, shape, exc, maxdiff)
    return Record(impl.name, direction, shape, "ok", ms=ms, maxdiff=maxdiff)


def _reference_results(
    reference: Impl, shape: Shape, direction: str, tensors: tuple[torch.Tensor, ...], log: Callable[[str], None]
) -> Optional[list[torch.Tensor]]:
    """The reference implementation's output (fwd) or gradients (bwd), or None (logged) if it fails."""
    q, k, v, dout = tensors
    try:
        prepared = reference.setup(q, k, v, shape.causal, direction == "bwd")
        with prepared.context():
            return [t.detach() for t in _results(prepared, direction, dout)[1]]
    except Exception as exc:  # without a reference the row still runs, with no maxdiff
        log(f"reference {reference.name} failed on {shape_label(shape)} {direction}: {type(exc).__name__}: {exc}")
        return None


def _worst_diff(diffs) -> Optional[float]:
    """The largest of a row's rounds' max abs differences (NaN if any is NaN; None if none was taken)."""
    got = [d for d in diffs if d is not None]
    if not got:
        return None
    return math.nan if any(math.isnan(d) for d in got) else max(got)


def _progress_line(rec: Record) -> str:
    """One line per measurement, printed while the grid runs."""
    what = f"{shape_label(rec.shape)} {rec.direction} {rec.impl}"
    if rec.status != "ok":
        return f"{what}: {rec.status}: {rec.reason}"
    return f"{what}: {rec.ms:.4f} ms, {rec.tflops:.1f} TFLOP/s, maxdiff {_diff_cell(rec)}"


def _inputs(shape: Shape, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, ...]:
    """Random normal q, k, v, dout for ``shape`` (heads_k = heads)."""
    q, k, v = random_qkv(
        shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.hk, shape.hdim, dtype, device, seed=seed
    )
    dout = torch.randn(q.shape, dtype=dtype, device=device, generator=torch.Generator(device).manual_seed(seed + 1))
    return q, k, v, dout


def run_grid(
    shapes: Sequence[Shape],
    impls: Sequence[Impl],
    *,
    timer: Timer,
    directions: Sequence[str] = ("fwd", "bwd"),
    reference: Optional[Impl] = None,
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    log: Callable[[str], None] = lambda msg: print(msg, file=sys.stderr, flush=True),
    rounds: int = 1,
) -> list[Record]:
    """Measure every implementation on every shape and direction, in that nesting order.

    Inputs are drawn once per shape and shared. ``reference`` (default: none) gives the results each
    implementation is compared with. ``timer`` is the seam tests use to inject fake timings.
    ``rounds`` > 1: each (shape, direction) row times its implementations in turn, ``rounds`` times
    over (round-robin), and each record holds the median of its times; a drift of the GPU's clocks
    during a row then touches every implementation alike, where consecutive repeats of one
    implementation would hand it to whichever ran in the slow stretch (RESULTS v0.46: single runs on
    an H100 moved the peers by up to 13%).
    """
    records = []
    for shape in shapes:
        tensors = _inputs(shape, dtype, device, seed)
        for direction in directions:
            ref = _reference_results(reference, shape, direction, tensors, log) if reference else None
            per_impl = [[] for _ in impls]
            for _ in range(max(rounds, 1)):
                for got, impl in zip(per_impl, impls):
                    if got and got[-1].status != "ok":
                        continue  # a failure is reported, not retried
                    got.append(measure(impl, shape, direction, tensors, ref, timer))
            for got in per_impl:
                record = got[-1] if got[-1].status != "ok" else dataclasses.replace(
                    got[0], ms=statistics.median(r.ms for r in got), maxdiff=_worst_diff(r.maxdiff for r in got))
                log(_progress_line(record))
                records.append(record)
    return records


# --------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------


def shape_label(shape: Shape) -> str:
    """Compact row label, e.g. ``b2 sq8192 sk8192 h16 d128 causal``."""
    label = f"b{shape.batch} sq{shape.seqlen_q} sk{shape.seqlen_k} h{shape.heads} d{shape.hdim}"
    if shape.heads_k and shape.heads_k != shape.heads:
        label += f" hk{shape.heads_k}"
    return label + (" causal" if shape.causal else "")


def _cell(record: Optional[Record], latency: bool) -> str:
    """A table cell: TFLOP/s (or us per call in latency mode), "n/a", "ERR" or "-" when absent."""
    if record is None:
        return "-"
    if record.status != "ok":
        return "n/a" if record.status == "n/a" else "ERR"
    return f"{record.ms * 1e3:.1f}" if latency else f"{record.tflops:.1f}"


def _speed_ratio(row: dict[str, Record]) -> Optional[float]:
    """fa4's speed over the best peer's in this row (> 1: fa4 is faster), or None.

    Both run the same shape, so the TFLOP/s ratio is the inverse ratio of the times.
    """
    return _ratio(row, FA4)


def _ratio(row: dict[str, Record], name: str, peers: Optional[Sequence[str]] = None) -> Optional[float]:
    """``name``'s speed over the fastest of ``peers`` in this row (default: every peer but the
    paged-cache columns; fa4's own extra columns are never peers)."""
    ok = _peers(row, peers)
    mine = row.get(name)
    if mine is None or mine.status != "ok" or not ok:
        return None
    return min(rec.ms for rec in ok.values()) / mine.ms


def _peers(row: dict[str, Record], peers: Optional[Sequence[str]] = None) -> dict[str, Record]:
    """The row's peers that ran: ``peers``, or every implementation but fa4, its own extra columns
    and the paged-cache columns."""
    return {n: rec for n, rec in row.items() if rec.status == "ok" and n not in OWN and n != FA4
            and (n in peers if peers is not None else n not in PAGED)}


def _rows(records: Sequence[Record]) -> dict[tuple[Shape, str], dict[str, Record]]:
    """The records by (shape, direction) row, then by implementation, in the order they ran."""
    groups: dict[tuple[Shape, str], dict[str, Record]] = {}
    for rec in records:
        groups.setdefault((rec.shape, rec.direction), {})[rec.impl] = rec
    return groups


def _impl_order(records: Sequence[Record]) -> list[str]:
    """Implementation names, fa4 first, then peers in the order they ran."""
    names = list(dict.fromkeys(r.impl for r in records))
    return sorted(names, key=lambda n: n != FA4)


def bar_tflops(row: dict[str, Record], matmul_tflops: float) -> Optional[float]:
    """The row's bar in TFLOP/s (issues 7 / 8, ``docs/targets.md``): 1.05x the fastest peer's, or 95%
    of the bf16 matmul rate where that is lower; None without a peer that ran. The peers are
    ``fa4/best``'s: SDPA flash counts beside cuDNN and flash-attn-4, which can only raise the bar
    (it is never the fastest on the grid)."""
    ok = _peers(row)
    if not ok:
        return None
    return min(BAR_OVER_BEST * max(rec.tflops for rec in ok.values()), BAR_OVER_MATMUL * matmul_tflops)


def _bar_ratio(row: dict[str, Record], matmul_tflops: float) -> Optional[float]:
    """fa4's TFLOP/s over the row's bar (unrounded), or None where fa4 or every peer failed."""
    target, mine = bar_tflops(row, matmul_tflops), row.get(FA4)
    return mine.tflops / target if target is not None and mine is not None and mine.status == "ok" else None


def summarize(records: Sequence[Record], latency: bool,
              matmul_tflops: Optional[float] = None) -> tuple[list[str], list[dict[str, str]]]:
    """Table columns and rows: one row per (shape, direction), cells per implementation.

    Columns: the shape, the direction, one speed column per implementation (TFLOP/s, or us per call
    in latency mode), ``fa4/best`` (fa4's speed over the fastest peer's: > 1 means fa4 is faster),
    with ``matmul_tflops`` (the run's bf16 matmul rate) ``fa4/bar`` (fa4's speed over the row's bar,
    :func:`bar_tflops`: >= 1 meets it), and one ``diff <impl>`` column per implementation (max abs
    difference from the reference).
    """
    names = _impl_order(records)
    unit = "us" if latency else "TFLOP/s"
    bar = matmul_tflops is not None and not latency
    columns = ["b", "sq", "sk", "h", "d", "causal", "dir"] + [f"{n} {unit}" for n in names] + ["fa4/best"]
    columns += ["fa4/bar"] if bar else []
    columns += [f"diff {n}" for n in names]
    rows = []
    for (shape, direction), row in _rows(records).items():
        ratio = _speed_ratio(row)
        cells = [shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.hdim, "yes" if shape.causal else "no"]
        cells += [direction] + [_cell(row.get(n), latency) for n in names]
        cells.append(f"{ratio:.2f}x" if ratio is not None else "-")
        if bar:
            over = _bar_ratio(row, matmul_tflops)
            cells.append(f"{over:.2f}x" if over is not None else "-")
        cells += [_diff_cell(row.get(n)) for n in names]
        rows.append(dict(zip(columns, map(str, cells))))
    return columns, rows


def bar_summary(records: Sequence[Record], matmul_tflops: Optional[float]) -> str:
    """One line per direction: on how many rows fa4 meets the bar (:func:`bar_tflops`, unrounded)
    and the row furthest below it; empty without a matmul rate or a row where fa4 and a peer ran."""
    if matmul_tflops is None:
        return ""
    ratios: dict[str, list[tuple[float, Shape]]] = {}
    for (shape, direction), row in _rows(records).items():
        over = _bar_ratio(row, matmul_tflops)
        if over is not None:
            ratios.setdefault(direction, []).append((over, shape))
    lines = []
    for direction, cells in ratios.items():
        worst, shape = min(cells, key=lambda c: c[0])
        lines.append(f"# {direction}: fa4 meets the bar on {sum(r >= 1.0 for r, _ in cells)} of {len(cells)} rows; "
                     f"lowest {worst:.3f}x (d{shape.hdim} s{shape.seqlen_q}{' causal' if shape.causal else ''})")
    return "\n".join(lines)


def matmul_rate(timer: Timer, n: int = MATMUL_N, device: str = "cuda") -> float:
    """The GPU's bf16 matmul rate in TFLOP/s: ``2 n^3`` per ``torch.matmul`` of two random ``n x n``
    bf16 matrices (the bar's cap, :func:`bar_tflops`)."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    c = torch.empty(n, n, dtype=torch.bfloat16, device=device)
    ms = timer(lambda: torch.matmul(a, b, out=c))
    return 2 * n ** 3 / (ms * 1e-3) / 1e12


def copy_bandwidth(timer: Timer, nbytes: int = COPY_BYTES, device: str = "cuda") -> float:
    """The GPU's copy bandwidth in TB/s: bytes read + written per second of ``dst.copy_(src)``."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * nbytes / (ms * 1e-3) / 1e12


def summarize_decode(records: Sequence[Record], copy_tbs: Optional[float]) -> tuple[list[str], list[dict[str, str]]]:
    """Decode table: per shape, microseconds per call and the K + V bandwidth (TB/s) of each
    implementation, ``fa4/best`` (speed over the fastest peer) and ``fa4/copy`` (fa4's K + V
    bandwidth over the measured copy bandwidth)."""
    names = _impl_order(records)
    paged = FA4_PAGED in names
    columns = ["b", "sq", "sk", "h", "hk", "d"] + [f"{n} us (TB/s)" for n in names] + ["fa4/best", "fa4/copy"]
    kvc = FA4_KVCACHE in names and paged
    if paged:
        columns += ["paged/best", "paged/copy"] + (["paged/peer"] if PEER_PAGED in names else [])
    if kvc:
        columns += ["kvcache/paged"]
    columns += [f"diff {n}" for n in names]
    groups: dict[Shape, dict[str, Record]] = {}
    for rec in records:
        groups.setdefault(rec.shape, {})[rec.impl] = rec
    rows = []
    for shape, row in groups.items():
        cells = [shape.batch, shape.seqlen_q, shape.seqlen_k, shape.heads, shape.hk, shape.hdim]
        for n in names:
            rec = row.get(n)
            if rec is None or rec.status != "ok":
                cells.append(_cell(rec, True))
            else:
                cells.append(f"{rec.ms * 1e3:.1f} ({shape.kv_bytes / (rec.ms * 1e-3) / 1e12:.2f})")
        for name in (FA4, FA4_PAGED) if paged else (FA4,):
            ratio = _ratio(row, name)
            cells.append(f"{ratio:.2f}x" if ratio is not None else "-")
            rec = row.get(name)
            if copy_tbs and rec is not None and rec.status == "ok":
                cells.append(f"{shape.kv_bytes / (rec.ms * 1e-3) / 1e12 / copy_tbs:.2f}")
            else:
                cells.append("-")
        if paged and PEER_PAGED in names:
            ratio = _ratio(row, FA4_PAGED, peers=(PEER_PAGED,))
            cells.append(f"{ratio:.2f}x" if ratio is not None else "-")
        if kvc:  # the KV cache step's time over the plain paged call's (> 1: the append's cost)
            a, b = row.get(FA4_KVCACHE), row.get(FA4_PAGED)
            ok = a is not None and b is not None and a.status == b.status == "ok"
            cells.append(f"{a.ms / b.ms:.2f}" if ok else "-")
        cells += [_diff_cell(row.get(n)) for n in names]
        rows.append(dict(zip(columns, map(str, cells))))
    return columns, rows


def _diff_cell(record: Optional[Record]) -> str:
    """Max abs difference as ``1.2e-03``, or "-" when not measured."""
    return "-" if record is None or record.maxdiff is None else f"{record.maxdiff:.1e}"


def format_table(columns: Sequence[str], rows: Sequence[dict[str, str]]) -> str:
    """Right-aligned text table with a header line and a rule."""
    widths = [max([len(c)] + [len(r[c]) for r in rows]) for c in columns]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(r[c].rjust(w) for c, w in zip(columns, widths)) for r in rows]
    return "\n".join(lines)


def format_notes(records: Sequence[Record]) -> str:
    """One line per distinct (implementation, status, reason) of the failed records, with a count."""
    counts: dict[tuple[str, str, str], int] = {}
    for rec in records:
        if rec.status != "ok":
            key = (rec.impl, rec.status, rec.reason)
            counts[key] = counts.get(key, 0) + 1
    return "\n".join(f"{impl}: {status} in {n} row(s): {reason}" for (impl, status, reason), n in counts.items())


def _version(dist: str) -> str:
    """Installed version of a distribution, or "not installed"."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def collect_header(argv: Sequence[str]) -> dict[str, str]:
    """Where and when the numbers were taken: GPU, library versions, date and command line."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "gpu": gpu,
        "torch": torch.__version__,
        "cuda": str(torch.version.cuda),
        "triton": _version("triton"),
        "nvidia-cutlass-dsl": _version("nvidia-cutlass-dsl"),
        "fa4": str(getattr(fa4, "__version__", "unknown")),
        "flash-attn-4": _version("flash-attn-4"),
        "command": " ".join(["python -m fa4.bench", *argv]),
    }


def _record_dict(rec: Record) -> dict[str, Any]:
    """Flat, JSON/CSV-friendly view of a record (non-finite floats as strings)."""
    d = {"impl": rec.impl, "direction": rec.direction, **dataclasses.asdict(rec.shape), "status": rec.status}
    d.update(ms=rec.ms, tflops=rec.tflops, maxdiff=rec.maxdiff, reason=rec.reason)
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}


def write_csv(path: Path, header: dict[str, str], records: Sequence[Record]) -> None:
    """Long-format CSV, one line per record, after ``# key: value`` header lines."""
    rows = [_record_dict(r) for r in records]
    with path.open("w", newline="") as f:
        f.writelines(f"# {k}: {v}\n" for k, v in header.items())
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["impl"])
        writer.writeheader()
        writer.writerows(rows)


def write_json(path: Path, header: dict[str, str], records: Sequence[Record], summary: list[dict[str, str]]) -> None:
    """``{"header", "records", "summary"}``: the raw records and the table rows."""
    payload = {"header": header, "records": [_record_dict(r) for r in records], "summary": summary}
    path.write_text(json.dumps(payload, indent=1) + "\n")


def _plot_label(shape: Shape) -> str:
    """Short x-axis label: ``d128 s8192 c`` on the grid, the full shape otherwise."""
    if shape.seqlen_q != shape.seqlen_k:
        return shape_label(shape)
    return f"d{shape.hdim} s{shape.seqlen_k}" + (" c" if shape.causal else "")


def write_plot(path: Path, header: dict[str, str], records: Sequence[Record], latency: bool) -> bool:
    """Grouped bar plot of speed per row and implementation; False (nothing written) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    names = _impl_order(records)
    groups = list(dict.fromkeys((r.shape, r.direction) for r in records))
    value = {(r.shape, r.direction, r.impl): (r.ms * 1e3 if latency else r.tflops) for r in records if r.status == "ok"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups)), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        heights = [value.get((s, d, name), 0.0) for s, d in groups]
        ax.bar([g + (i - (len(names) - 1) / 2) * width for g in range(len(groups))], heights, width, label=name)
    ax.set_xticks(range(len(groups)), [f"{_plot_label(s)} {d}" for s, d in groups], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("us per call (lower is better)" if latency else "TFLOP/s (higher is better)")
    ax.set_title(f"{header['gpu']}  fa4 {header['fa4']}  {header['date']}", fontsize=9)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.15)  # room for the legend above the bars
    ax.legend(fontsize=8, ncol=len(names), loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_outputs(out_dir: Path, header: dict[str, str], records: Sequence[Record], latency: bool,
                  matmul_tflops: Optional[float] = None) -> list[Path]:
    """CSV, JSON and (when matplotlib is there) PNG under ``out_dir``, named by mode and time
    (``matmul_tflops``: the run's bf16 matmul rate, for the summary's ``fa4/bar``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{'latency' if latency else 'throughput'}_{datetime.datetime.now():%Y%m%d-%H%M%S}"
    paths = [out_dir / f"{stem}.csv", out_dir / f"{stem}.json"]
    write_csv(paths[0], header, records)
    write_json(paths[1], header, records, summarize(records, latency, matmul_tflops)[1])
    png = out_dir / f"{stem}.png"
    if write_plot(png, header, records, latency):
        paths.append(png)
    else:
        print("fa4.bench: matplotlib is not installed; no PNG plot written", file=sys.stderr)
    return paths


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    """``"64,128"`` -> ``[64, 128]``."""
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The command line; see ``python -m fa4.bench --help``."""
    p = argparse.ArgumentParser(
        prog="python -m fa4.bench",
        description="Benchmark fa4 against SDPA (flash, cuDNN) and flash-attn-4 on FlashAttention's grid.",
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--hdim", type=_int_list, help="head dims to run, e.g. 64,128 (default: all of the grid)")
    p.add_argument("--seqlen", type=_int_list, help="seqlens to run, e.g. 1024,8192 (default: all of the grid)")
    p.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    p.add_argument("--mode", choices=("fwd", "bwd", "both"), default="both")
    p.add_argument(
        "--arch",
        choices=("auto", "sm80", "sm90", "sm100"),
        default="auto",
        help="fa4 kernel family (KernelOptions.arch); auto = the device's own",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="deterministic backward (fa4 and flash-attn-4); fa4's non-deterministic one runs too (fa4-nondet)",
    )
    p.add_argument("--exp2-emu-frac", type=float, help="fa4 KernelOptions.exp2_emu_frac")
    p.add_argument("--rescale-threshold", type=float, help="fa4 KernelOptions.rescale_threshold (log2 units)")
    p.add_argument("--out", type=Path, default=Path("bench_results"), help="directory for CSV/JSON/PNG")
    p.add_argument(
        "--latency",
        action="store_true",
        help=f"per-call latency on {[dataclasses.astuple(s)[:5] for s in LATENCY_SHAPES]} (b, sq, sk, h, d)"
        f" instead of the grid; {LATENCY_CALLS} forward calls each",
    )
    p.add_argument(
        "--decode",
        action="store_true",
        help=f"the decode shapes {[dataclasses.astuple(s)[:5] + (s.heads_k,) for s in DECODE_SHAPES]} (b, sq, sk, h, d, hk)"
        " with the copy bandwidth of the same run, instead of the grid",
    )
    p.add_argument("--repeats", type=int, default=1,
                   help="time each row's implementations N times over, in turn (round-robin), and report each "
                        "one's median")
    p.add_argument(
        "--offgrid",
        action="store_true",
        help="instead of the grid, shapes the grid leaves out (varlen, GQA / MQA, s512 / s2k / s32k, prefill "
        "against a cache) beside flash-attn-4 and cuDNN; its own options: python -m fa4.bench --offgrid --help",
    )
    return p.parse_args(list(argv))


def kernel_option_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The ``fa4.KernelOptions`` fields the command line sets (empty: fa4's defaults)."""
    kwargs: dict[str, Any] = {}
    if args.arch != "auto":
        kwargs["arch"] = args.arch
    if args.exp2_emu_frac is not None:
        kwargs["exp2_emu_frac"] = args.exp2_emu_frac
    if args.rescale_threshold is not None:
        kwargs["rescale_threshold"] = args.rescale_threshold
    return kwargs


def plan(args: argparse.Namespace) -> tuple[list[Shape], tuple[str, ...]]:
    """Shapes and directions the arguments ask for."""
    if args.latency:
        return list(LATENCY_SHAPES), ("fwd",)
    if getattr(args, "decode", False):
        return list(DECODE_SHAPES), ("fwd",)
    directions = {"fwd": ("fwd",), "bwd": ("bwd",), "both": ("fwd", "bwd")}[args.mode]
    return select_grid(args.hdim, args.seqlen, args.causal), directions


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the benchmark; returns the process exit code (2 without a GPU or with an empty selection)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--offgrid" in argv:  # the off-grid survey has its own options (fa4/offgrid.py)
        from fa4 import offgrid

        return offgrid.main([a for a in argv if a != "--offgrid"])
    args = parse_args(argv)
    shapes, directions = plan(args)
    if not shapes:
        print(
            f"fa4.bench: no grid row matches --hdim/--seqlen; the grid is (head_dim, seqlen) in {GRID}", file=sys.stderr
        )
        return 2
    if not torch.cuda.is_available():
        print(NO_GPU_MESSAGE, file=sys.stderr)
        return EXIT_NO_GPU
    header = collect_header(argv)
    print("\n".join(f"# {k}: {v}" for k, v in header.items()))
    timer = latency_timer() if args.latency else default_timer()
    peers = peer_impls(args.deterministic)
    # fa4 runs last in each row, so a fault that poisons the CUDA context still leaves the peers measured.
    impls = peers + [fa4_impl(kernel_option_kwargs(args), args.deterministic)]
    if args.decode:  # the paged cache (page size 16) beside the contiguous one, the peer's first
        impls[len(peers):len(peers)] = [peer_paged_impl()]
        impls.append(fa4_paged_impl())
        impls.append(fa4_kvcache_impl())
    if args.deterministic:  # the det / non-det ratio from one row (not counted as a peer in fa4/best)
        impls.insert(len(peers), fa4_impl(kernel_option_kwargs(args), False, name=FA4_NONDET))
    records = run_grid(shapes, impls, timer=timer, directions=directions, reference=peers[0], rounds=args.repeats)
    if args.decode:
        copy_tbs = copy_bandwidth(repeated(timer, args.repeats))
        print(f"# copy bandwidth: {copy_tbs:.2f} TB/s (read + write of {COPY_BYTES >> 20} MiB)")
        columns, rows = summarize_decode(records, copy_tbs)
        matmul = None
    else:
        matmul = None if args.latency else matmul_rate(repeated(timer, args.repeats))
        if matmul is not None:
            header["bf16 matmul TFLOP/s"] = f"{matmul:.1f}"
            print(f"# bf16 matmul ({MATMUL_N}^3): {matmul:.1f} TFLOP/s; bar per row: min({BAR_OVER_BEST} x best peer, "
                  f"{BAR_OVER_MATMUL} x matmul = {BAR_OVER_MATMUL * matmul:.1f})")
        columns, rows = summarize(records, args.latency, matmul)
    print(format_table(columns, rows))
    bar_lines = bar_summary(records, matmul)
    if bar_lines:
        print(bar_lines)
    notes = format_notes(records)
    if notes:
        print("\n" + notes)
    for path in write_outputs(args.out, header, records, args.latency, matmul):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
