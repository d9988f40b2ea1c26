"""Split-KV combine: merge the partial outputs of a split-KV (FlashDecoding) forward.

Math. Split ``s`` of a query row attended to its own slice of the keys and wrote ``O_s``, already
divided by its own softmax row sum, and ``lse_s``, the natural log of that row sum (scaled scores).
Over all keys, ``lse = log(sum_s exp(lse_s))`` and ``out = sum_s exp(lse_s - lse) * O_s``. The
kernel computes, per row, ``m = max_s lse_s``, ``w_s = exp2((lse_s - m) * log2(e))`` (MUFU
``ex2``, 2 ulp), ``l = sum_s w_s``, ``lse = m + log(l)`` (the accurate ``logf``: once per row) and
``out = (sum_s w_s O_s) * (1 / l)``: the difference ``lse_s - m`` is taken before the scale, so the
weights that matter (near ``m``) carry no cancellation, and dividing once by ``l`` (instead of
weighting by ``exp(lse_s - lse)``) keeps the rounding of ``lse`` itself (``ulp(lse)``, 4e-6 at
``|lse| = 50``) out of ``out``. A split with ``lse_s = -inf`` has ``w_s = 0`` and its
``O_s`` is never loaded (it may hold garbage or NaN: a skipped load, not a multiply by 0). A row
whose splits are all ``-inf`` gets ``out = 0`` and ``lse = -inf``.

Layouts (``S`` = number of splits; packed: ``total_q`` tokens, every tensor seen by the kernel
with a batch mode of 1, ``(S, 1, total_q, h, d)`` ..., and without ``cu_seqlens`` simply as one
batch of ``total_q`` rows)::

    out_partial   (S, b, s, h, d) | (S, total_q, h, d)   float32, last dim contiguous, other strides
                                                        multiples of 4 (16 bytes), 16-byte aligned
    lse_partial   (S, b, s, h)    | (S, total_q, h)      float32, any strides (the forward passes a
                                                        transposed view of (S, b, h, s))
    out           (b, s, h, d)    | (total_q, h, d)      bf16 / fp16 / fp32, as out_partial
    lse           (b, s, h)       | (total_q, h)         float32, any strides; flash_attn_combine
                                                        allocates (b, h, s) / (h, total_q) memory
                                                        and returns the transposed view
    cu_seqlens    (b + 1,) int32 (packed)   tokens outside [cu_seqlens[0], cu_seqlens[b]) are not
                                            written
    seqused       (b,) int32                rows s >= seqused[b] of sequence b (packed: position
                                            t - cu_seqlens[b], the sequence found by a binary
                                            search of cu_seqlens) are not written

Note [Combine thread mapping]
    A plain SIMT kernel, one code for sm_80, sm_90a and sm_100a. Rows ``(b, s, h)`` are numbered
    with ``h`` fastest; a row is served by ``T`` adjacent lanes (``threads_per_row``: 8, 16 or 32
    for head dims up to 32, 64, >= 128), so a warp holds ``32 / T`` rows. Lane ``j`` of a row reads
    head-dim columns ``[4 (v T + j), 4 (v T + j) + 4)`` for ``v < V`` with one 128-bit load each
    (``V = head_dim / (4 T)``, 1 or 2); columns at or past the real head dim are predicated off.
    First the LSE pass: the row's lanes read the splits ``i T + j`` (every load issued at once,
    unrolled to ``max_splits / T``), reduce max and sum by butterfly shuffles, and leave the weights
    ``w_s`` in shared memory (one slot per split and row, rows padded by one float against bank
    conflicts). Then the weighted sum over the splits in increasing order, ``unroll = 8 / V``
    splits per step, all of a step's loads issued before its first multiply-add (8 vectors of 16
    bytes in flight per lane; the launch's ``min_blocks_per_mp=1`` lets ptxas spend the registers,
    about 80), skipping a split with ``w_s = 0`` as a whole (the predicate is uniform over the
    row). Rows past ``seqused`` or outside every sequence load nothing and store nothing (they
    still take part in the shuffles and barriers).
    ``warps_per_row`` (runtime, a power of two up to the warp count) warps can share a group of
    rows when there are few rows and many splits: warp ``p`` of the group takes splits ``p, p +
    wpr, ...`` and the group's first warp adds the others' sums from shared memory in warp order.

Determinism. Every sum has an order fixed by the code and the shapes alone: the LSE sum per lane
in split order then a butterfly; the weighted sum per warp in split order, then the warps of a
group in warp order; ``warps_per_row`` is a function of the shapes and the GPU's SM count (a
different ``warps_per_row`` may change the last bits). Two runs of one call are bit-identical,
and so are two calls that differ only in the strides of their tensors.

Note [Combine launched early]
    With ``pdl`` (the split-KV forward's ``FwdSm90Config.pdl``) the combine is launched as a
    programmatic dependent of the forward: its CTAs may be placed on the SMs the forward's last CTAs
    leave free once every forward CTA has run ``griddepcontrol.launch_dependents`` (the forward does
    at its start) or exited, and each waits (``griddepcontrol.wait``: the forward complete, its
    partials visible) before its first load. Nothing before the wait reads or writes global memory,
    so the rules of Note [Programmatic dependent launch] in fa4/bwd/sm90.py hold: the forward itself
    stays a plain launch, and memory torch's allocator reuses on the stream is untouched until the
    kernels before have finished. What it saves: the launch gap between the two kernels of a split
    call (measured 0.5 us of a 359 us decode call, RESULTS v0.56). flash-attn-4 waits the same way in
    its combine.

Limits: ``1 <= num_splits <= 256`` (``CombineConfig.max_splits``: shared memory holds one weight
per split), head dim a multiple of 8 up to 256.

The kernel class lives in :mod:`fa4.combine_kernel` (it imports the CuTe DSL, which ``import fa4``
must not); ``fa4.combine.FlashCombine`` names it lazily.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional

import torch

from fa4 import arch as _arch
from fa4.config import ARCHS, KernelConfig
from fa4.validate import check_int32_vector, is_fake, plain_bools

OUT_DTYPES = ("bf16", "fp16", "fp32")
MAX_SPLITS = 256
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8  # flash_attn.cute's rule (the kernel itself needs whole 4-float vectors)
STRIDE_MULTIPLE = 4  # elements: 16 bytes of fp32, the vector width of every load
_BUCKETS = (32, 64, 128, 256)  # compiled head dims (the real one is read at run time)


@dataclass(frozen=True)
class CombineConfig(KernelConfig):
    """Compile key of :class:`fa4.combine_kernel.FlashCombine`.

    ``dtype``: the output's ("bf16", "fp16", "fp32"); the partials are float32. ``head_dim``: the
    compiled head dim (32, 64, 128 or 256, :func:`head_dim_bucket`); the real one is read from the
    tensors at run time. ``varlen``: ``cu_seqlens`` given (packed partials). ``has_seqused``: rows
    past ``seqused`` are not written. ``has_lse``: the LSE is written. ``threads_per_row``: lanes
    per row (0: the default for the head dim, :func:`default_threads_per_row`). ``max_splits``:
    shared-memory slots per row. ``unroll``: splits per step of the weighted sum. ``has_sink``: a
    learnable sink logit per head joins every row's sum (the split-KV forward with
    ``learnable_sink``; Note [Attention sinks in the softmax] in fa4/softmax.py). ``pdl`` (sm_90a and
    up): launched as a programmatic dependent of the kernel before it (Note [Combine launched early]).
    """

    head_dim: int = 128
    varlen: bool = False
    has_seqused: bool = False
    has_lse: bool = True
    threads_per_row: int = 0
    num_threads: int = 128
    max_splits: int = MAX_SPLITS
    unroll: int = 8
    has_sink: bool = False
    pdl: bool = False

    KERNEL: ClassVar[str] = "fa4.combine:FlashCombine"
    # The partials are read by 128-bit loads (tests/test_compile.py disassembles every variant).
    REQUIRED_SASS: ClassVar[tuple] = ("LDG.E.128",)


def head_dim_bucket(d: int) -> int:
    for b in _BUCKETS:
        if d <= b:
            return b
    raise ValueError(f"head_dim {d} > {MAX_HEAD_DIM} is not supported by the combine kernel")


def default_threads_per_row(head_dim: int) -> int:
    """One 128-bit vector per lane where the row allows: 8 lanes for 32 columns, 16 for 64, 32 above."""
    return min(32, max(8, head_dim // 4))


def lanes_and_vectors(head_dim: int, threads_per_row: int) -> tuple[int, int]:
    """``(T, V)``: lanes per row and 128-bit vectors per lane covering ``head_dim`` columns."""
    t = threads_per_row or default_threads_per_row(head_dim)
    return t, -(-head_dim // (4 * t))


def check_config(cfg: CombineConfig) -> None:
    """What :class:`FlashCombine` can compile (ValueError naming the field)."""
    name = type(cfg).__name__
    cfg.check_target(OUT_DTYPES)
    if cfg.head_dim % 32 or not 32 <= cfg.head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"{name}.head_dim must be a multiple of 32 in [32, {MAX_HEAD_DIM}], got {cfg.head_dim}")
    if cfg.threads_per_row not in (0, 8, 16, 32):
        raise ValueError(f"{name}.threads_per_row must be 8, 16 or 32 (0: default), got {cfg.threads_per_row}")
    if cfg.num_threads % 32 or not 32 <= cfg.num_threads <= 1024:
        raise ValueError(f"{name}.num_threads must be a multiple of 32 in [32, 1024], got {cfg.num_threads}")
    t, _ = lanes_and_vectors(cfg.head_dim, cfg.threads_per_row)
    if cfg.max_splits % t or not t <= cfg.max_splits <= 1024:
        raise ValueError(f"{name}.max_splits must be a multiple of threads_per_row ({t}) in [{t}, 1024], "
                         f"got {cfg.max_splits}")
    if not 1 <= cfg.unroll <= 16:
        raise ValueError(f"{name}.unroll must be in [1, 16], got {cfg.unroll}")
    if cfg.pdl and cfg.arch == "sm_80":
        raise ValueError(f"{name}.pdl (a programmatic dependent launch, griddepcontrol) needs sm_90a or later, "
                         f"got arch {cfg.arch!r}")


@functools.lru_cache(maxsize=256)  # once per call signature: it is on every call's host path
def make_config(dtype: str, head_dim: int, arch: str, *, varlen: bool = False, has_seqused: bool = False,
                has_lse: bool = True, has_sink: bool = False, pdl: bool = False) -> CombineConfig:
    d = head_dim_bucket(head_dim)
    t = default_threads_per_row(d)
    _, vecs = lanes_and_vectors(d, t)
    return CombineConfig(arch=arch, dtype=dtype, head_dim=d, varlen=varlen, has_seqused=has_seqused,
                         has_lse=has_lse, threads_per_row=t, unroll=8 // vecs, has_sink=has_sink, pdl=pdl)


def variants(arch: str) -> list[CombineConfig]:
    """Covering set: every output dtype, every head-dim bucket (72 is padded to 128), varlen and
    not, seqused, no LSE."""
    if arch not in ARCHS:
        return []
    out = [make_config(dt, d, arch) for dt in OUT_DTYPES for d in (64, 128)]
    out += [make_config("bf16", d, arch) for d in (32, 72, 256)]
    out += [make_config("fp32", 256, arch), make_config("fp16", 256, arch, varlen=True, has_seqused=True)]
    out += [make_config("bf16", 128, arch, varlen=True), make_config("bf16", 128, arch, has_seqused=True),
            make_config("bf16", 128, arch, varlen=True, has_seqused=True),
            make_config("fp32", 64, arch, has_lse=False), make_config("bf16", 256, arch, varlen=True, has_lse=False),
            make_config("bf16", 128, arch, has_sink=True), make_config("bf16", 64, arch, varlen=True, has_sink=True)]
    if arch != "sm_80":  # the split-KV forward's dependent launch (Note [Combine launched early])
        out += [make_config("bf16", 128, arch, pdl=True), make_config("bf16", 128, arch, varlen=True, has_seqused=True,
                                                                      pdl=True)]
    return list(dict.fromkeys(out))


def __getattr__(name: str):
    if name == "FlashCombine":  # CombineConfig.KERNEL: the DSL is imported on first use only
        from fa4.combine_kernel import FlashCombine

        return FlashCombine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# --------------------------------------------------------------------------------------------
# Host: the launcher and the public function
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return _arch.num_sms(index)


def warps_per_row(cfg: CombineConfig, rows: int, num_splits: int, sm_count: int) -> int:
    """How many warps share a group of rows (Note [Combine thread mapping]): more while the grid
    stays under 16 warps per SM and every warp keeps at least one step of ``unroll`` splits, so
    that a few rows with many splits still have enough loads in flight. A heuristic, to measure."""
    t, _ = lanes_and_vectors(cfg.head_dim, cfg.threads_per_row)
    groups = -(-rows // (32 // t))
    wpr, warps = 1, cfg.num_threads // 32
    while 2 * wpr <= warps and groups * 2 * wpr <= 16 * sm_count and num_splits >= 2 * wpr * cfg.unroll:
        wpr *= 2
    return wpr


def _kernel_view(t):
    """``t`` with the strides the compiled code checks: a size-1 dim's stride (never used) set to 0
    when it is not a multiple of 4 elements."""
    stride = t.stride()
    if all(s % STRIDE_MULTIPLE == 0 or n != 1 for n, s in zip(t.shape[:-1], stride[:-1])):
        return t
    return t.as_strided(t.shape, tuple(0 if n == 1 and i < t.dim() - 1 else s
                                       for i, (n, s) in enumerate(zip(t.shape, stride))))


_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def combine_into(out_partial, lse_partial, out, lse, cu_seqlens=None, seqused=None, *, arch: Optional[str] = None,
                 wpr: Optional[int] = None, sink=None, pdl: bool = False) -> None:
    """Launch the combine on tensors already checked (no validation; layouts in the module docstring).

    ``out_partial`` float32 ``(S, b, s, h, d)`` or packed ``(S, total_q, h, d)``; ``lse_partial``
    float32 ``(S, b, s, h)`` / ``(S, total_q, h)``, any strides; ``out`` ``(b, s, h, d)`` /
    ``(total_q, h, d)`` bf16/fp16/fp32; ``lse`` float32 ``(b, s, h)`` / ``(total_q, h)`` any
    strides, or None. ``cu_seqlens`` (packed only) int32 ``(b + 1,)``; ``seqused`` int32 ``(b,)``
    (packed: with ``cu_seqlens``; packed without ``cu_seqlens``: every token is written). Rows
    with an index >= 2**31 are not supported; ``1 <= S <= 256``. ``arch``: code-generation target
    (default the device's); ``wpr``: force :func:`warps_per_row` (tests, tuning; a power of two
    up to the CTA's warp count). ``sink``: float32 ``(h,)`` learnable sink logits, one more term
    of every row's sum (``CombineConfig.has_sink``). ``pdl``: launched as a programmatic dependent
    of the kernel before it on the stream (Note [Combine launched early]).
    """
    from fa4.jit import get_kernel

    if out_partial.dim() == 4:  # packed: the kernel sees a batch mode of 1
        out_partial, lse_partial, out = out_partial.unsqueeze(1), lse_partial.unsqueeze(1), out.unsqueeze(0)
        lse = lse.unsqueeze(0) if lse is not None else None
    else:
        cu_seqlens = None
    num_splits, b, s, h, d = out_partial.shape
    rows = b * s * h
    if rows == 0:
        return
    dev = out.device.index if out.device.index is not None else 0
    if arch is None:
        arch = _arch.target_arch(_arch.device_capability(dev))
    cfg = make_config(_DTYPE_NAMES[out.dtype], d, arch, varlen=cu_seqlens is not None,
                      has_seqused=seqused is not None, has_lse=lse is not None, has_sink=sink is not None,
                      pdl=pdl)
    if wpr is None:
        wpr = warps_per_row(cfg, rows, num_splits, _sm_count(dev))
    elif wpr & (wpr - 1) or not 1 <= wpr <= cfg.num_threads // 32:
        raise ValueError(f"wpr must be a power of two in [1, {cfg.num_threads // 32}], got {wpr}")
    if 1 in out_partial.shape[:-1]:
        out_partial = _kernel_view(out_partial)
    if 1 in out.shape[:-1]:
        out = _kernel_view(out)
    get_kernel(cfg)(out_partial, lse_partial, out, lse, cu_seqlens, seqused, sink, wpr)


class CombineArgs(NamedTuple):
    """A validated :func:`flash_attn_combine` call."""

    varlen: bool  # packed partials (S, total_q, h, d)
    out_shape: tuple  # (b, s, h, d) / (total_q, h, d)
    lse_shape: tuple  # (b, s, h) / (total_q, h)
    out_dtype: object  # torch dtype of out


def _check_layout(name: str, t, require_aligned: bool) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension (stride 1), got strides {tuple(t.stride())}")
    for dim, (n, s) in enumerate(zip(t.shape[:-1], t.stride()[:-1])):
        if s % STRIDE_MULTIPLE and n > 1:
            raise ValueError(f"{name} stride {s} of dimension {dim} must be a multiple of {STRIDE_MULTIPLE} "
                             f"elements (the kernel moves 4 elements per access), got strides {tuple(t.stride())}")
    if require_aligned and not is_fake(t) and t.data_ptr() % 16:
        raise ValueError(f"{name} must be 16-byte aligned, its data pointer is {t.data_ptr():#x}")


def _check_index_tensor(name: str, t, length: Optional[int], device, what: str) -> int:
    n = check_int32_vector(name, t, device, ref="out_partial", what=f" {what}")
    if length is not None and n != length:
        raise ValueError(f"{name} must have length {length} {what}, got {n}")
    return n


def check_args(out_partial, lse_partial, out=None, out_dtype=None, cu_seqlens=None, seqused=None,
               return_lse=True, *, require_cuda: bool = True) -> CombineArgs:
    """Validate a :func:`flash_attn_combine` call: TypeError / ValueError naming the argument.
    ``require_cuda=False`` accepts CPU / meta tensors (tests)."""
    if not isinstance(out_partial, torch.Tensor):
        raise TypeError(f"out_partial must be a torch.Tensor, got {type(out_partial).__name__}")
    if out_partial.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"out_partial must be torch.float32, torch.bfloat16 or torch.float16, got {out_partial.dtype}")
    if out_partial.dim() not in (4, 5):
        raise ValueError("out_partial must have 5 dimensions (num_splits, batch, seqlen, heads, head_dim) or 4 "
                         f"(num_splits, total_q, heads, head_dim), got shape {tuple(out_partial.shape)}")
    varlen = out_partial.dim() == 4
    device = out_partial.device
    if require_cuda and device.type != "cuda":
        raise ValueError(f"out_partial must be a CUDA tensor, got device {device}")
    if not isinstance(lse_partial, torch.Tensor):
        raise TypeError(f"lse_partial must be a torch.Tensor, got {type(lse_partial).__name__}")
    if lse_partial.dtype != torch.float32:
        raise TypeError(f"lse_partial must be torch.float32, got {lse_partial.dtype}")
    if lse_partial.device != device:
        raise ValueError(f"lse_partial must be on the same device as out_partial ({device}), got {lse_partial.device}")
    if tuple(lse_partial.shape) != tuple(out_partial.shape[:-1]):
        want = "(num_splits, total_q, heads)" if varlen else "(num_splits, batch, seqlen, heads)"
        raise ValueError(f"lse_partial must have shape {want} = {tuple(out_partial.shape[:-1])} to match out_partial "
                         f"{tuple(out_partial.shape)}, got {tuple(lse_partial.shape)}")
    num_splits, d = out_partial.shape[0], out_partial.shape[-1]
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"num_splits (out_partial.shape[0]) must be in [1, {MAX_SPLITS}], got {num_splits}")
    if d % HEAD_DIM_MULTIPLE or not HEAD_DIM_MULTIPLE <= d <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim (out_partial.shape[-1]) must be a multiple of {HEAD_DIM_MULTIPLE} in "
                         f"[{HEAD_DIM_MULTIPLE}, {MAX_HEAD_DIM}], got {d}")
    rows = math.prod(out_partial.shape[1:-1])
    if rows >= 2**31:
        raise ValueError(f"out_partial has {rows} rows (batch * seqlen * heads or total_q * heads); the combine "
                         "kernel indexes rows with 32-bit integers (< 2**31)")
    on_gpu = device.type == "cuda"
    if out_partial.dtype == torch.float32:  # (16-bit partials are widened into a new tensor)
        _check_layout("out_partial", out_partial, on_gpu)
    if on_gpu and not is_fake(lse_partial) and lse_partial.data_ptr() % 4:
        raise ValueError(f"lse_partial must be 4-byte aligned, its data pointer is {lse_partial.data_ptr():#x}")
    (return_lse,) = plain_bools(return_lse)
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {return_lse!r}")
    allowed = (torch.bfloat16, torch.float16, torch.float32)
    if out_dtype is not None and out_dtype not in allowed:
        raise TypeError(f"out_dtype must be torch.bfloat16, torch.float16 or torch.float32 (or None), "
                        f"got {out_dtype!r}")
    out_shape = tuple(out_partial.shape[1:])
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if out.dtype not in allowed:
            raise TypeError(f"out must be torch.bfloat16, torch.float16 or torch.float32, got {out.dtype}")
        if out_dtype is not None and out.dtype != out_dtype:
            raise TypeError(f"out has dtype {out.dtype} but out_dtype is {out_dtype}")
        if tuple(out.shape) != out_shape:
            raise ValueError(f"out must have shape {out_shape} (out_partial's without num_splits), "
                             f"got {tuple(out.shape)}")
        if out.device != device:
            raise ValueError(f"out must be on the same device as out_partial ({device}), got {out.device}")
        _check_layout("out", out, on_gpu)
        if any(s == 0 and n > 1 for n, s in zip(out.shape, out.stride())):
            raise ValueError(f"out must not be a broadcast view (a dimension of stride 0 would have every split "
                             f"write the same elements), got strides {tuple(out.stride())}")
        out_dtype = out.dtype
    elif out_dtype is None:
        out_dtype = out_partial.dtype
    batch = None if varlen else out_partial.shape[1]
    if cu_seqlens is not None:
        if not varlen:
            raise ValueError("cu_seqlens is only for packed partials: out_partial must be (num_splits, total_q, "
                             f"heads, head_dim), got shape {tuple(out_partial.shape)}")
        n = _check_index_tensor("cu_seqlens", cu_seqlens, None, device, "(batch + 1,)")
        if n < 2:
            raise ValueError(f"cu_seqlens must have length batch + 1 >= 2, got {n}")
        batch = n - 1
    if seqused is not None:
        if varlen and cu_seqlens is None:
            raise ValueError("seqused with packed partials (num_splits, total_q, heads, head_dim) needs cu_seqlens")
        _check_index_tensor("seqused", seqused, batch, device, f"(batch,) = ({batch},)")
    return CombineArgs(varlen, out_shape, out_shape[:-1], out_dtype)


def allocate_outputs(args: CombineArgs, device, return_lse: bool, out=None):
    """``(out, lse)`` for a validated call: ``out`` as given or new; ``lse`` float32 in
    ``(b, h, s)`` / ``(h, total_q)`` memory, returned as the ``(b, s, h)`` / ``(total_q, h)``
    transposed view (flash_attn.cute's layout), or None."""
    from fa4.ops import _empty  # NaN-filled under the GPU tests

    if out is None:
        out = _empty(args.out_shape, args.out_dtype, device)
    lse = None
    if return_lse:
        if args.varlen:
            total_q, h = args.lse_shape
            lse = _empty((h, total_q), torch.float32, device).t()
        else:
            b, s, h = args.lse_shape
            lse = _empty((b, h, s), torch.float32, device).transpose(1, 2)
    return out, lse


def flash_attn_combine(out_partial, lse_partial, out=None, out_dtype=None, cu_seqlens=None, seqused=None,
                       virtual_batch_idx=None, return_lse=True):
    """Merge the partial results of a split-KV attention (the same call as flash-attn-4's
    ``flash_attn.cute.flash_attn_combine``).

    ``out_partial``: float32 ``(num_splits, batch, seqlen, heads, head_dim)`` or packed
    ``(num_splits, total_q, heads, head_dim)``, each split's output normalized by its own row sum
    (bf16 / fp16 partials, e.g. stacked outputs of attention calls over chunks of the keys, are
    widened to float32 first: one copy; flash_attn.cute takes them too);
    ``lse_partial``: float32 ``(num_splits, batch, seqlen, heads)`` / ``(num_splits, total_q,
    heads)``, natural log, ``-inf`` for a split that saw no key. ``out``: optional preallocated
    output; ``out_dtype``: bf16 / fp16 / fp32 (default: ``out``'s, else the partials'). ``cu_seqlens``:
    int32 ``(batch + 1,)`` for packed partials; ``seqused``: int32 ``(batch,)``, rows at or past
    ``seqused[b]`` of sequence ``b`` are left untouched (packed: needs ``cu_seqlens``).

    Returns ``(out, lse)``: ``out`` ``(batch, seqlen, heads, head_dim)`` / ``(total_q, heads,
    head_dim)``; ``lse`` float32 ``(batch, seqlen, heads)`` / ``(total_q, heads)``, a transposed
    view of ``(batch, heads, seqlen)`` / ``(heads, total_q)`` memory, or None with
    ``return_lse=False``. Limits: ``1 <= num_splits <= 256``, head_dim a multiple of 8 up to 256.
    Deterministic: two identical calls give bit-identical results. ``virtual_batch_idx`` (a
    persistent scheduler's batch reordering in flash_attn.cute) is not supported yet and raises.
    """
    if virtual_batch_idx is not None:
        raise NotImplementedError("fa4.flash_attn_combine does not support virtual_batch_idx yet (fa4's split-KV "
                                  "forward does not reorder batches)")
    args = check_args(out_partial, lse_partial, out, out_dtype, cu_seqlens, seqused, return_lse)
    with _arch.device_guard(out_partial):  # Note [Device guard] in fa4/arch.py
        if out_partial.dtype != torch.float32:  # (exact: every 16-bit value is a float32 one; compact)
            out_partial = out_partial.to(torch.float32, memory_format=torch.contiguous_format)
        out, lse = allocate_outputs(args, out_partial.device, return_lse, out)
        combine_into(out_partial, lse_partial, out, lse, cu_seqlens, seqused)
    return out, lse
