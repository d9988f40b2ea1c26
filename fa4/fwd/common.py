"""What every forward family shares on the host: the kernel signature's fake arguments, the
launch arguments, the grid extent and L2 sections, the option checks, and the launcher.

Every forward kernel's ``__call__`` takes ``(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK,
mSeqUsedK, softmax_scale, softcap, window_left, window_right, max_seqlen_q, *extra, stream)``
(DESIGN.md's tensor conventions); ``extra`` are a family's own runtime scalars (the sm90 family's
persistent grid size).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.config import AttnProblem
from fa4.sched.tile import l2_section_size

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


def pad32(d: int) -> int:
    """Head dims are tiled in multiples of 32 (the padded columns read as zeros, never stored)."""
    return (d + 31) // 32 * 32


def fake_args(cfg, extra: tuple = ()) -> tuple:
    """Fake tensors with symbolic sizes (64-bit strides, multiples of 16 bytes) and scalars for the
    forward signature, ``extra`` runtime scalars before the stream."""
    dt = DTYPES[cfg.dtype]

    def strides():
        return tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)

    b_q, b_k, s_q, s_k, h, h_k = (cute.sym_int() for _ in range(6))
    mQ = cute.runtime.make_fake_tensor(dt, (b_q, s_q, h, cfg.head_dim), strides(), assumed_align=16)
    mK = cute.runtime.make_fake_tensor(dt, (b_k, s_k, h_k, cfg.head_dim), strides(), assumed_align=16)
    mV = cute.runtime.make_fake_tensor(dt, (b_k, s_k, h_k, cfg.head_dim_v), strides(), assumed_align=16)
    mO = cute.runtime.make_fake_tensor(dt, (b_q, s_q, h, cfg.head_dim_v), strides(), assumed_align=16)
    mLSE = None
    if cfg.has_lse:
        mLSE = cute.runtime.make_fake_tensor(Float32, (b_q, h, s_q), (cute.sym_int64(), cute.sym_int64(), 1),
                                             assumed_align=4)

    def vec(flag):
        return cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4) if flag else None

    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (mQ, mK, mV, mO, mLSE, vec(cfg.varlen_q), vec(cfg.varlen_k), vec(cfg.has_seqused_k),
            Float32(1.0), Float32(0.0), Int32(0), Int32(0), Int32(1)) + tuple(extra) + (stream,)


def grid_extent(mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
                mCuSeqlensK: Optional[cute.Tensor], max_seqlen_q: Int32, tile_m: int, kv_row_bytes: int):
    """Host side of a forward ``__call__`` (traced inline): ``(num_batch, num_m_blocks, section)``,
    the L2 section of :func:`fa4.sched.tile.l2_section_size` for K/V rows of ``kv_row_bytes``."""
    num_heads = mQ.shape[2]
    if const_expr(mCuSeqlensQ is not None):
        num_batch = mCuSeqlensQ.shape[0] - 1
    elif const_expr(mCuSeqlensK is not None):
        num_batch = mCuSeqlensK.shape[0] - 1
    else:
        num_batch = mQ.shape[0]
    num_m_blocks = cute.ceil_div(max_seqlen_q, tile_m)
    # K/V rows of one sequence (for varlen: the average length).
    seqlen_k_avg = mK.shape[1] if const_expr(mCuSeqlensK is None) else mK.shape[1] // num_batch
    section = l2_section_size(seqlen_k_avg, kv_row_bytes, num_heads // mK.shape[2], num_heads * num_batch)
    return num_batch, num_m_blocks, section


def check_head_dims(cfg) -> None:
    """``head_dim`` / ``head_dim_v`` multiples of 8 in [8, 256] (ValueError naming the field)."""
    for field in ("head_dim", "head_dim_v"):
        d = getattr(cfg, field)
        if d % 8 or not 8 <= d <= 256:
            raise ValueError(f"{type(cfg).__name__}.{field} must be a multiple of 8 in [8, 256], got {d}")


def bucket(table: dict, d: int, family: str) -> int:
    """The tuning-table key for head dim ``d``: the smallest key ``>= d``."""
    for b in sorted(table):
        if d <= b:
            return b
    raise ValueError(f"head_dim {d} > {max(table)} is not supported by the {family} forward")


def check_softmax_options(cfg) -> None:
    name = type(cfg).__name__
    if not 0.0 <= cfg.exp2_emu_frac <= 1.0:
        raise ValueError(f"{name}.exp2_emu_frac must be in [0, 1], got {cfg.exp2_emu_frac}")
    if not 0.0 <= cfg.rescale_threshold <= 64.0:
        raise ValueError(f"{name}.rescale_threshold must be in [0, 64], got {cfg.rescale_threshold}")


def run(cfg, problem: AttnProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None, seqused_k=None,
        extra: tuple = ()) -> None:
    """Launch the kernel of ``cfg``: q/k/v/out 4D (varlen: (1, total, h, d)), lse (b, h, s_q) /
    (1, h, total_q) or None; outputs preallocated by the caller."""
    from fa4.jit import get_kernel

    fn = get_kernel(cfg)
    window_left, window_right = (problem.window_left, problem.window_right) if cfg.local else (0, 0)
    fn(q, k, v, out, lse if cfg.has_lse else None,
       cu_seqlens_q if cfg.varlen_q else None, cu_seqlens_k if cfg.varlen_k else None,
       seqused_k if cfg.has_seqused_k else None,
       float(problem.softmax_scale), float(problem.softcap) if cfg.has_softcap else 1.0,
       int(window_left), int(window_right), int(max(problem.seqlen_q, 1)), *extra)
