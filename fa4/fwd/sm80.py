"""Ampere (sm80 family) attention forward: cp.async + ldmatrix + mma.sync m16n8k16.

The sm80 family runs on every arch from sm_80 on (``cfg.arch`` is the code-generation target), so
this is also the reference path on Hopper / Blackwell GPUs (``KernelOptions(arch="sm80")``).

Structure of :class:`FlashFwdSm80` (one CTA = one ``tile_m`` block of queries of one (batch, head);
every warp owns ``tile_m / num_warps`` query rows and all ``tile_n`` keys of a block):

* ``kernel``: tile from the scheduler (LPT order for causal/local/varlen, :mod:`fa4.sched.tile`),
  sequence info, the tile's K-block range, then ``mainloop`` and ``epilogue``. Pack GQA
  (``qhead_per_kvhead = g > 1``, Note [Pack GQA] in fa4/pack_gqa.py): the scheduler's heads are kv
  heads and a tile's rows are packed rows of its ``g`` q heads (:class:`fa4.pack_gqa.TileRows`).
  Split-KV (Note [Split-KV partials] there): scheduler head ``head * num_splits + split`` works on
  its split's share :func:`fa4.sched.tile.split_range` of the tile's K blocks.
* ``load_Q`` / ``load_K`` / ``load_V``: 16-byte ``cp.async`` into swizzled smem; rows past the
  sequence and head-dim columns past ``head_dim`` are never read from global memory and are zero in
  smem (pad columns are zeroed once at the start and never written by ``cp.async``).
  ``load_Q_packed``: the same ``cp.async`` partition, each row from its own (query position, q
  head) address.
* ``mainloop``: K blocks from the last to the first; the first one is masked (``seqlen_k`` and
  causal/local), then the blocks that touch the right edge of the window (masked), the interior
  (no mask code at all), and the blocks that touch the left edge of a local window (masked). The
  boundaries are clamped to the range, so a split's sub-range is masked the same way.
* ``compute_one_n_block``: ``S = Q K^T`` (ldmatrix one k-slice ahead of the MMAs), softcap, mask,
  online softmax (:class:`fa4.softmax.OnlineSoftmax`: conditional rescale, exp2 emulation), P
  converted to 16 bits in registers and ``O += P V`` (V read with transposing ldmatrix).
* ``epilogue``: O normalized, staged through smem (reusing sQ), written with 16-byte stores (packed
  rows: row by row, :func:`fa4.pack_gqa.store_rows`); LSE. Split-KV: the float32 O and the LSE of
  the split go to its slot of the partials straight from registers (an empty split writes O = 0,
  LSE = -inf).

Note [K/V pipeline]
    ``num_stages`` smem buffers each for K and V, one ``cp.async`` group per K or V block. Prologue:
    Q, then K/V of the first ``num_stages`` blocks (the last V only from the loop). Iteration ``i``
    (block ``n``, stage ``i % num_stages``): wait until at most ``2 * num_stages - 2`` groups are in
    flight (K[n] landed) + barrier; issue V of block ``n - num_stages + 1``; ``S = Q K[n]^T``;
    (with one stage: wait V[n] + barrier now, issue K[n - 1] into the buffer K[n] just freed);
    softmax; (with more stages: wait V[n] + barrier, issue K[n - num_stages]); ``O += P V[n]``.
    Empty groups are committed when a block does not exist, so the counts stay uniform. With one
    stage this is FlashAttention-2's schedule: V loads under ``Q K^T``, the next K under softmax
    and ``P V``.

Note [no ``from __future__ import annotations``]
    ``cute.struct`` reads the field annotations of ``SharedStorage`` as objects, so this module
    keeps annotations evaluated.
"""

from dataclasses import dataclass, replace
from functools import partial
from types import SimpleNamespace
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass.cute.nvgpu import cpasync, warp

from fa4.config import AttnFwdConfig, AttnProblem, KernelOptions
from fa4.cute_utils import (
    convert_f32_to_half,
    gemm_sm80,
    gemm_sm80_rs,
    make_acc_as_A,
    make_acc_mn_view,
    predicate_cols,
    smem_layout_atom_sm80,
    tiled_copy_rows_16B,
    tiled_mma_sm80,
)
from fa4.fwd import common as fwd_common
from fa4.mask import AttentionMask, walk_blocks
from fa4.mods import check_config, launch_aux, lookup
from fa4.mods_kernel import BlockSkip, UserMods, check_block_skip, fake_aux
from fa4.pack_gqa import TileRows, partial_slot, row_sinks, store_acc_rows, store_lse_rows, store_rows
from fa4.sched.tile import SectionTileScheduler, loose_plan, split_head, split_range
from fa4.seqlen import SeqlenInfo
from fa4.softmax import OnlineSoftmax, apply_softcap, score_scales

# Max dynamic shared memory per CTA (bytes) by code-generation target.
SMEM_CAPACITY = {"sm_80": 166912, "sm_87": 166912, "sm_90a": 232448, "sm_90": 232448, "sm_100a": 232448,
                 "sm_100": 232448, "sm_103a": 232448}
SMEM_CAPACITY_DEFAULT = 101376  # sm_86 / sm_89 / sm_120: 99 KB

_DTYPES = fwd_common.DTYPES


_pad32 = fwd_common.pad32


@dataclass(frozen=True)
class FwdSm80Config(AttnFwdConfig):
    """Compile key of the sm80 forward. ``q_in_regs``: Q fragments are loaded from smem once and
    kept in registers (saves ldmatrix traffic, costs registers). ``qhead_per_kvhead > 1``: pack
    GQA, the tile's rows are that many q heads of one kv head (Note [Pack GQA] in
    fa4/pack_gqa.py); ``split_kv``: O and LSE are float32 partials of a runtime number of K splits
    (Note [Split-KV partials] there). ``block_skip`` (not with pack GQA): ``(aux slot, block_q,
    block_k)`` of a block-sparse call's block table, ``()`` without one: each tile narrows its K
    blocks to those from its lowest visible one to its highest (:meth:`BlockSkip.narrow`; the
    blocks between are computed, the table's mask hiding the hidden ones)."""

    head_dim: int = 128
    head_dim_v: int = 128
    tile_m: int = 128
    tile_n: int = 64
    num_threads: int = 128
    num_stages: int = 1
    q_in_regs: bool = False
    has_lse: bool = True
    exp2_emu_frac: float = 0.0
    rescale_threshold: float = 0.0
    sum_rounded: bool = False
    qhead_per_kvhead: int = 1
    split_kv: bool = False
    block_skip: tuple = ()

    KERNEL = "fa4.fwd.sm80:FlashFwdSm80"

    @property
    def lpt(self) -> bool:
        """Longest-first tile order: causal / local / varlen grids have uneven tiles."""
        return (self.causal or self.local or self.varlen_q or self.varlen_k or self.has_seqused_k
                or self.has_seqused_q)


BLOCK_SKIP = False
"""Whether a block-sparse forward narrows each tile's K blocks (``FwdSm80Config.block_skip``). Off:
compiled (CPU), not run on a GPU, and its spills grow: the d128 kernel with the table's mask_mod has a
240-byte stack frame for sm_90a (56 without a mask_mod), 608 with the narrowing (sm_80: 488). The
backward's narrowing costs 8 bytes there and is on (fa4/bwd/sm80.py)."""


def smem_bytes(cfg: FwdSm80Config) -> int:
    d, dv = _pad32(cfg.head_dim), _pad32(cfg.head_dim_v)
    return 2 * (cfg.tile_m * max(d, dv) + cfg.num_stages * cfg.tile_n * (d + dv))


def acc_registers(cfg: FwdSm80Config) -> int:
    """fp32 accumulator registers per thread (O and S)."""
    return (cfg.tile_m * _pad32(cfg.head_dim_v) + cfg.tile_m * cfg.tile_n) // cfg.num_threads


class FlashFwdSm80:
    """See the module docstring."""

    def __init__(self, cfg: FwdSm80Config):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m, self.tile_n = cfg.tile_m, cfg.tile_n
        self.num_threads, self.num_stages = cfg.num_threads, cfg.num_stages
        self.tile_hdim, self.tile_hdimv = _pad32(cfg.head_dim), _pad32(cfg.head_dim_v)
        self.check_hdim = cfg.head_dim != self.tile_hdim
        self.check_hdim_v = cfg.head_dim_v != self.tile_hdimv
        self.pack = cfg.qhead_per_kvhead > 1
        # User functions traced into the K-block step (fa4/mods.py); None when absent.
        self.score_mod, self.mask_mod = lookup(cfg.score_mod), lookup(cfg.mask_mod)
        self.split = cfg.split_kv

    # ----------------------------------------------------------------------------------------
    # Host side
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def can_implement(cfg: FwdSm80Config) -> None:
        if cfg.dtype not in _DTYPES:
            raise ValueError(f"FwdSm80Config.dtype must be one of {tuple(_DTYPES)}, got {cfg.dtype!r}")
        fwd_common.check_head_dims(cfg)
        if cfg.page_rows:
            raise NotImplementedError("the sm80 forward does not implement paged K/V (page_table) yet")
        check_config(cfg, "FwdSm80Config", backward=False)
        check_block_skip(cfg, "FwdSm80Config", pack_gqa=cfg.qhead_per_kvhead != 1)
        if cfg.num_threads not in (64, 128, 256):
            raise ValueError(f"FwdSm80Config.num_threads (KernelOptions.num_threads) must be 64, 128 or 256, "
                             f"got {cfg.num_threads}")
        rows_per_warp = 16 * (cfg.num_threads // 32)
        if cfg.tile_m % rows_per_warp:
            raise ValueError(f"FwdSm80Config.tile_m (KernelOptions.tile_m) must be a multiple of 16 * warps = "
                             f"{rows_per_warp}, got {cfg.tile_m}")
        if cfg.tile_m > 256:
            raise ValueError(f"FwdSm80Config.tile_m (KernelOptions.tile_m) must be <= 256, got {cfg.tile_m}")
        # Each gmem copy pass covers num_threads / (threads per row) rows (8 threads per 64-wide row).
        rows_per_pass = cfg.num_threads // 8 if min(_pad32(cfg.head_dim), _pad32(cfg.head_dim_v)) % 64 == 0 \
            else cfg.num_threads // 4
        if cfg.tile_n % 16 or cfg.tile_n % rows_per_pass or not 16 <= cfg.tile_n <= 256:
            raise ValueError(f"FwdSm80Config.tile_n (KernelOptions.tile_n) must be a multiple of 16 and of "
                             f"{rows_per_pass} in [16, 256], got {cfg.tile_n}")
        if cfg.tile_m % rows_per_pass:
            raise ValueError(f"FwdSm80Config.tile_m (KernelOptions.tile_m) must be a multiple of {rows_per_pass}")
        if cfg.num_stages not in (1, 2, 3):
            raise ValueError(f"FwdSm80Config.num_stages (KernelOptions.num_stages) must be 1, 2 or 3, "
                             f"got {cfg.num_stages}")
        cap = SMEM_CAPACITY.get(cfg.arch, SMEM_CAPACITY_DEFAULT)
        if smem_bytes(cfg) > cap:
            raise ValueError(f"shared memory of tile_m={cfg.tile_m}, tile_n={cfg.tile_n}, num_stages={cfg.num_stages} "
                             f"(KernelOptions) at head_dim {cfg.head_dim}/{cfg.head_dim_v} is {smem_bytes(cfg)} bytes, "
                             f"over the {cap} of {cfg.arch}")
        if acc_registers(cfg) > 224:
            raise ValueError(f"tile_m={cfg.tile_m}, tile_n={cfg.tile_n}, num_threads={cfg.num_threads} (KernelOptions) "
                             f"need {acc_registers(cfg)} accumulator registers per thread at head_dim_v "
                             f"{cfg.head_dim_v} (max 224): use more threads or smaller tiles")
        fwd_common.check_softmax_options(cfg)
        if cfg.qhead_per_kvhead < 1:
            raise ValueError(f"FwdSm80Config.qhead_per_kvhead must be >= 1, got {cfg.qhead_per_kvhead}")
        if cfg.split_kv and not cfg.has_lse:
            raise ValueError("FwdSm80Config.split_kv needs has_lse (the combine reads every split's LSE)")

    @staticmethod
    def fake_args(cfg: FwdSm80Config) -> tuple:
        return fwd_common.fake_args(cfg, extra=(Int32(1), fake_aux(cfg.aux)))

    def _setup(self):
        """Layouts, copy atoms and the tiled MMA (trace-time constants)."""
        dt = self.dtype
        atom_q = smem_layout_atom_sm80(dt, self.tile_hdim)
        atom_v = smem_layout_atom_sm80(dt, self.tile_hdimv)
        self.sQ_layout = cute.tile_to_shape(atom_q, (self.tile_m, self.tile_hdim), (0, 1))
        self.sK_layout = cute.tile_to_shape(atom_q, (self.tile_n, self.tile_hdim, self.num_stages), (0, 1, 2))
        self.sV_layout = cute.tile_to_shape(atom_v, (self.tile_n, self.tile_hdimv, self.num_stages), (0, 1, 2))
        self.sO_layout = cute.tile_to_shape(atom_v, (self.tile_m, self.tile_hdimv), (0, 1))

        g2s = cute.make_copy_atom(cpasync.CopyG2SOp(cache_mode=cpasync.LoadCacheMode.GLOBAL), dt, num_bits_per_copy=128)
        r2g = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), dt, num_bits_per_copy=128)
        self.gmem_copy_QK = tiled_copy_rows_16B(g2s, self.num_threads, atom_q)
        self.gmem_copy_V = tiled_copy_rows_16B(g2s, self.num_threads, atom_v)
        self.gmem_copy_O = tiled_copy_rows_16B(r2g, self.num_threads, atom_v)
        self.tiled_mma = tiled_mma_sm80(dt, self.num_threads, self.num_threads // 32)

        q_elems = max(cute.cosize(self.sQ_layout), cute.cosize(self.sO_layout))
        k_elems, v_elems = cute.cosize(self.sK_layout), cute.cosize(self.sV_layout)

        @cute.struct
        class SharedStorage:
            sQ: cute.struct.Align[cute.struct.MemRange[dt, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, k_elems], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, v_elems], 1024]

        self.SharedStorage = SharedStorage

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d); varlen (1, total_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_k, d); varlen (1, total_k, h_k, d)
        mV: cute.Tensor,  # (b, s_k, h_k, dv)
        mO: cute.Tensor,  # (b, s_q, h, dv); split-KV: float32 (num_splits * b, s_q, h, dv)
        mLSE: Optional[cute.Tensor],  # (b, h, s_q) float32; varlen (1, h, total_q); split: (num_splits * b, ...)
        mCuSeqlensQ: Optional[cute.Tensor],  # (b + 1,) int32
        mCuSeqlensK: Optional[cute.Tensor],  # (b + 1,) int32
        mSeqUsedQ: Optional[cute.Tensor],  # (b,) int32
        mSeqUsedK: Optional[cute.Tensor],  # (b,) int32
        mPageTable: Optional[cute.Tensor],  # paged K/V: not implemented by this family (can_implement)
        mSink: Optional[cute.Tensor],  # (h,) float32: learnable sink logits (cfg.has_sink)
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_q: Int32,  # longest query sequence (= s_q when not varlen): sizes the grid
        num_splits: Int32,  # split-KV: K splits per tile (1 unless cfg.split_kv)
        mAux: Optional[tuple],  # the user functions' aux tensors (cfg.aux; fa4/mods.py)
        stream,
    ):
        self._setup()
        cfg = self.cfg
        if const_expr(not self.split):
            num_splits = Int32(1)
        num_batch, num_m_blocks, section, sched_heads = fwd_common.grid_extent(
            mQ, mK, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, self.tile_m, 2 * (self.tile_hdim + self.tile_hdimv),
            cfg.qhead_per_kvhead, num_splits)
        prescale, scale_log2 = score_scales(softmax_scale, softcap, cfg.has_softcap, self.score_mod is not None)
        self.kernel(
            mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mSink, mAux,
            scale_log2, prescale, window_left, window_right, num_m_blocks, num_batch, section, num_splits,
            self.sQ_layout, self.sK_layout, self.sV_layout, self.sO_layout,
            self.gmem_copy_QK, self.gmem_copy_V, self.gmem_copy_O, self.tiled_mma,
        ).launch(
            grid=SectionTileScheduler.grid(num_m_blocks, sched_heads, num_batch),
            block=[self.num_threads, 1, 1],
            smem=self.SharedStorage.size_in_bytes(),
            stream=stream,
        )

    # ----------------------------------------------------------------------------------------
    # Device side
    # ----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mV: cute.Tensor,
        mO: cute.Tensor,
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        mAux: Optional[tuple],
        scale_log2: Float32,
        prescale: Optional[Float32],
        window_left: Int32,
        window_right: Int32,
        num_m_blocks: Int32,
        num_batch: Int32,
        section: Int32,
        num_splits: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        gmem_copy_QK: cute.TiledCopy,
        gmem_copy_V: cute.TiledCopy,
        gmem_copy_O: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
    ):
        cfg = self.cfg
        g = cfg.qhead_per_kvhead
        # Scheduler heads: q heads, kv heads when packed, times the splits (fwd_common.grid_extent).
        sched_heads = mQ.shape[2]
        if const_expr(self.pack or self.split):
            sched_heads = mQ.shape[2] // g * num_splits
        sched = SectionTileScheduler(num_m_blocks, sched_heads, num_batch, section, reverse=cfg.lpt)
        m_block, head, batch = sched.tile()
        split = Int32(0)
        if const_expr(self.split):
            head, split = split_head(head, num_splits)
        seqlen = SeqlenInfo.create(batch, mQ.shape[1], mK.shape[1], mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSeqUsedQ)
        rows = TileRows.create(g, self.tile_m, m_block, head, seqlen.seqlen_q)
        # Varlen grids are sized by the longest sequence: shorter ones skip their extra tiles.
        if m_block * self.tile_m < rows.num_rows:
            head_kv = head if const_expr(self.pack) else head // (mQ.shape[2] // mK.shape[2])
            mask = AttentionMask(self.tile_m, self.tile_n, cfg.causal, cfg.local, seqlen.seqlen_q,
                                 seqlen.seqlen_k, window_left, window_right, g)
            smem = cutlass.memory.SmemAllocator()
            storage = smem.allocate(self.SharedStorage)
            sQ = storage.sQ.get_tensor(sQ_layout)
            sK = storage.sK.get_tensor(sK_layout)
            sV = storage.sV.get_tensor(sV_layout)
            # Packed Q rows are loaded row by row from mQ (load_Q_packed).
            mQ_cur = None if const_expr(self.pack) else seqlen.q_view(mQ, batch, head)
            p = self.partition(mQ_cur, seqlen.k_view(mK, batch, head_kv), seqlen.k_view(mV, batch, head_kv),
                               sQ, sK, sV, m_block, gmem_copy_QK, gmem_copy_V, tiled_mma)
            acc_O = cute.make_rmem_tensor(p.thr_mma.partition_shape_C((self.tile_m, self.tile_hdimv)), Float32)
            acc_O.fill(0.0)
            softmax = OnlineSoftmax(scale_log2, cute.size(make_acc_mn_view(acc_O).shape[0]),
                                    cfg.exp2_emu_frac, cfg.rescale_threshold,
                                    self.dtype if cfg.sum_rounded else None)
            softmax.reset()
            n_min, n_max = mask.n_block_range(m_block)
            if const_expr(self.split):
                n_min, n_max = split_range(n_min, n_max, split, num_splits)
            if const_expr(cfg.block_skip):  # (every thread of the CTA: whole warps)
                slot, bq, bk = cfg.block_skip
                n_min, n_max = BlockSkip(mAux[slot], bq, bk, self.tile_m, self.tile_n, batch, head, m_block).narrow(
                    n_min, n_max)
            umod = None
            if const_expr(self.score_mod is not None or self.mask_mod is not None):
                umod = UserMods(self.score_mod, self.mask_mod, self.tile_m, self.tile_n, g, batch, head, seqlen, mAux)
            self.mainloop(p, acc_O, softmax, mask, seqlen, rows, mQ, batch, m_block, n_min, n_max, prescale,
                          tiled_mma, umod)
            sinks = None
            if const_expr(cfg.has_sink and not self.split):  # split-KV: the combine adds it
                sinks = row_sinks(mSink, p.thr_mma, rows, self.tile_hdimv, softmax.num_rows)
            lse = softmax.finalize(acc_O, sinks)
            sO = cute.make_tensor(sQ.iterator, sO_layout)
            # Batch index of O / LSE (0 for varlen Q); with split-KV the partial's slot (Note [Split-KV partials]).
            slot = partial_slot(split, batch, mQ.shape[0], cfg.varlen_q)
            mO_cur, mLSE_cur = mO, mLSE  # packed rows / split-KV: rows are addressed one by one
            if const_expr(not (self.pack or self.split)):
                mLSE_cur = seqlen.lse_view(mLSE, slot, head) if const_expr(mLSE is not None) else None
                mO_cur = seqlen.q_view(mO, slot, head)
            self.epilogue(acc_O, lse, mO_cur, mLSE_cur, sO, seqlen, rows, slot, m_block, gmem_copy_O, tiled_mma)

    @cute.jit
    def partition(self, mQ_cur, mK_cur, mV_cur, sQ, sK, sV, m_block: Int32, gmem_copy_QK, gmem_copy_V,
                  tiled_mma) -> SimpleNamespace:
        """Thread partitions of Q/K/V (global, smem, registers), identity tensors for predicates.
        ``mQ_cur`` is None for packed rows (:meth:`load_Q_packed` partitions Q row by row)."""
        tidx, _, _ = cute.arch.thread_idx()
        # (tile_m, d), (tile_n, d, n_blocks), (tile_n, dv, n_blocks)
        gQ = None
        if const_expr(mQ_cur is not None):
            gQ = cute.local_tile(mQ_cur, (self.tile_m, self.tile_hdim), (m_block, 0))
        gK = cute.local_tile(mK_cur, (self.tile_n, self.tile_hdim), (None, 0))
        gV = cute.local_tile(mV_cur, (self.tile_n, self.tile_hdimv), (None, 0))
        # V^T view of the V stages for the P @ V MMA: (dv, tile_n, stages)
        sVt = cute.composition(
            sV, cute.make_layout((self.tile_hdimv, self.tile_n, self.num_stages),
                                 stride=(self.tile_n, 1, self.tile_n * self.tile_hdimv))
        )
        thr_copy_QK = gmem_copy_QK.get_slice(tidx)
        thr_copy_V = gmem_copy_V.get_slice(tidx)
        cQ = cute.make_identity_tensor((self.tile_m, self.tile_hdim))
        cK = cute.make_identity_tensor((self.tile_n, self.tile_hdim))
        cV = cute.make_identity_tensor((self.tile_n, self.tile_hdimv))
        tQcQ = thr_copy_QK.partition_S(cQ)
        tKcK = thr_copy_QK.partition_S(cK)
        tVcV = thr_copy_V.partition_S(cV)
        thr_mma = tiled_mma.get_slice(tidx)
        ldm = warp.LdMatrix8x8x16bOp(transpose=False, num_matrices=4)
        ldm_t = warp.LdMatrix8x8x16bOp(transpose=True, num_matrices=4)
        smem_copy_Q = cute.make_tiled_copy_A(cute.make_copy_atom(ldm, self.dtype), tiled_mma).get_slice(tidx)
        smem_copy_K = cute.make_tiled_copy_B(cute.make_copy_atom(ldm, self.dtype), tiled_mma).get_slice(tidx)
        smem_copy_V = cute.make_tiled_copy_B(cute.make_copy_atom(ldm_t, self.dtype), tiled_mma).get_slice(tidx)
        return SimpleNamespace(
            gmem_copy_QK=gmem_copy_QK, gmem_copy_V=gmem_copy_V, thr_mma=thr_mma, thr_copy_QK=thr_copy_QK,
            tQgQ=thr_copy_QK.partition_S(gQ) if const_expr(gQ is not None) else None,
            tQsQ=thr_copy_QK.partition_D(sQ), tQcQ=tQcQ,
            t0QcQ=gmem_copy_QK.get_slice(0).partition_S(cQ),
            tKgK=thr_copy_QK.partition_S(gK), tKsK=thr_copy_QK.partition_D(sK), tKcK=tKcK,
            t0KcK=gmem_copy_QK.get_slice(0).partition_S(cK),
            tVgV=thr_copy_V.partition_S(gV), tVsV=thr_copy_V.partition_D(sV), tVcV=tVcV,
            t0VcV=gmem_copy_V.get_slice(0).partition_S(cV),
            # Head-dim predicates (None when the head dim fills the padded tile).
            tQpQ=predicate_cols(tQcQ, self.cfg.head_dim) if const_expr(self.check_hdim) else None,
            tKpK=predicate_cols(tKcK, self.cfg.head_dim) if const_expr(self.check_hdim) else None,
            tVpV=predicate_cols(tVcV, self.cfg.head_dim_v) if const_expr(self.check_hdim_v) else None,
            tSrQ=thr_mma.make_fragment_A(thr_mma.partition_A(sQ)),
            tSrK=thr_mma.make_fragment_B(thr_mma.partition_B(sK[None, None, 0])),
            tOrVt=thr_mma.make_fragment_B(thr_mma.partition_B(sVt[None, None, 0])),
            smem_copy_Q=smem_copy_Q, smem_copy_K=smem_copy_K, smem_copy_V=smem_copy_V,
            tSsQ=smem_copy_Q.partition_S(sQ), tSsK=smem_copy_K.partition_S(sK), tOsVt=smem_copy_V.partition_S(sVt),
        )

    # --- loads ------------------------------------------------------------------------------

    @cute.jit
    def zero_pad_columns(self, p: SimpleNamespace) -> None:
        """Zero the smem chunks of head-dim columns >= head_dim (Q and every K stage): cp.async never
        writes them, so the padded k-slices of ``Q K^T`` add exact zeros."""
        if const_expr(self.check_hdim):
            for k in cutlass.range_constexpr(cute.size(p.tQsQ.shape[2])):
                if not p.tQpQ[0, 0, k]:
                    p.tQsQ[None, None, k].fill(0)
            for s in cutlass.range_constexpr(self.num_stages):
                for k in cutlass.range_constexpr(cute.size(p.tKsK.shape[2])):
                    if not p.tKpK[0, 0, k]:
                        p.tKsK[None, None, k, s].fill(0)

    @cute.jit
    def load_Q(self, p: SimpleNamespace, m_block: Int32, seqlen_q: Int32) -> None:
        limit = seqlen_q - m_block * self.tile_m - p.tQcQ[0][0]
        for m in cutlass.range_constexpr(cute.size(p.tQsQ.shape[1])):
            if p.t0QcQ[0, m, 0][0] < limit:
                cute.copy(p.gmem_copy_QK, p.tQgQ[None, m, None], p.tQsQ[None, m, None],
                          pred=p.tQpQ[None, m, None] if const_expr(self.check_hdim) else None)
            else:
                p.tQsQ[None, m, None].fill(0)

    @cute.jit
    def load_Q_packed(self, p: SimpleNamespace, mQ: cute.Tensor, rows: TileRows, seqlen: SeqlenInfo,
                      batch: Int32) -> None:
        """Packed Q rows (Note [Pack GQA]) with the same ``cp.async`` partition as :meth:`load_Q`:
        each of the thread's rows is a (query position, q head) of its own, so its chunks come
        from that row's address (the thread's part of the row broadcast over the tile)."""
        limit = rows.rows_left() - p.tQcQ[0][0]
        for m in cutlass.range_constexpr(cute.size(p.tQsQ.shape[1])):
            if p.t0QcQ[0, m, 0][0] < limit:
                q_pos, head = rows.coord(p.tQcQ[0, m, 0][0])
                row = seqlen.q_view(mQ, batch, head)[q_pos, None]
                gQ_row = cute.make_tensor(row.iterator, cute.make_layout((self.tile_m, self.tile_hdim), stride=(0, 1)))
                cute.copy(p.gmem_copy_QK, p.thr_copy_QK.partition_S(gQ_row)[None, m, None], p.tQsQ[None, m, None],
                          pred=p.tQpQ[None, m, None] if const_expr(self.check_hdim) else None)
            else:
                p.tQsQ[None, m, None].fill(0)

    @cute.jit
    def load_KV(self, gmem_copy, tXgX, tXsX, tXcX, t0XcX, tXpX, n_block: Int32, stage, seqlen_k: Int32,
                need_predicates: cutlass.Constexpr[bool]) -> None:
        """One K or V block into smem stage ``stage``; rows past ``seqlen_k`` are zero-filled when
        ``need_predicates`` (only the first block processed can be partial)."""
        src = tXgX[None, None, None, n_block]
        dst = tXsX[None, None, None, stage]
        if const_expr(need_predicates):
            limit = seqlen_k - n_block * self.tile_n - tXcX[0][0]
            for m in cutlass.range_constexpr(cute.size(dst.shape[1])):
                if t0XcX[0, m, 0][0] < limit:
                    cute.copy(gmem_copy, src[None, m, None], dst[None, m, None],
                              pred=tXpX[None, m, None] if const_expr(tXpX is not None) else None)
                else:
                    dst[None, m, None].fill(0)
        else:
            cute.copy(gmem_copy, src, dst, pred=tXpX)

    def load_K(self, p, n_block, stage, seqlen_k, need_predicates: bool):
        self.load_KV(p.gmem_copy_QK, p.tKgK, p.tKsK, p.tKcK, p.t0KcK, p.tKpK, n_block, stage, seqlen_k,
                     need_predicates)

    def load_V(self, p, n_block, stage, seqlen_k, need_predicates: bool):
        self.load_KV(p.gmem_copy_V, p.tVgV, p.tVsV, p.tVcV, p.t0VcV, p.tVpV, n_block, stage, seqlen_k,
                     need_predicates)

    # --- main loop --------------------------------------------------------------------------

    @cute.jit
    def mainloop(self, p: SimpleNamespace, acc_O: cute.Tensor, softmax: OnlineSoftmax, mask: AttentionMask,
                 seqlen: SeqlenInfo, rows: TileRows, mQ: cute.Tensor, batch: Int32, m_block: Int32, n_min: Int32,
                 n_max: Int32, prescale, tiled_mma, umod=None) -> None:
        """Prologue loads and the loop over the K blocks ``[n_min, n_max)`` of the tile (its split's
        share with split-KV; see Note [K/V pipeline]); no-op for an empty range. The mask
        boundaries are clamped to the range, so a split's first block (its last) is masked like
        the tile's, and only the split holding the tile's last block sees a partial one."""
        S = self.num_stages
        if n_min < n_max:
            self.zero_pad_columns(p)
            if const_expr(self.pack):
                self.load_Q_packed(p, mQ, rows, seqlen, batch)
            else:
                self.load_Q(p, m_block, seqlen.seqlen_q)
            cute.arch.cp_async_commit_group()
            for s in cutlass.range_constexpr(S):
                if s == 0 or n_max - 1 - s >= n_min:
                    self.load_K(p, n_max - 1 - s, s, seqlen.seqlen_k, need_predicates=s == 0)
                cute.arch.cp_async_commit_group()
                if const_expr(s < S - 1):
                    if s == 0 or n_max - 1 - s >= n_min:
                        self.load_V(p, n_max - 1 - s, s, seqlen.seqlen_k, need_predicates=s == 0)
                    cute.arch.cp_async_commit_group()
            if const_expr(self.cfg.q_in_regs):
                cute.arch.cp_async_wait_group(2 * S - 1)
                cute.arch.barrier()
                cute.copy(p.smem_copy_Q, p.tSsQ, p.smem_copy_Q.retile(p.tSrQ))

            step = partial(self.compute_one_n_block, p, acc_O, softmax, mask, seqlen, m_block,
                           n_min=n_min, n_max=n_max, prescale=prescale, tiled_mma=tiled_mma, umod=umod)
            if const_expr(fwd_common.folds_first(self.cfg, mask, umod)):
                # Note [The first block in the masked loop] (fa4/fwd/sm90.py): the last block is the
                # first of the blocks the window cuts, through the same step. This family's step
                # issues nothing for an earlier block, so nothing else tells them apart.
                walk_blocks(mask, m_block, n_min, n_max, partial(self.step_carry, step), None,
                            first_step=partial(self.first_carry, step))
            else:
                # The last block (partial in seqlen_k and/or on the causal/local diagonal), then the
                # others through fa4.mask.walk_blocks (masked where the window cuts them).
                step(n_max - 1, is_first=True, mask_seqlen=True, mask_window=True)
                walk_blocks(mask, m_block, n_min, n_max, partial(self.step_carry, step), None,
                            self.cfg.one_step_loop)

    def first_carry(self, step, n, carry, is_first):
        """A block at the window's right edge, the tile's first included, in the form
        :func:`fa4.mask.walk_blocks` drives: both masks, and the general softmax update (from row
        maxes of -inf and sums of 0 its scales are 0 on a zero O: the bits of the first update's)."""
        step(n, is_first=False, mask_seqlen=True, mask_window=True)
        return carry

    def step_carry(self, step, n, carry, mask_window, window_if):
        """:meth:`compute_one_n_block` in the form :func:`fa4.mask.walk_blocks` drives (no carry)."""
        step(n, is_first=False, mask_seqlen=False, mask_window=mask_window, window_if=window_if)
        return carry

    @cute.jit
    def compute_one_n_block(
        self,
        p: SimpleNamespace,
        acc_O: cute.Tensor,
        softmax: OnlineSoftmax,
        mask: AttentionMask,
        seqlen: SeqlenInfo,
        m_block: Int32,
        n_block: Int32,
        n_min: Int32,
        n_max: Int32,
        prescale,
        tiled_mma: cute.TiledMma,
        is_first: cutlass.Constexpr[bool],
        mask_seqlen: cutlass.Constexpr[bool],
        mask_window: cutlass.Constexpr[bool],
        window_if=None,
        umod=None,
    ) -> None:
        """One K block (Note [K/V pipeline]); ``window_if``: a runtime Boolean, the window mask
        applied only where it is true (``one_step_loop``, :func:`fa4.mask.walk_blocks`); ``umod``:
        the tile's user functions (fa4/mods.py), before the window / length mask."""
        S = self.num_stages
        # Blocks are visited n_max-1, n_max-2, ...: the stage of block n is (n_max - 1 - n) % S.
        stage = 0
        stage_v_next = 0
        if const_expr(S > 1):
            stage = (n_max - 1 - n_block) % S
            stage_v_next = (n_max - 1 - n_block + S - 1) % S

        def sync():
            cute.arch.cp_async_wait_group(2 * S - 2)
            cute.arch.barrier()

        acc_S = cute.make_rmem_tensor(p.thr_mma.partition_shape_C((self.tile_m, self.tile_n)), Float32)
        acc_S.fill(0.0)
        sync()  # K[n] landed, and every warp is done with the buffers refilled below
        if const_expr(S == 1):
            self.load_V(p, n_block, 0, seqlen.seqlen_k, need_predicates=mask_seqlen)  # (the last block's)
        else:
            if n_block - (S - 1) >= n_min:
                self.load_V(p, n_block - (S - 1), stage_v_next, seqlen.seqlen_k, need_predicates=False)
        cute.arch.cp_async_commit_group()
        gemm_sm80(tiled_mma, acc_S, p.tSrQ, p.tSrK, p.tSsQ, p.tSsK[None, None, None, stage],
                  p.smem_copy_Q, p.smem_copy_K, A_in_regs=self.cfg.q_in_regs)
        if const_expr(S == 1):
            sync()  # V[n] landed; every warp is done reading K[n]
            if n_block - 1 >= n_min:
                self.load_K(p, n_block - 1, 0, seqlen.seqlen_k, need_predicates=False)
            cute.arch.cp_async_commit_group()
        if const_expr(self.cfg.has_softcap):
            apply_softcap(acc_S, prescale)
        if const_expr(umod is not None):
            umod.apply(acc_S, p.thr_mma, m_block, n_block, prescale, clamp_keys=mask_seqlen)
        mask.apply_block(acc_S, p.thr_mma, m_block, n_block, mask_seqlen, mask_window, window_if)
        softmax.online_softmax(acc_S, acc_O, is_first=is_first)
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        softmax.convert_P(acc_S, rP)
        if const_expr(S > 1):
            sync()  # V[n] landed; every warp is done reading K[n]
            if n_block - S >= n_min:
                self.load_K(p, n_block - S, stage, seqlen.seqlen_k, need_predicates=False)
            cute.arch.cp_async_commit_group()
        gemm_sm80_rs(tiled_mma, acc_O, make_acc_as_A(rP), p.tOrVt, p.tOsVt[None, None, None, stage],
                     p.smem_copy_V)

    # --- epilogue ---------------------------------------------------------------------------

    @cute.jit
    def epilogue(self, acc_O: cute.Tensor, lse: cute.Tensor, mO: cute.Tensor, mLSE: Optional[cute.Tensor],
                 sO: cute.Tensor, seqlen: SeqlenInfo, rows: TileRows, slot: Int32, m_block: Int32,
                 gmem_copy_O: cute.TiledCopy, tiled_mma: cute.TiledMma) -> None:
        """O (already normalized) -> 16 bits -> smem (sQ's space) -> 16-byte global stores (row by
        row for packed rows); LSE from registers. Split-KV: the float32 O and the LSE go to the
        split's slot of the partials straight from registers. ``mO`` / ``mLSE``: the ``(s_q, dv)`` /
        ``(s_q,)`` views of the tile's (batch, head), or with packed rows / split-KV the whole
        tensors, whose batch index is ``slot`` (:func:`fa4.pack_gqa.partial_slot`)."""
        tidx, _, _ = cute.arch.thread_idx()
        thr_mma = tiled_mma.get_slice(tidx)
        if const_expr(self.split):
            store_lse_rows(lse, thr_mma, mLSE, rows, seqlen, slot, self.tile_hdimv)
            store_acc_rows(acc_O, thr_mma, mO, rows, seqlen, slot, self.cfg.head_dim_v, self.tile_hdimv)
        else:
            rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
            convert_f32_to_half(acc_O, rO)
            cute.arch.barrier()  # every warp is done reading sQ / sV
            smem_copy_O = cute.make_tiled_copy_C(
                cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32), tiled_mma
            ).get_slice(tidx)
            cute.copy(smem_copy_O, smem_copy_O.retile(rO), smem_copy_O.partition_D(sO))
            if const_expr(mLSE is not None):
                if const_expr(self.pack):
                    store_lse_rows(lse, thr_mma, mLSE, rows, seqlen, slot, self.tile_hdimv)
                else:
                    self.store_lse(lse, mLSE, rows.rows_left(), m_block, thr_mma)
            cute.arch.barrier()  # sO complete
            if const_expr(self.pack):
                store_rows(sO, mO, rows, seqlen, slot, self.cfg.head_dim_v, tidx, self.num_threads)
            else:
                self.store_O(sO, mO, rows.rows_left(), m_block, gmem_copy_O, tidx)

    @cute.jit
    def store_lse(self, lse: cute.Tensor, mLSE_cur: cute.Tensor, rows_left: Int32, m_block: Int32, thr_mma) -> None:
        """The per-row LSE (registers) -> its ``rows_left`` rows of ``mLSE_cur`` (s_q,)."""
        tOcO = make_acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_hdimv))))
        gLSE = cute.local_tile(mLSE_cur, (self.tile_m,), (m_block,))
        if tOcO[0][1] == 0:  # one lane per quad holds the row's LSE
            for r in cutlass.range_constexpr(cute.size(lse)):
                row = tOcO[r, 0][0]
                if row < rows_left:
                    gLSE[row] = lse[r]

    @cute.jit
    def store_O(self, sO: cute.Tensor, mO_cur: cute.Tensor, rows_left: Int32, m_block: Int32,
                gmem_copy_O: cute.TiledCopy, tidx: Int32) -> None:
        """The 16-bit O tile in smem -> its ``rows_left`` rows of ``mO_cur`` (s_q, dv), 16-byte stores."""
        cO = cute.make_identity_tensor((self.tile_m, self.tile_hdimv))
        thr_copy_O = gmem_copy_O.get_slice(tidx)
        tOsO = thr_copy_O.partition_S(sO)
        tOrO = cute.make_fragment_like(tOsO, self.dtype)
        cute.autovec_copy(tOsO, tOrO)
        gO = cute.local_tile(mO_cur, (self.tile_m, self.tile_hdimv), (m_block, 0))
        tOgO = thr_copy_O.partition_D(gO)
        tOcO_g = thr_copy_O.partition_S(cO)
        t0OcO = gmem_copy_O.get_slice(0).partition_S(cO)
        tOpO = predicate_cols(tOcO_g, self.cfg.head_dim_v) if const_expr(self.check_hdim_v) else None
        limit = rows_left - tOcO_g[0][0]
        for m in cutlass.range_constexpr(cute.size(tOrO.shape[1])):
            if t0OcO[0, m, 0][0] < limit:
                cute.copy(gmem_copy_O, tOrO[None, m, None], tOgO[None, m, None],
                          pred=tOpO[None, m, None] if const_expr(self.check_hdim_v) else None)


# --------------------------------------------------------------------------------------------
# Tuning table, variants, launcher
# --------------------------------------------------------------------------------------------

# Per head-dim bucket: (tile_m, tile_n, num_threads, num_stages). FlashAttention-2's sm80 choices
# (flash_fwd_launch_template.h, A100/H100 rows), which FA2 measured as its best non-dropout configs:
#  * d <= 64: 128 x 128, 4 warps (O 64 + S 128 fp32 registers/thread; 8 warps was 18% slower there).
#  * d <= 128: 128 x 64, 4 warps (O 128 + S 64 registers).
#  * d <= 256: 128 x 64, 8 warps (O 128 + S 32 registers; smem Q 64 KB + K/V 64 KB per stage).
# One K/V stage: V loads under Q K^T and the next K under softmax + P V already (FA2's schedule);
# two stages for d <= 64, where K/V tiles are small and the loop is shortest.
# Measured on an H200 (docs/RESULTS.md, v0.1 sweep, b*s = 16k tokens, h*d = 2048): d128 128x64 371
# TFLOP/s vs 128x32 363, 64x64 320, 2 stages 368, 128x128/8 warps 344, Q in registers 320;
# d64 2 stages +1% (non-causal) / +3% (causal); d256 64-row tiles +1% causal, -8% non-causal.
# The d <= 64 and d <= 128 rows sit at 255 registers with 100-200 bytes of spills (softmax state,
# once per K block); their spill-free neighbours measured slower.
TUNING = {
    64: (128, 128, 128, 2),
    96: (128, 64, 128, 1),
    128: (128, 64, 128, 1),
    192: (128, 64, 256, 1),
    256: (128, 64, 256, 1),
}
DEFAULT_EXP2_EMU_FRAC = 0.0  # measured: 0.25 costs 0-10% on the sm80 path (docs/RESULTS.md)
# v0.44 (CPU only then; on since v0.45): a causal tile's first K block as the first iteration of
# the diagonal's loop (``fold_first``; Note [The first block in the masked loop] in
# fa4/fwd/sm90.py). Here it needs no runtime branch: the step issues nothing for an earlier block,
# so the first block is the general step with both masks. SASS: d128 causal 4,568 -> 3,432
# instructions (768 -> 512 HMMA), d64 5,520 -> 4,024; the free loop no larger (d128 939 -> 925,
# d64 1,247 -> 1,250); the right-edge loop predicates its V loads and masks the seqlen on every block
# (extra work there only, the same bits). v0.45, H100: tests/test_fold_first_gpu.py's sm80 cases pass
# (the same bits); s8k causal, five rounds: d64 -0.7%, d128 +2.2%, d256 +1.5%; cold compile on the
# H100 host d64 / d128 / d256 causal 4.24 -> 2.86 / 3.58 -> 2.74 / 3.19 -> 2.39 s.
FOLD_FIRST_CAUSAL = True
# The classic rule by default: a threshold of 8 measured up to 1.4x the output error of tau = 0 on
# inputs whose row maxes creep (docs/RESULTS.md, issue 7). A threshold > 0 is still available; it
# then normalizes by the rounded P (Note [Normalizing by the rounded P] in fa4/softmax.py).
DEFAULT_RESCALE_THRESHOLD = 0.0
SUM_ROUNDED_WITH_THRESHOLD = True  # tools/rescale_accuracy.py turns it off to measure the difference


def _bucket(d: int) -> int:
    return fwd_common.bucket(TUNING, d, "sm80")


def make_config(problem: AttnProblem, options: Optional[KernelOptions], arch: str, need_lse: bool,
                num_sms: Optional[int] = None) -> FwdSm80Config:
    """The tuning table (by max(head_dim, head_dim_v)) with the user's options on top, pack GQA and
    split-KV as :func:`fa4.fwd.common.pack_gqa` / :func:`fa4.fwd.common.num_splits` decide them
    (``num_sms``: the GPU's, default the current one's); raises ValueError naming the option when a
    user choice cannot be compiled."""
    options = options or KernelOptions()
    tile_m, tile_n, threads, stages = TUNING[_bucket(max(problem.head_dim, problem.head_dim_v))]
    tau = float(options.rescale_threshold) if options.rescale_threshold is not None else DEFAULT_RESCALE_THRESHOLD
    # A varlen side the call gave no max_seqlen for (fa4 holds the packed token count,
    # sched.tile.shape_bound) is judged on the batch's average length (loose_plan), as the sm90
    # family's: the tile, the packing and the split count. The grid keeps the bound; the kernel reads
    # each sequence's own length. Judged on the bound, a decode call without the lengths left its
    # rows unpacked (sm90 measured 1.9x the time of the call with them, v0.38).
    plan = loose_plan(problem)
    # Decode-like shapes: a 64-row tile (4 warps x 16 rows) wastes less of the MMA.
    g, tile_m, decode = fwd_common.rows_plan(plan, tile_m, options.tile_m, options.num_threads is None)
    if decode:
        threads = 128
    tile_n = options.tile_n if options.tile_n is not None else tile_n
    splits = fwd_common.split_count(plan, tile_m, tile_n, g, num_sms)
    skip = BlockSkip.table_fits(problem.block_table, tile_m, tile_n) if g == 1 and BLOCK_SKIP else ()
    cfg = FwdSm80Config(
        arch=arch,
        dtype=problem.dtype,
        head_dim=problem.head_dim,
        head_dim_v=problem.head_dim_v,
        tile_m=tile_m,
        tile_n=tile_n,
        num_threads=options.num_threads if options.num_threads is not None else threads,
        num_stages=options.num_stages if options.num_stages is not None else stages,
        has_lse=need_lse or splits > 1,
        exp2_emu_frac=float(options.exp2_emu_frac) if options.exp2_emu_frac is not None else DEFAULT_EXP2_EMU_FRAC,
        rescale_threshold=tau,
        sum_rounded=tau > 0.0 and SUM_ROUNDED_WITH_THRESHOLD,
        qhead_per_kvhead=g,
        split_kv=splits > 1,
        block_skip=skip,
        fold_first=fwd_common.fold_first_rule(FOLD_FIRST_CAUSAL, problem.causal, False,
                                              bool(problem.score_mod or problem.mask_mod), skip),
        **FwdSm80Config.fwd_flags(problem),
    )
    FlashFwdSm80.can_implement(cfg)
    return cfg


def variants(arch: str) -> list[FwdSm80Config]:
    """A covering set of compile variants: every head-dim bucket (32/64/96/128/192/256, plus an
    unpadded 40 and a d != dv pair), every flag value, both dtypes, 1 and 2 stages, tile_m 64, pack
    GQA (g = 4, 6) and split-KV, alone and together."""
    base = FwdSm80Config(arch=arch, dtype="bf16")

    def cfg(d, dv=None, **kw):
        tile_m, tile_n, threads, stages = TUNING[_bucket(max(d, dv or d))]
        fold = fwd_common.fold_first_rule(FOLD_FIRST_CAUSAL, kw.get("causal", False), kw.get("one_step_loop", False),
                                          False, ())  # (as make_config)
        kw = {"tile_m": tile_m, "tile_n": tile_n, "num_threads": threads, "num_stages": stages, "fold_first": fold,
              **kw}
        return replace(base, head_dim=d, head_dim_v=dv or d, **kw)

    return [
        cfg(128),
        cfg(128, causal=True),
        cfg(64, dtype="fp16", has_lse=False),
        cfg(96, local=True, has_softcap=True),
        cfg(192, causal=True, varlen_q=True, varlen_k=True),
        cfg(256, local=True, varlen_q=True, varlen_k=True, has_seqused_k=True),
        cfg(32, q_in_regs=True, tile_m=64),
        cfg(40, causal=True, exp2_emu_frac=0.25, rescale_threshold=0.0),
        cfg(128, num_stages=2, exp2_emu_frac=1.0),
        cfg(128, causal=True, rescale_threshold=8.0, sum_rounded=True),
        cfg(192, 128, has_softcap=True),
        cfg(128, tile_m=64, qhead_per_kvhead=4),
        cfg(96, qhead_per_kvhead=6, local=True, varlen_q=True, varlen_k=True, dtype="fp16"),
        cfg(128, split_kv=True),
        cfg(128, tile_m=64, qhead_per_kvhead=4, split_kv=True, causal=True),
        cfg(64, split_kv=True, varlen_q=True, varlen_k=True, has_seqused_k=True),
        cfg(256, tile_m=64, num_threads=128, qhead_per_kvhead=6, split_kv=True, local=True),
        cfg(64, has_seqused_q=True, has_seqused_k=True, causal=True),
        cfg(128, varlen_q=True, causal=True),  # packed q with batched k/v (mixed layouts)
        cfg(128, varlen_k=True),  # batched q with packed k/v
        cfg(128, causal=True, one_step_loop=True),
        cfg(96, local=True, one_step_loop=True, num_stages=2),
        cfg(128, causal=True, fold_first=False),  # the separate first block
        cfg(64, causal=True),  # two stages
        cfg(96, local=True, varlen_q=True, varlen_k=True, has_seqused_k=True, fold_first=True),
        cfg(128, causal=True, has_sink=True),
        cfg(64, tile_m=64, qhead_per_kvhead=4, has_sink=True, varlen_q=True, varlen_k=True),
        cfg(128, split_kv=True, has_sink=True),  # the partials skip the sink (the combine adds it)
    ]


def run(cfg: FwdSm80Config, problem: AttnProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_k=None, seqused_q=None, page_table=None, sink=None, aux=None) -> None:
    """Launch (arguments: :func:`fa4.fwd.common.run`; split-KV: :func:`fa4.fwd.common.split_count` K splits on this
    GPU, cached per problem and config; ``aux``: the tensors of ``cfg.aux``)."""
    splits = fwd_common.launch_splits(cfg, problem, fwd_common.default_num_sms(q.device))
    fwd_common.run(cfg, problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                   extra=(splits, launch_aux(aux) if cfg.aux else None),
                   splits=splits, seqused_q=seqused_q, page_table=page_table, sink=sink)
