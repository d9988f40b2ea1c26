"""Device code of the split-KV combine (:mod:`fa4.combine` holds the math, layouts and host side).

Imported lazily (through ``fa4.combine.FlashCombine``): it imports the CuTe DSL, ``import fa4``
must not.
"""

from __future__ import annotations

import math
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.combine import CombineConfig, check_config, lanes_and_vectors
from fa4.cute_utils import warp_allreduce

LOG2_E = math.log2(math.e)
_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": Float32}
_VEC = 4  # fp32 elements per 128-bit load of a partial


class FlashCombine:
    """SIMT kernel: ``out = sum_s exp(lse_s - lse) O_s`` and ``lse = log sum_s exp(lse_s)`` per row.

    Roles of a thread (``T = cfg.threads_per_row`` lanes per row, ``rows_per_warp = 32 // T``):
    lane ``l`` of warp ``w`` serves row ``(w // wpr) * rows_per_warp + l // T`` of the CTA's rows,
    head-dim vectors ``j * T + l % T`` (``j < V``, 4 floats each) and, in the LSE pass, splits
    ``i * T + l % T``; ``wpr`` (runtime, a power of two dividing the warp count) warps share a
    group of rows and take the splits ``s = w % wpr (mod wpr)`` each, their sums added in warp
    order through shared memory. See :mod:`fa4.combine`, Note [Combine thread mapping].
    """

    def __init__(self, cfg: CombineConfig):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.num_threads = cfg.num_threads
        self.num_warps = cfg.num_threads // 32
        self.lanes, self.vecs = lanes_and_vectors(cfg.head_dim, cfg.threads_per_row)
        self.rows_per_warp = 32 // self.lanes
        self.max_splits = cfg.max_splits
        self.unroll = cfg.unroll
        self.lse_per_lane = cfg.max_splits // self.lanes

    @staticmethod
    def can_implement(cfg: CombineConfig) -> None:
        check_config(cfg)

    @staticmethod
    def fake_args(cfg: CombineConfig) -> tuple:
        dtype = _DTYPES[cfg.dtype]
        splits, b, s, h = (cute.sym_int() for _ in range(4))
        d = cute.sym_int(divisibility=8)

        def strides_16B(rank):  # last dim contiguous, others multiples of 4 elements (16 B of fp32)
            return tuple(cute.sym_int64(divisibility=4) for _ in range(rank - 1)) + (1,)

        def any_strides(rank):
            return tuple(cute.sym_int64() for _ in range(rank))

        mOp = cute.runtime.make_fake_tensor(Float32, (splits, b, s, h, d), strides_16B(5), assumed_align=16)
        mLSEp = cute.runtime.make_fake_tensor(Float32, (splits, b, s, h), any_strides(4), assumed_align=4)
        mO = cute.runtime.make_fake_tensor(dtype, (b, s, h, d), strides_16B(4), assumed_align=16)
        mLSE = (cute.runtime.make_fake_tensor(Float32, (b, s, h), any_strides(3), assumed_align=4)
                if cfg.has_lse else None)
        num_seqs = cute.sym_int()
        mCu = (cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4)
               if cfg.varlen else None)
        mSeqused = (cute.runtime.make_fake_compact_tensor(Int32, (num_seqs,), assumed_align=4)
                    if cfg.has_seqused else None)
        mSink = (cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
                 if cfg.has_sink else None)
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return (mOp, mLSEp, mO, mLSE, mCu, mSeqused, mSink, Int32(1), stream)

    @cute.jit
    def __call__(
        self,
        mOp: cute.Tensor,  # (splits, b, s, h, d) float32; varlen (splits, 1, total_q, h, d)
        mLSEp: cute.Tensor,  # (splits, b, s, h) float32, any strides; varlen (splits, 1, total_q, h)
        mO: cute.Tensor,  # (b, s, h, d) bf16/fp16/fp32; varlen (1, total_q, h, d)
        mLSE: Optional[cute.Tensor],  # (b, s, h) float32, any strides; varlen (1, total_q, h)
        mCuSeqlens: Optional[cute.Tensor],  # (batch + 1,) int32 (varlen)
        mSeqused: Optional[cute.Tensor],  # (batch,) int32: rows written per sequence
        mSink: Optional[cute.Tensor],  # (h,) float32: learnable sink logits (cfg.has_sink)
        warps_per_row: Int32,  # wpr: warps sharing one group of rows (power of two <= num_warps)
        stream,
    ):
        if const_expr(mO.element_type != self.dtype):
            raise TypeError(f"out must be {self.dtype}, got {mO.element_type}")
        if const_expr(mOp.element_type != Float32 or mLSEp.element_type != Float32):
            raise TypeError("out_partial and lse_partial must be float32")
        total_rows = mO.shape[0] * mO.shape[1] * mO.shape[2]
        rows_per_cta = (self.num_warps // warps_per_row) * self.rows_per_warp
        grid = (cute.ceil_div(total_rows, rows_per_cta), 1, 1)

        @cute.struct
        class SharedStorage:
            # Per warp and row: the splits' weights exp(lse_s - max); one float of padding per row
            # so that the rows a warp reads at the same split fall in different banks.
            sW: cute.struct.MemRange[Float32, self.num_warps * self.rows_per_warp * (self.max_splits + 1)]
            # Per warp and lane: the partial weighted sums handed to the group's first warp.
            sAcc: cute.struct.Align[cute.struct.MemRange[Float32, self.num_threads * self.vecs * _VEC], 16]

        # min_blocks_per_mp=1 lifts ptxas's default register target (full occupancy, ~32
        # registers), under which it interleaves the loads of a step with their multiply-adds and
        # keeps only two 128-bit loads in flight per lane instead of `unroll` (seen in the SASS).
        self.kernel(mOp, mLSEp, mO, mLSE, mCuSeqlens, mSeqused, mSink, warps_per_row, total_rows,
                    SharedStorage).launch(
            grid=grid, block=[self.num_threads, 1, 1], smem=SharedStorage.size_in_bytes(), stream=stream,
            min_blocks_per_mp=1, use_pdl=self.cfg.pdl,
        )

    @cute.kernel
    def kernel(
        self,
        mOp: cute.Tensor,
        mLSEp: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlens: Optional[cute.Tensor],
        mSeqused: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        warps_per_row: Int32,
        total_rows: Int32,
        SharedStorage: cutlass.Constexpr,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        if const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()  # the forward's partials complete (Note [Combine launched early])
        warp = cute.arch.make_warp_uniform(tidx // 32)
        lane = tidx % 32
        group = warp // warps_per_row
        phase = warp % warps_per_row  # this warp's splits: phase, phase + wpr, ...
        row_in_warp = lane // self.lanes
        lane_r = lane % self.lanes
        rows_per_cta = (self.num_warps // warps_per_row) * self.rows_per_warp
        row = bidx * rows_per_cta + group * self.rows_per_warp + row_in_warp

        storage = cutlass.memory.SmemAllocator().allocate(SharedStorage)
        sW = storage.sW.get_tensor(
            cute.make_layout((self.num_warps * self.rows_per_warp, self.max_splits), stride=(self.max_splits + 1, 1))
        )[warp * self.rows_per_warp + row_in_warp, None]  # (max_splits,) of this warp's copy of the row
        sAcc = storage.sAcc.get_tensor(
            cute.make_layout((_VEC, self.vecs, 32, self.num_warps), stride=(1, _VEC, self.vecs * _VEC,
                                                                           32 * self.vecs * _VEC))
        )

        b, s, h, active = self.row_coords(mO, mCuSeqlens, mSeqused, row, total_rows)
        num_splits = mOp.shape[0]
        lse, inv_sum = self.lse_pass(mLSEp, sW, b, s, h, active, num_splits, lane_r, mSink)
        cute.arch.sync_warp()  # sW of the row, written by its T lanes, is read by all of them
        acc = self.weighted_sum(mOp, sW, b, s, h, num_splits, phase, warps_per_row, lane_r)

        if warps_per_row > 1:  # uniform over the CTA: every thread reaches the barriers
            if phase > 0:
                sAcc[None, None, lane, warp].store(acc.load())
            cute.arch.barrier()
            if phase == 0:
                for p in cutlass.range(1, warps_per_row, unroll=1):  # fixed order: warps 1, 2, ...
                    acc.store(acc.load() + sAcc[None, None, lane, warp + p].load())
        if phase == 0 and active:
            self.store(mO, mLSE, acc, lse, inv_sum, b, s, h, lane_r)

    @cute.jit
    def row_coords(self, mO: cute.Tensor, mCuSeqlens: Optional[cute.Tensor], mSeqused: Optional[cute.Tensor],
                   row: Int32, total_rows: Int32):
        """``(b, s, h, active)`` of flat row ``row`` (``h`` fastest, then ``s``, then ``b``; varlen:
        ``b = 0``, ``s`` = the packed token). ``active``: the row is in the tensor and belongs to
        the rows written (``s < seqused[b]``; varlen: the token lies in a sequence, at a position
        below that sequence's ``seqused``)."""
        num_heads, seqlen = mO.shape[2], mO.shape[1]
        r = cutlass.min(row, total_rows - 1)  # rows past the end compute on the last one, unwritten
        h = r % num_heads
        q = r // num_heads
        s = q % seqlen
        b = q // seqlen
        active = row < total_rows
        if const_expr(mCuSeqlens is not None):
            num_seqs = mCuSeqlens.shape[0] - 1
            active = active and s >= mCuSeqlens[0] and s < mCuSeqlens[num_seqs]
            if const_expr(mSeqused is not None):
                # The sequence of token s: the last i with cu_seqlens[i] <= s (binary search).
                lo = Int32(0)
                hi = num_seqs
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if mCuSeqlens[mid] <= s:
                        lo = mid
                    else:
                        hi = mid
                active = active and s - mCuSeqlens[lo] < mSeqused[lo]
        elif const_expr(mSeqused is not None):
            active = active and s < mSeqused[b]
        return b, s, h, active

    @cute.jit
    def lse_pass(self, mLSEp: cute.Tensor, sW: cute.Tensor, b: Int32, s: Int32, h: Int32, active,
                 num_splits: Int32, lane_r: Int32, mSink: Optional[cute.Tensor] = None):
        """The row's splits over its T lanes: ``m = max lse_s``, ``w_s = exp2((lse_s - m) log2 e)``
        into ``sW``, ``sum = sum_s w_s`` (per lane in split order, then a butterfly over the T
        lanes: a fixed order). Returns ``(lse, 1 / sum)``; a row whose splits are all ``-inf``
        (or an inactive row) gets ``lse = -inf`` and ``1 / sum = 0``. With ``mSink`` the head's sink
        logit is one more term of the max and of the sum (lane 0 adds it, before the butterfly),
        with no value vector: it only scales the weights down."""
        rL = cute.make_rmem_tensor((self.lse_per_lane,), Float32)
        rL.fill(-Float32.inf)
        # Every split's load is issued at once (unrolled to max_splits / T, predicated off past
        # num_splits): one memory round trip, whatever the number of splits.
        gLSEp = mLSEp[None, b, s, h]  # (splits,) of this row
        for i in cutlass.range_constexpr(self.lse_per_lane):
            k = i * self.lanes + lane_r
            if active and k < num_splits:
                rL[i] = gLSEp[k]
        m = -Float32.inf
        sink = -Float32.inf
        if const_expr(mSink is not None):
            if active:
                sink = mSink[h]
            m = sink
        for i in cutlass.range_constexpr(self.lse_per_lane):
            m = cute.arch.fmax(m, rL[i])
        m = warp_allreduce(m, cute.arch.fmax, width=self.lanes)
        m_safe = m if m != -Float32.inf else Float32(0.0)  # all -inf: every weight exp2(-inf) = 0
        row_sum = Float32(0.0)
        if const_expr(mSink is not None):
            if lane_r == 0:
                row_sum = cute.math.exp2((sink - m_safe) * Float32(LOG2_E), fastmath=True)
        for i in cutlass.range_constexpr(self.lse_per_lane):
            # (lse_s - m) first: exact enough near 0, where the weights matter.
            w = cute.math.exp2((rL[i] - m_safe) * Float32(LOG2_E), fastmath=True)
            sW[i * self.lanes + lane_r] = w
            row_sum += w
        row_sum = warp_allreduce(row_sum, lambda x, y: x + y, width=self.lanes)
        # Once per row: the accurate log (not MUFU lg2), natural, so no ln(2) rescale rounds it.
        lse = m_safe + cute.math.log(row_sum)  # -inf when row_sum = 0
        inv_sum = Float32(0.0)
        if row_sum > Float32(0.0):
            inv_sum = Float32(1.0) / row_sum
        return lse, inv_sum

    @cute.jit
    def weighted_sum(self, mOp: cute.Tensor, sW: cute.Tensor, b: Int32, s: Int32, h: Int32, num_splits: Int32,
                     phase: Int32, warps_per_row: Int32, lane_r: Int32) -> cute.Tensor:
        """``acc = sum_s w_s O_s`` over this warp's splits ``phase + i * wpr``, in increasing ``s``.
        Steps of ``unroll`` splits: all their loads are issued before the first multiply-add
        uses one. A split with ``w_s = 0`` (``lse_s = -inf``, or an inactive row) is not loaded:
        its ``O_s`` may be garbage."""
        d = mOp.shape[4]
        U = self.unroll
        acc = cute.make_rmem_tensor(cute.make_layout((_VEC, self.vecs)), Float32)
        acc.fill(0.0)
        rO = cute.make_rmem_tensor(cute.make_layout((_VEC, self.vecs, U)), Float32)
        rW = cute.make_rmem_tensor(cute.make_layout((U,)), Float32)
        load = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), Float32, num_bits_per_copy=128)
        gOp = mOp[None, b, s, h, None]  # (splits, d) of this row
        for k0 in cutlass.range(phase, num_splits, warps_per_row * U, unroll=1):
            rO.fill(0.0)
            for u in cutlass.range_constexpr(U):
                k = k0 + u * warps_per_row
                rW[u] = Float32(0.0)
                if k < num_splits:
                    rW[u] = sW[k]
                for v in cutlass.range_constexpr(self.vecs):
                    c = v * self.lanes + lane_r
                    if rW[u] > Float32(0.0) and c * _VEC < d:
                        cute.copy(load, cute.local_tile(gOp[k, None], (_VEC,), (c,)), rO[None, v, u])
            for u in cutlass.range_constexpr(U):
                acc.store(acc.load() + rW[u] * rO[None, None, u].load())
        return acc

    @cute.jit
    def store(self, mO: cute.Tensor, mLSE: Optional[cute.Tensor], acc: cute.Tensor, lse: Float32, inv_sum: Float32,
              b: Int32, s: Int32, h: Int32, lane_r: Int32):
        d = mO.shape[3]
        gRow = mO[b, s, h, None]
        rOut = cute.make_rmem_tensor(cute.make_layout((_VEC, self.vecs)), self.dtype)
        rOut.store((acc.load() * inv_sum).to(self.dtype))
        st = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=_VEC * self.dtype.width)
        for v in cutlass.range_constexpr(self.vecs):
            c = v * self.lanes + lane_r
            if c * _VEC < d:
                cute.copy(st, rOut[None, v], cute.local_tile(gRow, (_VEC,), (c,)))
        if const_expr(mLSE is not None):
            if lane_r == 0:
                mLSE[b, s, h] = lse


FlashCombine.kernel.set_name_prefix("fa4_combine", remove_cutlass_symbol=True)
