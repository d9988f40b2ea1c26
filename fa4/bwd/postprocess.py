"""Backward postprocess: ``dq = dq_accum * softmax_scale`` in the input dtype.

The main backward kernels accumulate ``dS @ K`` (without the softmax scale) into the float32
workspace ``dq_accum``; this SIMT kernel scales, rounds once, and writes ``dq`` in the layout of q.
One CTA per (m_block, head, batch); each lane moves 4 columns (a 128-bit float32 load, a 64-bit
store). Rows at or past the sequence's length are not touched. Layouts (varlen: ``b = 1``,
``s = total_q``, with ``cu_seqlens_q``):

    dq_accum  (b, h, s, head_dim_padded)  float32
    dq        (b, s, h, d)                fp16/bf16, last dim contiguous, written
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.bwd.preprocess import _DTYPES, _target, dq_accum_view, head_dim_padded
from fa4.config import KernelConfig
from fa4.seqlen import SeqlenInfo

_COLS_PER_LANE = 4


@dataclass(frozen=True)
class BwdPostprocessConfig(KernelConfig):
    """Compile key of :class:`BwdPostprocess`. ``head_dim``: the padded head dim of ``dq_accum``
    (a multiple of 32); the real one comes from ``dq`` at run time."""

    head_dim: int = 128
    tile_m: int = 64
    num_threads: int = 128
    varlen: bool = False

    KERNEL: ClassVar[str] = "fa4.bwd.postprocess:BwdPostprocess"


def _lanes_per_row(head_dim: int) -> int:
    for lanes in (32, 16, 8):
        if head_dim % (lanes * _COLS_PER_LANE) == 0:
            return lanes
    raise ValueError(f"head_dim {head_dim} must be a multiple of 32")


class BwdPostprocess:
    def __init__(self, cfg: BwdPostprocessConfig):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m = cfg.tile_m
        self.head_dim = cfg.head_dim
        self.num_threads = cfg.num_threads

    @staticmethod
    def can_implement(cfg: BwdPostprocessConfig) -> None:
        cfg.check_target(_DTYPES, head_dim_multiple=32)
        if cfg.num_threads % 32 or not 32 <= cfg.num_threads <= 1024:
            raise ValueError(
                f"BwdPostprocessConfig.num_threads must be a multiple of 32 in [32, 1024], got {cfg.num_threads}"
            )
        rows_per_pass = cfg.num_threads // _lanes_per_row(cfg.head_dim)
        if cfg.tile_m % rows_per_pass:
            raise ValueError(
                f"BwdPostprocessConfig.tile_m ({cfg.tile_m}) must be a multiple of the {rows_per_pass} rows "
                f"{cfg.num_threads} threads cover per pass"
            )

    @staticmethod
    def fake_args(cfg: BwdPostprocessConfig) -> tuple:
        b, s, h = (cute.sym_int() for _ in range(3))
        d = cute.sym_int(divisibility=8)
        dq_accum = cute.runtime.make_fake_compact_tensor(
            Float32, (b, h, s, cfg.head_dim), stride_order=(3, 2, 1, 0), assumed_align=16
        )
        strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
        dq = cute.runtime.make_fake_tensor(_DTYPES[cfg.dtype], (b, s, h, d), strides, assumed_align=16)
        cu_seqlens_q = (
            cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4) if cfg.varlen else None
        )
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return (dq_accum, dq, cu_seqlens_q, Float32(1.0), Int32(1), stream)

    @cute.jit
    def __call__(
        self,
        mdQaccum: cute.Tensor,  # (b, h, s, head_dim_padded) float32
        mdQ: cute.Tensor,  # (b, s, h, d)
        mCuSeqlensQ: Optional[cute.Tensor],  # (b + 1,) int32
        softmax_scale: Float32,
        max_seqlen_q: Int32,  # longest sequence (varlen grid); ignored for fixed length
        stream,
    ):
        if const_expr(mdQ.element_type != self.dtype):
            raise TypeError("dq must have the configured dtype")
        lanes = _lanes_per_row(self.head_dim)
        thr_layout = cute.make_ordered_layout((self.num_threads // lanes, lanes), order=(1, 0))
        val_layout = cute.make_layout((1, _COLS_PER_LANE))
        copy_acc = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128), thr_layout, val_layout
        )
        copy_out = cute.make_tiled_copy_tv(
            cute.make_copy_atom(
                cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=_COLS_PER_LANE * self.dtype.width
            ),
            thr_layout,
            val_layout,
        )
        if const_expr(self.cfg.varlen):
            num_batch = mCuSeqlensQ.shape[0] - 1
            seqlen = max_seqlen_q
        else:
            num_batch = mdQ.shape[0]
            seqlen = mdQ.shape[1]
        grid = (cute.ceil_div(seqlen, self.tile_m), mdQ.shape[2], num_batch)
        self.kernel(mdQaccum, mdQ, mCuSeqlensQ, softmax_scale, copy_acc, copy_out).launch(
            grid=grid, block=[self.num_threads, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(
        self,
        mdQaccum: cute.Tensor,
        mdQ: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        softmax_scale: Float32,
        copy_acc: cute.TiledCopy,
        copy_out: cute.TiledCopy,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        m_block, head, batch = cute.arch.block_idx()
        seq = SeqlenInfo.create(batch, mdQ.shape[1], 0, mCuSeqlensQ=mCuSeqlensQ)
        rows_left = seq.seqlen_q - m_block * self.tile_m
        if rows_left > 0:
            tile = (self.tile_m, self.head_dim)
            mdQ_bh = seq.q_view(mdQ, batch, head)
            mAcc_bh = dq_accum_view(mdQaccum, seq, batch, head)
            thr_acc = copy_acc.get_slice(tidx)
            thr_out = copy_out.get_slice(tidx)
            tAgA = thr_acc.partition_S(cute.local_tile(mAcc_bh, tile, (m_block, 0)))
            tDgD = thr_out.partition_D(cute.local_tile(mdQ_bh, tile, (m_block, 0)))
            tDcD = thr_out.partition_D(cute.make_identity_tensor(tile))
            tArA = cute.make_rmem_tensor_like(tAgA)
            tDrD = cute.make_rmem_tensor_like(tDgD)
            d = mdQ.shape[3]
            for m in cutlass.range_constexpr(cute.size(tAgA, mode=[1])):
                if tDcD[0, m, 0][0] < rows_left:
                    cute.copy(copy_acc, tAgA[None, m, None], tArA[None, m, None])
            tDrD.store((tArA.load() * softmax_scale).to(self.dtype))
            for m in cutlass.range_constexpr(cute.size(tDgD, mode=[1])):
                if tDcD[0, m, 0][0] < rows_left:
                    for k in cutlass.range_constexpr(cute.size(tDgD, mode=[2])):
                        if tDcD[0, m, k][1] < d:
                            cute.copy(copy_out, tDrD[None, m, k], tDgD[None, m, k])


def make_config(dtype: str, head_dim: int, arch: str, *, varlen: bool = False) -> BwdPostprocessConfig:
    return BwdPostprocessConfig(arch=arch, dtype=dtype, head_dim=head_dim_padded(head_dim), varlen=varlen)


def run_postprocess(
    dq_accum,
    dq,
    softmax_scale: float,
    *,
    cu_seqlens_q=None,
    max_seqlen_q: Optional[int] = None,
    arch: Optional[str] = None,
) -> None:
    """Launch the postprocess on torch tensors (layouts in the module docstring)."""
    import torch

    from fa4.jit import get_kernel

    dtype = {torch.bfloat16: "bf16", torch.float16: "fp16"}[dq.dtype]
    varlen = cu_seqlens_q is not None
    if varlen and max_seqlen_q is None:
        raise ValueError("max_seqlen_q is required with cu_seqlens_q")
    seqlen = max_seqlen_q if varlen else dq.shape[1]
    if seqlen == 0 or dq.numel() == 0:
        return
    cfg = make_config(dtype, dq.shape[-1], _target(arch, dq.device), varlen=varlen)
    get_kernel(cfg)(dq_accum, dq, cu_seqlens_q, float(softmax_scale), seqlen)


def variants(arch: str) -> list[BwdPostprocessConfig]:
    """Every padded head dim, both dtypes, varlen on and off."""
    out = [
        BwdPostprocessConfig(arch=arch, dtype=("bf16", "fp16")[i % 2], head_dim=hd)
        for i, hd in enumerate(range(32, 257, 32))
    ]
    out.append(BwdPostprocessConfig(arch=arch, dtype="bf16", head_dim=128, varlen=True))
    out.append(BwdPostprocessConfig(arch=arch, dtype="fp16", head_dim=96, varlen=True))
    return out
