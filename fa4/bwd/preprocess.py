"""Backward preprocess: the per-row quantities the backward kernels read, and workspace zeroing.

For every query row ``i`` of every (batch, head) it writes

* ``dpsum[i] = sum_d dO[i, d] * O[i, d] - dLSE[i]`` (float32; the ``- dLSE`` term only when a
  gradient of the LSE is given): with ``D = dpsum``, ``dS = P * (dP - D)`` covers both the gradient
  through ``out`` and the one through ``lse``, since ``d lse_i / d s_ij = P_ij``;
* ``lse_log2[i] = lse[i] * log2(e)``, so the main kernels recompute ``P = exp2(s * scale_log2 -
  lse_log2)`` with one FMA. A row with no allowed key has ``lse = -inf``; it gets ``lse_log2 =
  +inf``, which makes every ``P`` of the row exactly 0 whatever its scores are (masked ``-inf`` or
  not), so its gradients are 0 and never NaN;
* the padding rows of the last tile (``lse_log2 = +inf``, ``dpsum = 0``) and zeros into the float32
  ``dq_accum`` tiles of its rows: whole tiles of the main kernel's ``tile_m`` rows (Note [Padded row
  tiles] in fa4/bwd/workspace.py);
* zeros into the dQ slot counters when given (a flat int32 array, grid-strided: the
  deterministic mode's semaphores, or the counters of a main kernel whose first contributor to a
  slot stores its tile, Note [First store] in fa4/bwd/sm90.py; that kernel needs no zeroed
  ``dq_accum``: ``zero_dq`` off).

One CTA per (m_block, head, batch); each row is read by ``threads_per_row`` adjacent lanes with
128-bit loads and reduced with butterfly shuffles. Rows at or past the sequence's length are
neither read nor written. Layouts (``s`` = seqlen_q; varlen: ``b = 1``, ``s = total_q``):

    O, dO       (b, s, h, d)               fp16/bf16, last dim contiguous
    lse, dlse   (b, h, s)                  float32
    lse_log2    see fa4/bwd/workspace.py   float32, written (padding rows too)
    dpsum       see fa4/bwd/workspace.py   float32, written (padding rows too)
    dq_accum    see fa4/bwd/workspace.py   float32, zeroed (tiles of the sequences' rows)
    semaphore   (n,)                       int32, zeroed
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import ClassVar, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.bwd.workspace import dq_accum_shape, dq_accum_view, head_dim_padded, rows_shape, rows_view
from fa4.config import KernelConfig
from fa4.seqlen import SeqlenInfo, grid_extent

LOG2_E = math.log2(math.e)
_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


@dataclass(frozen=True)
class BwdPreprocessConfig(KernelConfig):
    """Compile key of :class:`BwdPreprocess`.

    ``head_dim`` is the padded head dim (:func:`head_dim_padded`); the real one is read from the
    tensors at run time and columns past it are predicated off. ``varlen``: ``cu_seqlens_q`` given,
    tensors packed as ``(1, total_q, ...)``. ``has_dlse``: subtract the LSE gradient.
    ``has_semaphore``: zero the dQ slot counters. ``zero_dq``: zero dq_accum (off where the main
    kernel's first contributor of each slot stores its tile). ``dq_head_dim``: dq_accum's padded
    head dim (q's) where it differs from O's (``head_dim_v != head_dim``), else 0. ``pdl`` (sm_90a;
    the next kernel is launched as a programmatic dependent): each CTA lets it launch from its start
    (Note [Programmatic dependent launch] in fa4/bwd/sm90.py).
    """

    head_dim: int = 128
    dq_head_dim: int = 0
    tile_m: int = 128
    num_threads: int = 128
    varlen: bool = False
    has_dlse: bool = False
    has_semaphore: bool = False
    zero_dq: bool = True
    pdl: bool = False

    KERNEL: ClassVar[str] = "fa4.bwd.preprocess:BwdPreprocess"


def _vector_cols(width_bits: int, head_dim: int) -> int:
    """Columns one row-group of lanes covers per pass: the largest of 128/64/32 bytes-per-lane
    multiples that divides the row, so every lane of a row does the same number of 128-bit loads."""
    elems = 128 // width_bits
    for lanes in (16, 8, 4):
        if head_dim % (lanes * elems) == 0:
            return lanes * elems
    raise ValueError(f"head_dim {head_dim} must be a multiple of {4 * elems}")


class BwdPreprocess:
    """SIMT kernel: D = rowsum(dO * O) (- dLSE), lse_log2, and zeroing of dq_accum / semaphores."""

    def __init__(self, cfg: BwdPreprocessConfig):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m = cfg.tile_m
        self.head_dim = cfg.head_dim
        self.dq_head_dim = cfg.dq_head_dim or cfg.head_dim
        self.num_threads = cfg.num_threads
        self.lanes = _vector_cols(self.dtype.width, cfg.head_dim) // (128 // self.dtype.width)

    @staticmethod
    def can_implement(cfg: BwdPreprocessConfig) -> None:
        cfg.check_target(_DTYPES, head_dim_multiple=32)
        if cfg.num_threads % 32 or not 32 <= cfg.num_threads <= 1024:
            raise ValueError(
                f"BwdPreprocessConfig.num_threads must be a multiple of 32 in [32, 1024], got {cfg.num_threads}"
            )
        if cfg.tile_m > cfg.num_threads:
            raise ValueError(
                f"BwdPreprocessConfig.tile_m ({cfg.tile_m}) must be <= num_threads ({cfg.num_threads}): "
                "one thread per LSE row"
            )
        lanes = _vector_cols(16, cfg.head_dim) // 8
        if cfg.tile_m % (cfg.num_threads // lanes) and (cfg.num_threads // lanes) % cfg.tile_m:
            raise ValueError(f"BwdPreprocessConfig.tile_m ({cfg.tile_m}) does not tile with {cfg.num_threads} threads")

    @staticmethod
    def fake_args(cfg: BwdPreprocessConfig) -> tuple:
        dtype = _DTYPES[cfg.dtype]
        b, s, h = (cute.sym_int() for _ in range(3))
        d = cute.sym_int(divisibility=8)

        def qo_like():
            strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
            return cute.runtime.make_fake_tensor(dtype, (b, s, h, d), strides, assumed_align=16)

        def rows_f32():
            return cute.runtime.make_fake_compact_tensor(Float32, (b, h, s), stride_order=(2, 1, 0), assumed_align=4)

        o, do = qo_like(), qo_like()
        lse = rows_f32()
        dlse = rows_f32() if cfg.has_dlse else None
        batch_plus_1 = cute.sym_int()
        cu_seqlens_q = (
            cute.runtime.make_fake_compact_tensor(Int32, (batch_plus_1,), assumed_align=4) if cfg.varlen else None
        )
        def rows_padded():  # whole tiles of rows (Note [Padded row tiles])
            return cute.runtime.make_fake_compact_tensor(Float32, (b, h, cute.sym_int()), stride_order=(2, 1, 0),
                                                         assumed_align=16)

        lse_log2, dpsum = rows_padded(), rows_padded()
        # Its own row count: whole tiles (Note [dQ accumulator layout]).
        dq_accum = cute.runtime.make_fake_compact_tensor(
            Float32, (b, h, cute.sym_int(), cfg.dq_head_dim or cfg.head_dim), stride_order=(3, 2, 1, 0),
            assumed_align=16
        )
        semaphore = (
            cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
            if cfg.has_semaphore
            else None
        )
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return (o, do, lse, dlse, cu_seqlens_q, lse_log2, dpsum, dq_accum, semaphore, Int32(1), Int32(64), stream)

    def _tiled_copies(self):
        """128-bit vector copies: (rows, lanes) thread layouts, 8 halves / 4 floats per lane."""
        elems = 128 // self.dtype.width
        cols = _vector_cols(self.dtype.width, self.head_dim)
        lanes = cols // elems
        copy_o = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128),
            cute.make_ordered_layout((self.num_threads // lanes, lanes), order=(1, 0)),
            cute.make_layout((1, elems)),
        )
        cols_acc = _vector_cols(Float32.width, self.dq_head_dim)
        lanes_acc = cols_acc // 4
        copy_acc = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128),
            cute.make_ordered_layout((self.num_threads // lanes_acc, lanes_acc), order=(1, 0)),
            cute.make_layout((1, 4)),
        )
        return copy_o, copy_acc

    @cute.jit
    def __call__(
        self,
        mO: cute.Tensor,  # (b, s, h, d)
        mdO: cute.Tensor,  # (b, s, h, d)
        mLSE: cute.Tensor,  # (b, h, s) float32
        mdLSE: Optional[cute.Tensor],  # (b, h, s) float32
        mCuSeqlensQ: Optional[cute.Tensor],  # (b + 1,) int32
        mLSElog2: cute.Tensor,  # (b, h, rows) float32 (fa4/bwd/workspace.py)
        mDpsum: cute.Tensor,  # (b, h, rows) float32
        mdQaccum: cute.Tensor,  # (b, h, rows, head_dim_padded) float32
        mSemaphore: Optional[cute.Tensor],  # (n,) int32
        max_seqlen_q: Int32,  # longest sequence (varlen grid); ignored for fixed length
        dq_tile_m: Int32,  # the main kernel's tile_m: dq_accum's tiles (Note [dQ accumulator layout])
        stream,
    ):
        if const_expr(mO.element_type != self.dtype or mdO.element_type != self.dtype):
            raise TypeError("O and dO must have the configured dtype")
        copy_o, copy_acc = self._tiled_copies()
        num_batch, seqlen = grid_extent(mO, mCuSeqlensQ, max_seqlen_q)
        # Blocks over the rows rounded up to dq_tile_m (the workspaces' whole tiles).
        grid = (cute.ceil_div(cute.ceil_div(seqlen, dq_tile_m) * dq_tile_m, self.tile_m), mO.shape[2], num_batch)
        self.kernel(
            mO, mdO, mLSE, mdLSE, mCuSeqlensQ, mLSElog2, mDpsum, mdQaccum, mSemaphore, dq_tile_m, copy_o, copy_acc
        ).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mO: cute.Tensor,
        mdO: cute.Tensor,
        mLSE: cute.Tensor,
        mdLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mLSElog2: cute.Tensor,
        mDpsum: cute.Tensor,
        mdQaccum: cute.Tensor,
        mSemaphore: Optional[cute.Tensor],
        dq_tile_m: Int32,
        copy_o: cute.TiledCopy,
        copy_acc: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        if const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_launch_dependents()

        if const_expr(mSemaphore is not None):
            self.zero_semaphores(mSemaphore, tidx)

        seq = SeqlenInfo.create(batch, mO.shape[1], 0, mCuSeqlensQ=mCuSeqlensQ)
        row0 = m_block * self.tile_m
        rows_left = seq.seqlen_q - row0  # rows of this tile inside the sequence
        # Whole tiles: rows up to seqlen_q rounded up to the main kernel's tile_m (which need not
        # divide this kernel's 128: the last 80-row tile may start in this block and end past it).
        rows_tiled = cute.ceil_div(seq.seqlen_q, dq_tile_m) * dq_tile_m - row0
        if rows_tiled > 0:
            # (s, d) / (s,) views of this (batch, head), starting at the sequence's first row.
            mO_bh, mdO_bh = seq.q_view(mO, batch, head), seq.q_view(mdO, batch, head)
            mdQ_bh = dq_accum_view(mdQaccum, seq, batch, head, dq_tile_m)
            mLSElog2_bh = rows_view(mLSElog2, seq, batch, head, dq_tile_m)
            mDpsum_bh = rows_view(mDpsum, seq, batch, head, dq_tile_m)
            mLSE_bh = seq.lse_view(mLSE, batch, head)
            mdLSE_bh = seq.lse_view(mdLSE, batch, head) if const_expr(mdLSE is not None) else None
            if rows_left > 0:
                self.row_dot(mO_bh, mdO_bh, mDpsum_bh, mdLSE_bh, m_block, rows_left, copy_o, tidx)
            self.lse_to_log2(mLSE_bh, mLSElog2_bh, mDpsum_bh, row0, rows_left, rows_tiled, tidx)
            if const_expr(self.cfg.zero_dq):
                self.zero_dq_accum(mdQ_bh, m_block, rows_tiled, copy_acc, tidx)

    @cute.jit
    def row_dot(
        self,
        mO_bh: cute.Tensor,
        mdO_bh: cute.Tensor,
        mDpsum_bh: cute.Tensor,
        mdLSE_bh: Optional[cute.Tensor],
        m_block: Int32,
        rows_left: Int32,
        copy_o: cute.TiledCopy,
        tidx: Int32,
    ):
        """dpsum[row] = sum(dO * O) over the row (- dLSE[row]), for the rows of this tile."""
        tile = (self.tile_m, self.head_dim)
        thr = copy_o.get_slice(tidx)
        tOgO = thr.partition_S(cute.local_tile(mO_bh, tile, (m_block, 0)))
        tOgdO = thr.partition_S(cute.local_tile(mdO_bh, tile, (m_block, 0)))
        tOcO = thr.partition_S(cute.make_identity_tensor(tile))  # (row, col) of each element
        tOrO = cute.make_rmem_tensor_like(tOgO)
        tOrdO = cute.make_rmem_tensor_like(tOgdO)
        tOrO.fill(0.0)
        tOrdO.fill(0.0)
        d = mO_bh.shape[1]
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            if tOcO[0, m, 0][0] < rows_left:
                for k in cutlass.range_constexpr(cute.size(tOgO, mode=[2])):
                    if tOcO[0, m, k][1] < d:
                        cute.copy(copy_o, tOgO[None, m, k], tOrO[None, m, k])
                        cute.copy(copy_o, tOgdO[None, m, k], tOrdO[None, m, k])
        prod = tOrO.load().to(Float32) * tOrdO.load().to(Float32)
        vals = cute.make_rmem_tensor(tOrO.layout, Float32)
        vals.store(prod)
        for m in cutlass.range_constexpr(cute.size(tOgO, mode=[1])):
            acc = Float32(0.0)
            for k in cutlass.range_constexpr(cute.size(tOgO, mode=[2])):
                for v in cutlass.range_constexpr(cute.size(tOgO, mode=[0])):
                    acc += vals[v, m, k]
            acc = cute.arch.warp_reduction(acc, lambda x, y: x + y, threads_in_group=self.lanes)
            row = tOcO[0, m, 0][0]
            if tOcO[0, m, 0][1] == 0 and row < rows_left:
                if const_expr(mdLSE_bh is not None):
                    acc -= mdLSE_bh[m_block * self.tile_m + row]
                mDpsum_bh[m_block * self.tile_m + row] = acc

    @cute.jit
    def lse_to_log2(self, mLSE_bh: cute.Tensor, mLSElog2_bh: cute.Tensor, mDpsum_bh: cute.Tensor, row0: Int32,
                    rows_left: Int32, rows_tiled: Int32, tidx: Int32):
        """lse_log2 = lse * log2(e); -inf (no allowed key) -> +inf so that P = exp2(s - lse_log2) = 0.
        Padding rows of the last tile: lse_log2 = +inf, dpsum = 0 (Note [Padded row tiles])."""
        if tidx < self.tile_m:
            if tidx < rows_left:
                lse = mLSE_bh[row0 + tidx]
                lse_log2 = Float32.inf
                if lse != -Float32.inf:
                    lse_log2 = lse * Float32(LOG2_E)
                mLSElog2_bh[row0 + tidx] = lse_log2
            elif tidx < rows_tiled:
                mLSElog2_bh[row0 + tidx] = Float32.inf
                mDpsum_bh[row0 + tidx] = Float32(0.0)

    @cute.jit
    def zero_dq_accum(
        self, mdQ_bh: cute.Tensor, m_block: Int32, rows_left: Int32, copy_acc: cute.TiledCopy, tidx: Int32
    ):
        tile = (self.tile_m, self.dq_head_dim)
        thr = copy_acc.get_slice(tidx)
        tAgA = thr.partition_D(cute.local_tile(mdQ_bh, tile, (m_block, 0)))
        tAcA = thr.partition_D(cute.make_identity_tensor(tile))
        zero = cute.make_rmem_tensor_like(tAgA)
        zero.fill(0.0)
        for m in cutlass.range_constexpr(cute.size(tAgA, mode=[1])):
            if tAcA[0, m, 0][0] < rows_left:
                cute.copy(copy_acc, zero[None, m, None], tAgA[None, m, None])

    @cute.jit
    def zero_semaphores(self, mSemaphore: cute.Tensor, tidx: Int32):
        """Grid-strided zeroing of the flat semaphore array (every CTA takes part, even empty ones)."""
        gx, gy, gz = cute.arch.grid_dim()
        bx, by, bz = cute.arch.block_idx()
        num_ctas = gx * gy * gz
        cta = (bz * gy + by) * gx + bx
        n = mSemaphore.shape[0]
        for i in cutlass.range(cta * self.num_threads + tidx, n, num_ctas * self.num_threads):
            mSemaphore[i] = Int32(0)


def _compact(t):
    """``t`` with exactly the row-major strides of its shape (the compiled code checks them, size-1
    dims included): ``t`` itself when it has them, else a copy."""
    expected, acc = [], 1
    for n in reversed(t.shape):
        expected.append(acc)
        acc *= n
    if tuple(reversed(expected)) == t.stride():
        return t
    import torch

    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def _target(arch: Optional[str], device) -> str:
    if arch is not None:
        return arch
    from fa4.arch import device_capability, target_arch

    return target_arch(device_capability(device.index if device.index is not None else 0))


@functools.lru_cache(maxsize=256)  # once per call signature: it is on every backward call's host path
def make_config(
    dtype: str, head_dim: int, arch: str, *, varlen: bool = False, has_dlse: bool = False, has_semaphore: bool = False,
    dq_head_dim: int = 0, zero_dq: bool = True, pdl: bool = False,
) -> BwdPreprocessConfig:
    """``head_dim``: O's; ``dq_head_dim``: q's where it differs (0: the same)."""
    dq = head_dim_padded(dq_head_dim) if dq_head_dim else 0
    return BwdPreprocessConfig(
        arch=arch,
        dtype=dtype,
        head_dim=head_dim_padded(head_dim),
        dq_head_dim=dq if dq != head_dim_padded(head_dim) else 0,
        varlen=varlen,
        has_dlse=has_dlse,
        has_semaphore=has_semaphore,
        zero_dq=zero_dq,
        pdl=pdl,
    )


def run_preprocess(
    out,
    dout,
    lse,
    lse_log2,
    dpsum,
    dq_accum,
    *,
    dlse=None,
    cu_seqlens_q=None,
    max_seqlen_q: Optional[int] = None,
    semaphore=None,
    dq_tile_m: int = 64,
    dq_head_dim: Optional[int] = None,
    arch: Optional[str] = None,
    zero_dq: bool = True,
    pdl: bool = False,
) -> None:
    """Launch the preprocess on torch tensors (layouts in the module docstring).

    ``out``/``dout`` ``(b, s, h, d)`` (varlen: ``(1, total_q, h, d)`` with ``cu_seqlens_q`` and
    ``max_seqlen_q``); ``lse``/``dlse`` float32 ``(b, h, s)``, made contiguous here if they are not
    (an autograd ``dlse`` is often an expanded view); ``lse_log2``, ``dpsum`` float32
    :func:`fa4.bwd.workspace.rows_shape` and ``dq_accum`` float32
    :func:`fa4.bwd.workspace.dq_accum_shape` for ``dq_tile_m`` (the main kernel's tile_m),
    contiguous, written whole tiles at a time;
    ``semaphore`` int32, any shape, contiguous, zeroed. ``arch``: code-generation target, default
    the device's. ``zero_dq``: zero ``dq_accum`` (off: the main kernel stores each slot's first
    tile, and ``semaphore`` counts them; or there is no accumulator: the dQ pass's 16-row stand-in).
    ``pdl``: the main kernel that follows is a programmatic dependent launch (``cfg.pdl``); the
    preprocess itself is never one (Note [Programmatic dependent launch] in fa4/bwd/sm90.py).
    """
    import torch

    from fa4.jit import get_kernel

    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[out.dtype]
    d = out.shape[-1]
    varlen = cu_seqlens_q is not None
    if varlen and max_seqlen_q is None:
        raise ValueError("max_seqlen_q is required with cu_seqlens_q")
    if dq_tile_m not in (16, 32, 64, 80, 128):
        raise ValueError(f"dq_tile_m must be one of the main kernels' tile_m (16, 32, 64, 80, 128), got {dq_tile_m}")
    batch = cu_seqlens_q.shape[0] - 1 if varlen else out.shape[0]
    dq_d = dq_head_dim or d  # q's head dim (dq_accum's), where head_dim_v != head_dim
    want = dq_accum_shape(batch, out.shape[2], out.shape[1], head_dim_padded(dq_d), dq_tile_m, varlen)
    # Without zeroing the preprocess does not touch dq_accum: any row count (the dQ pass's 16-row
    # stand-in, fa4/bwd/workspace.py dq_accum_placeholder); its other modes still must match.
    got = tuple(dq_accum.shape)
    if (got != want if zero_dq else got[:2] + got[3:] != want[:2] + want[3:]) or not dq_accum.is_contiguous():
        raise ValueError(f"dq_accum must be a contiguous float32 tensor of shape {want}, got {tuple(dq_accum.shape)}")
    want_rows = rows_shape(batch, out.shape[2], out.shape[1], dq_tile_m, varlen)
    for name, t in (("lse_log2", lse_log2), ("dpsum", dpsum)):
        if tuple(t.shape) != want_rows or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous float32 tensor of shape {want_rows}, got {tuple(t.shape)}")
    if out.shape[1] == 0 or (varlen and max_seqlen_q == 0):
        if semaphore is not None:
            semaphore.zero_()
        return
    lse = _compact(lse)
    dlse = _compact(dlse) if dlse is not None else None
    cfg = make_config(
        dtype,
        d,
        _target(arch, out.device),
        varlen=varlen,
        has_dlse=dlse is not None,
        has_semaphore=semaphore is not None,
        dq_head_dim=dq_d,
        zero_dq=zero_dq,
        pdl=pdl,
    )
    sem_flat = semaphore.view(-1) if semaphore is not None else None
    get_kernel(cfg)(
        out,
        dout,
        lse,
        dlse,
        cu_seqlens_q,
        lse_log2,
        dpsum,
        dq_accum,
        sem_flat,
        max_seqlen_q if varlen else out.shape[1],
        dq_tile_m,
    )


def variants(arch: str) -> list[BwdPreprocessConfig]:
    """Every padded head dim, both dtypes, and each flag on and off at least once."""
    out = []
    for i, hd in enumerate(range(32, 257, 32)):
        dtype = ("bf16", "fp16")[i % 2]
        out.append(BwdPreprocessConfig(arch=arch, dtype=dtype, head_dim=hd))
    out.append(
        BwdPreprocessConfig(arch=arch, dtype="bf16", head_dim=128, varlen=True, has_dlse=True, has_semaphore=True)
    )
    out.append(BwdPreprocessConfig(arch=arch, dtype="fp16", head_dim=64, varlen=True))
    out.append(BwdPreprocessConfig(arch=arch, dtype="bf16", head_dim=96, has_dlse=True, has_semaphore=True))
    out.append(BwdPreprocessConfig(arch=arch, dtype="bf16", head_dim=128, has_semaphore=True, zero_dq=False))
    if arch == "sm_90a":  # (the sm90 backward's programmatic dependent launch)
        out.append(BwdPreprocessConfig(arch=arch, dtype="bf16", head_dim=128, has_semaphore=True, pdl=True))
    return out
