"""The dQ pass of the sm90 backward (Note [dQ pass]): dQ without global reductions.

The sm90 backward's default from padded head dim 160: deterministic runs, and runs without a mask;
from 224 with a causal / local mask too (``dq_pass``, :data:`fa4.bwd.sm90.DQ_PASS_MIN_HD`,
:data:`fa4.bwd.sm90.DQ_PASS_MASKED_MIN_HD`; ``KernelOptions.bwd_dq_pass`` overrides); measured in
docs/RESULTS.md v0.21, v0.22 and v0.24.

The main kernel (:mod:`fa4.bwd.sm90` with ``dq_pass``) computes dK and dV only; this kernel then
computes dQ with the queries stationary, as the forward does: one CTA per ``tile_m`` rows of one
(batch, q head), looping over the K blocks that those queries see.

Roles (3 warpgroups, ``setmaxnreg`` 24 / 240):
* warp 0 (``load``): Q and dO of the tile once (``pipe_qdo``: 1 stage, producer 1 thread, consumers
  the 8 consumer warps), then K and V of each K block (``pipe_kv``: ``num_stages`` stages, K and V
  of a block in one stage, completing on one mbarrier; consumers the 8 consumer warps), walked as
  the forward walks its blocks (:func:`fa4.mask.walk_blocks`: the last block first).
* warpgroups 1-2 (``mma``): 64 query rows each. Per K block ``n``: S = Q K^T and dP = dO V^T
  (wgmma, both operands in smem); P = exp2(S * scale_log2 - lse_log2[row]); dS = P * (dP -
  dpsum[row]) (with the softcap's gradient); dQ += dS K (wgmma, dS from registers, K^T an MN-major
  view of the K stage); then the stage is released. After the last block dQ *= softmax_scale goes out
  in 16 bits through the Q tile's smem.

Note [dQ pass]
    The d192 / d256 main kernel spends a third of its time on the float32 reductions of dQ (without
    them: 1.55-1.65x, docs/RESULTS.md v0.21): every K block adds a ``tile_m x head_dim`` tile per
    step. Recomputing S and dP in a second pass with the queries stationary costs two more wgmmas
    per (m, n) block (seven against five), but no reductions, no dQ accumulator (nor its zeroing in
    the preprocess), no postprocess, and dQ is the same bits on every run: the K blocks of a tile add
    into registers in a fixed order, so a deterministic run costs nothing more: it runs the
    non-deterministic main kernel (whose dK / dV sums are in CTA order in either mode) and this one.
    The main kernel still takes a ``dq_accum`` argument: a 16-row stand-in with its own row
    count (:func:`fa4.bwd.workspace.dq_accum_placeholder`), which no kernel touches. Where the pass
    loses: d64 / d128 (-20%: the two extra wgmmas cost more than the writer warp's reductions there),
    and causal masks without determinism (flat or -1..-5%, v0.22).

Note [dQ pass tile order]
    A 1-D grid in the forward's tile order (:class:`fa4.sched.tile.SectionTileScheduler`, LPT:
    the last m-block first), with L2 sections of ``l2_section_mb`` of K/V rounded down to a power
    of two of (head, batch) pairs, as the sm90 forward's masked rows (Note [Section sizes] in
    fa4/sched/tile.py). Until v0.24 the grid was ``(m, head, batch)`` with the m-blocks reversed:
    sections of one pair, whose causal tail the note describes (d256 s8k: 64 tiles of one pair for
    132 SMs). The greedy model of that note (one CTA per SM, a tile's time its K blocks + 2) puts
    the SMs' useful share of the causal dQ pass at 0.88-0.93 with one pair per section (d160-d256,
    s1k-s8k) and at 0.96-1.00 with 16 MB sections (docs/RESULTS.md v0.24).
"""

import functools
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import ClassVar, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4.arch import SM90_SMEM_PER_CTA
from fa4.bwd.preprocess import _DTYPES
from fa4.bwd.workspace import rows_view
from fa4.config import AttnKernelConfig
from fa4.cute_utils import (
    convert_f32_to_half,
    gemm_sm90,
    make_acc_as_A,
    make_acc_mn_view,
    smem_layout_sm90,
    stmatrix_atom,
    store_rows_16B,
    transposed,
    zero_rows_from,
)
from fa4.fwd.common import grid_extent
from fa4.mask import AttentionMask, walk_blocks
from fa4.mods import check_config, lookup
from fa4.mods_kernel import BlockSkip, UserMods, check_block_skip, fake_aux
from fa4.sched.tile import SectionTileScheduler
from fa4.seqlen import SeqlenInfo, to_sdhb
from fa4.softmax import apply_softcap, exp2_rows, score_scales, softcap_grad

SMEM_CAPACITY = SM90_SMEM_PER_CTA  # (fa4/arch.py)
_REGS = (240, 24)  # consumer, producer registers per thread (two consumer warpgroups)
_BAR_EPI = 1  # named barrier of the consumer warpgroups (epilogue, K/V tail clears)


@dataclass(frozen=True)
class BwdDqSm90Config(AttnKernelConfig):
    """Compile key of :class:`FlashBwdDqSm90`. ``head_dim``: the main kernel's padded head dim (the
    real one is a runtime size); ``head_dim_v``: that of V and dO when it differs, else 0.
    ``tile_m``: query rows per CTA (64 per consumer warpgroup); ``tile_n``: keys per K block;
    ``num_stages``: K/V stages; ``rows_tile_m``: the tile of the lse_log2 / dpsum workspaces (the
    main kernel's ``tile_m``, Note [Padded row tiles] in fa4/bwd/workspace.py); ``l2_section_mb``:
    the K/V megabytes of one L2 section of the tile order (Note [dQ pass tile order]; 0: one
    (head, batch) pair per section). ``block_skip``: ``(aux slot, block_q, block_k)`` of a
    block-sparse call's block table, or ``()``: each CTA narrows its K blocks to those from its
    lowest visible one to its highest (:meth:`fa4.mods_kernel.BlockSkip.narrow`)."""

    head_dim: int = 256
    head_dim_v: int = 0
    tile_m: int = 128
    tile_n: int = 48
    num_stages: int = 2
    rows_tile_m: int = 64
    l2_section_mb: int = 16
    block_skip: tuple = ()

    KERNEL: ClassVar[str] = "fa4.bwd.dq_sm90:FlashBwdDqSm90"
    REQUIRED_SASS: ClassVar[tuple] = ("HGMMA", "UTMALDG")
    # One of its 15 variants compiles to other encodings without strength reduction, not timed on a
    # GPU: it keeps the pass (Note [Compiler switches] in fa4/jit.py, RESULTS v0.54).
    PASS_SWITCHES_OK: ClassVar[bool] = False

    @property
    def hd_v(self) -> int:
        return self.head_dim_v or self.head_dim

    @property
    def num_wg(self) -> int:
        return self.tile_m // 64

    def smem_bytes(self) -> int:
        """Q, dO (stationary), K and V stages (16-bit), the mbarriers, 1 KB alignment each."""
        tiles = [self.tile_m * self.head_dim, self.tile_m * self.hd_v,
                 self.num_stages * self.tile_n * self.head_dim, self.num_stages * self.tile_n * self.hd_v]
        return 1024 + sum((2 * t + 1023) // 1024 * 1024 for t in tiles)


class FlashBwdDqSm90:
    """See the module docstring."""

    def __init__(self, cfg: BwdDqSm90Config):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.hd, self.hd_v = cfg.tile_m, cfg.tile_n, cfg.head_dim, cfg.hd_v
        self.num_wg = cfg.num_wg
        self.num_consumer_threads = 128 * self.num_wg
        self.num_threads = 128 * (self.num_wg + 1)
        self.stages = cfg.num_stages
        # User functions (fa4/mods.py), None when absent.
        self.score_mod, self.mask_mod = lookup(cfg.score_mod), lookup(cfg.mask_mod)
        self.score_mod_bwd = lookup(cfg.score_mod_bwd)

    @staticmethod
    def can_implement(cfg: BwdDqSm90Config) -> None:
        name = type(cfg).__name__
        cfg.check_target(_DTYPES, head_dim_multiple=32)
        if cfg.arch != "sm_90a":
            raise ValueError(f"{name}.arch must be sm_90a, got {cfg.arch!r}")
        if cfg.tile_m != 128:
            raise ValueError(f"{name}.tile_m must be 128 (two consumer warpgroups), got {cfg.tile_m}")
        if cfg.tile_n % 16 or not 16 <= cfg.tile_n <= 128:
            raise ValueError(f"{name}.tile_n must be a multiple of 16 in [16, 128], got {cfg.tile_n}")
        if cfg.num_stages not in (1, 2):
            raise ValueError(f"{name}.num_stages must be 1 or 2, got {cfg.num_stages}")
        if cfg.smem_bytes() > SMEM_CAPACITY:
            raise ValueError(f"{name}: {cfg.smem_bytes()} bytes of shared memory exceed sm_90a's {SMEM_CAPACITY}")
        check_config(cfg, name, backward=True)
        check_block_skip(cfg, name)
        # dQ, S and dP (float32), dS (16-bit), and with softcap tanh(S) (score_mod: S): registers per thread. The
        # largest compiled without spills: 224 (d128 with 128-key blocks, d160 with 112: 220).
        acc = (cfg.head_dim // 2 + cfg.tile_n + cfg.tile_n // 4
               + (cfg.tile_n // 2 if cfg.has_softcap or cfg.score_mod else 0))  # (tanh(S), or S for score_mod_bwd)
        if acc > _REGS[0] - 16:
            raise ValueError(f"{name}: head_dim {cfg.head_dim} with tile_n {cfg.tile_n} needs {acc} accumulator "
                             "registers per thread")

    @staticmethod
    def fake_args(cfg: BwdDqSm90Config) -> tuple:
        dtype = _DTYPES[cfg.dtype]
        b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
        d = cute.sym_int(divisibility=8)
        dv = cute.sym_int(divisibility=8) if cfg.head_dim_v else d
        bk = cute.sym_int() if cfg.varlen_q != cfg.varlen_k else b

        from fa4.bwd.common import fake_bshd, fake_compact as compact

        def bshd(s, heads, batch=b, dim=d):
            return fake_bshd(dtype, batch, s, heads, dim)

        rows = cute.sym_int(divisibility=16)
        q, k, v, do, dq = bshd(sq, h), bshd(sk, hk, bk), bshd(sk, hk, bk, dv), bshd(sq, h, dim=dv), bshd(sq, h)
        lse_log2, dpsum = compact(Float32, (b, h, rows), 16), compact(Float32, (b, h, rows), 16)
        cu_q = compact(Int32, (cute.sym_int(),)) if cfg.varlen_q else None
        cu_k = compact(Int32, (cute.sym_int(),)) if cfg.varlen_k else None
        used_k = compact(Int32, (cute.sym_int(),)) if cfg.has_seqused_k else None
        stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
        return (q, k, v, do, lse_log2, dpsum, dq, cu_q, cu_k, used_k, Float32(1.0), Float32(0.0), Int32(0), Int32(0),
                Int32(1), fake_aux(cfg.aux), stream)

    # ----------------------------------------------------------------------------------------
    # Host side
    # ----------------------------------------------------------------------------------------

    def _setup(self):
        dt, m, n = self.dtype, self.tile_m, self.tile_n
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        self.sQ_layout = smem_layout_sm90(dt, m, self.hd)
        self.sdO_layout = smem_layout_sm90(dt, m, self.hd_v)
        self.sK_layout = smem_layout_sm90(dt, n, self.hd, self.stages)
        self.sV_layout = smem_layout_sm90(dt, n, self.hd_v, self.stages)
        # S = Q K^T, dP = dO V^T: (64 rows per warpgroup) x tile_n; dQ = dS K: 64 x head dim, dS
        # from registers, K^T the MN-major view of the K stage.
        self.tiled_mma_s = sm90_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, (self.num_wg, 1, 1), (64, n))
        self.tiled_mma_dq = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K, MN, Float32, (self.num_wg, 1, 1), (64, self.hd), warpgroup.OperandSource.RMEM)
        self.tma_bytes_qdo = (m * self.hd + m * self.hd_v) * dt.width // 8
        self.tma_bytes_kv = (n * self.hd + n * self.hd_v) * dt.width // 8
        stages = self.stages

        @cute.struct
        class SharedStorage:
            mbar_qdo: cute.struct.MemRange[cutlass.Int64, 2]
            mbar_kv: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sQ_layout)], 1024]
            sdO: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sdO_layout)], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sV_layout)], 1024]

        self.SharedStorage = SharedStorage

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d); varlen (1, total_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_k, d)
        mV: cute.Tensor,  # (b, s_k, h_k, dv)
        mdO: cute.Tensor,  # (b, s_q, h, dv)
        mLSElog2: cute.Tensor,  # (b, h, rows) float32 (the preprocess's lse * log2(e))
        mDpsum: cute.Tensor,  # (b, h, rows) float32
        mdQ: cute.Tensor,  # (b, s_q, h, d), written
        mCuSeqlensQ,
        mCuSeqlensK,
        mSeqUsedK,
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_q: Int32,
        mAux: Optional[tuple],  # the user functions' aux tensors (cfg.aux; fa4/mods.py)
        stream,
    ):
        self._setup()
        seqlen_q = max_seqlen_q if const_expr(mCuSeqlensQ is not None) else mQ.shape[1]
        num_batch, num_m, section, num_heads = grid_extent(
            mQ, mK, mCuSeqlensQ, mCuSeqlensK, seqlen_q, self.tile_m, 2 * (self.hd + self.hd_v),
            l2_budget=self.cfg.l2_section_mb << 20, pow2_sections=True)
        prescale, scale_log2 = score_scales(softmax_scale, softcap, self.cfg.has_softcap, self.score_mod is not None)
        if const_expr(not self.cfg.has_softcap and self.score_mod is None):
            prescale = Float32(1.0)
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_t = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mQ), self.sQ_layout, (self.tile_m, self.hd))
        tma_do, mdO_t = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mdO), self.sdO_layout, (self.tile_m, self.hd_v))
        k_box = cute.select(self.sK_layout, mode=[0, 1])
        v_box = cute.select(self.sV_layout, mode=[0, 1])
        tma_k, mK_t = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mK), k_box, (self.tile_n, self.hd))
        tma_v, mV_t = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mV), v_box, (self.tile_n, self.hd_v))
        self.kernel(
            mQ_t, mK_t, mV_t, mdO_t, mLSElog2, mDpsum, mdQ, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mAux,
            tma_q, tma_k, tma_v, tma_do, softmax_scale, prescale, scale_log2, window_left, window_right,
            num_m, num_heads, num_batch, section, mQ.shape[1], mK.shape[1], mQ.shape[2] // mK.shape[2],
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout, self.tiled_mma_s, self.tiled_mma_dq,
        ).launch(
            grid=SectionTileScheduler.grid(num_m, num_heads, num_batch),
            block=[self.num_threads, 1, 1],
            smem=self.SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ----------------------------------------------------------------------------------------
    # Device side
    # ----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, mdQ, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mAux,
               tma_q, tma_k, tma_v, tma_do, softmax_scale: Float32, prescale: Float32, scale_log2: Float32,
               window_left: Int32, window_right: Int32, num_m: Int32, num_heads: Int32, num_batch: Int32,
               section: Int32, seqlen_q_static: Int32,
               seqlen_k_static: Int32, group: Int32, sQ_layout: cute.ComposedLayout,
               sdO_layout: cute.ComposedLayout, sK_layout: cute.ComposedLayout, sV_layout: cute.ComposedLayout,
               tiled_mma_s: cute.TiledMma, tiled_mma_dq: cute.TiledMma):
        self.tiled_mma_s, self.tiled_mma_dq = tiled_mma_s, tiled_mma_dq
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.SharedStorage)
        group_ = pipeline.CooperativeGroup
        consumers = group_(pipeline.Agent.Thread, self.num_consumer_threads // 32)
        pipe_qdo = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_qdo.data_ptr(), num_stages=1, producer_group=group_(pipeline.Agent.Thread, 1),
            consumer_group=consumers, tx_count=self.tma_bytes_qdo, defer_sync=True)
        pipe_kv = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.mbar_kv.data_ptr(), num_stages=self.stages,
            producer_group=group_(pipeline.Agent.Thread, 1), consumer_group=consumers, tx_count=self.tma_bytes_kv,
            defer_sync=True)
        cute.arch.mbarrier_init_fence()
        cute.arch.sync_threads()

        m_block, head, batch = SectionTileScheduler(num_m, num_heads, num_batch, section, reverse=True).tile()
        seq = SeqlenInfo.create(batch, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        mask = AttentionMask(self.tile_m, self.tile_n, self.cfg.causal, self.cfg.local, seq.seqlen_q, seq.seqlen_k,
                             window_left, window_right)
        n_min, n_max = mask.n_block_range(m_block)
        if const_expr(self.cfg.block_skip):  # (every warp, before the roles split)
            slot, bq, bk = self.cfg.block_skip
            n_min, n_max = BlockSkip(mAux[slot], bq, bk, self.tile_m, self.tile_n, batch, head, m_block).narrow(
                n_min, n_max)
        umod = None
        if const_expr(self.score_mod is not None or self.mask_mod is not None):
            umod = UserMods(self.score_mod, self.mask_mod, self.tile_m, self.tile_n, 1, batch, head, seq, mAux,
                            score_mod_bwd=self.score_mod_bwd)
        work = SimpleNamespace(seq=seq, mask=mask, m_block=m_block, head=head, head_kv=head // group, batch=batch,
                               n_min=n_min, n_max=n_max, umod=umod,
                               active=m_block * self.tile_m < seq.seqlen_q)
        sm = SimpleNamespace(
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sdO=storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
        )
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(_REGS[1])
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, tma_q, tma_k, tma_v, tma_do, sm, pipe_qdo, pipe_kv, work)
        else:
            cute.arch.setmaxregister_increase(_REGS[0])
            self.mma(mLSElog2, mDpsum, mdQ, sm, pipe_qdo, pipe_kv, work, softmax_scale, prescale, scale_log2,
                     cute.arch.thread_idx()[0] - 128)

    # --- producer ---------------------------------------------------------------------------

    @cute.jit
    def load(self, mQ, mK, mV, mdO, tma_q, tma_k, tma_v, tma_do, sm, pipe_qdo, pipe_kv, work) -> None:
        """Warp 0: Q and dO once, then K and V of blocks ``n_max - 1`` down to ``n_min``."""
        if work.active:
            seq, one = work.seq, cute.make_layout(1)
            qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_qdo.producer_acquire(qdo_state)
            bar = pipe_qdo.producer_get_barrier(qdo_state)
            for tma, mT, sT, d in ((tma_q, mQ, sm.sQ, self.hd), (tma_do, mdO, sm.sdO, self.hd_v)):
                gT = cute.local_tile(seq.q_view_sd(mT, work.batch, work.head), (self.tile_m, d), (work.m_block, 0))
                tTsT, tTgT = cpasync.tma_partition(tma, 0, one, cute.group_modes(sT, 0, 2), cute.group_modes(gT, 0, 2))
                cute.copy(tma, tTgT, tTsT, tma_bar_ptr=bar)
            gK = cute.local_tile(seq.k_view_sd(mK, work.batch, work.head_kv), (self.tile_n, self.hd), (None, 0))
            gV = cute.local_tile(seq.k_view_sd(mV, work.batch, work.head_kv), (self.tile_n, self.hd_v), (None, 0))
            tKsK, tKgK = cpasync.tma_partition(tma_k, 0, one, cute.group_modes(sm.sK, 0, 2), cute.group_modes(gK, 0, 2))
            tVsV, tVgV = cpasync.tma_partition(tma_v, 0, one, cute.group_modes(sm.sV, 0, 2), cute.group_modes(gV, 0, 2))
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
            for i in cutlass.range(work.n_max - work.n_min, unroll=1):
                n = work.n_max - 1 - i
                pipe_kv.producer_acquire(kv_state)
                bar = pipe_kv.producer_get_barrier(kv_state)
                cute.copy(tma_k, tKgK[None, n], tKsK[None, kv_state.index], tma_bar_ptr=bar)
                cute.copy(tma_v, tVgV[None, n], tVsV[None, kv_state.index], tma_bar_ptr=bar)
                kv_state.advance()

    # --- consumers --------------------------------------------------------------------------

    @cute.jit
    def mma(self, mLSElog2, mDpsum, mdQ, sm, pipe_qdo, pipe_kv, work, softmax_scale: Float32, prescale: Float32,
            scale_log2: Float32, tidx: Int32) -> None:
        """Consumer warpgroups: the K-block loop, then :meth:`epilogue`."""
        if work.active:
            wg = cute.arch.make_warp_uniform(tidx // 128)
            thr_s, thr_dq = self.tiled_mma_s.get_slice(tidx), self.tiled_mma_dq.get_slice(tidx)
            wg_s, wg_dq = self.tiled_mma_s.get_slice(wg * 128), self.tiled_mma_dq.get_slice(wg * 128)
            c = SimpleNamespace(
                tSrQ=wg_s.make_fragment_A(wg_s.partition_A(sm.sQ)),
                tSrK=wg_s.make_fragment_B(wg_s.partition_B(sm.sK)),
                tdPrdO=wg_s.make_fragment_A(wg_s.partition_A(sm.sdO)),
                tdPrV=wg_s.make_fragment_B(wg_s.partition_B(sm.sV)),
                tdQrKt=wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sm.sK))),
                thr_s=thr_s, tidx=tidx,
            )
            shape_S = (self.tile_m, self.tile_n)
            c.acc_S = thr_s.make_fragment_C(thr_s.partition_shape_C(shape_S))
            c.acc_dP = thr_s.make_fragment_C(thr_s.partition_shape_C(shape_S))
            acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C((self.tile_m, self.hd)))
            acc_dQ.fill(0.0)
            c.acc_dQ = acc_dQ
            # This thread's rows' statistics (rows past the sequence read its last row: never stored).
            tScS = make_acc_mn_view(thr_s.partition_C(cute.make_identity_tensor(shape_S)))
            nrow = cute.size(tScS, mode=[0])
            c.rLSE = cute.make_rmem_tensor(nrow, Float32)
            c.rD = cute.make_rmem_tensor(nrow, Float32)
            gLSE = rows_view(mLSElog2, work.seq, work.batch, work.head, self.cfg.rows_tile_m)
            gD = rows_view(mDpsum, work.seq, work.batch, work.head, self.cfg.rows_tile_m)
            for r in cutlass.range_constexpr(nrow):
                row = cutlass.min(work.m_block * self.tile_m + tScS[r, 0][0], work.seq.seqlen_q - 1)
                c.rLSE[r] = gLSE[row]
                c.rD[r] = gD[row]
            qdo_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_qdo.consumer_wait(qdo_state)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
            if work.n_min < work.n_max:
                # The last block: the seqlen mask, the window's, and (seqused_k) the K/V tail cleared.
                kv_state = self.step(c, sm, pipe_kv, work, work.n_max - 1, kv_state, prescale, scale_log2, True, True,
                                     None)
                step = lambda n, st, mask_window, window_if: self.step(  # noqa: E731
                    c, sm, pipe_kv, work, n, st, prescale, scale_log2, False, mask_window, window_if)
                kv_state = walk_blocks(work.mask, work.m_block, work.n_min, work.n_max, step, kv_state)
            self.epilogue(acc_dQ, mdQ, sm, work, softmax_scale, tidx)

    @cute.jit
    def step(self, c, sm, pipe_kv, work, n: Int32, kv_state, prescale: Float32, scale_log2: Float32,
             last: cutlass.Constexpr[bool], mask_window: cutlass.Constexpr[bool], window_if):
        """K block ``n``: S, dP, P, dS, and dQ += dS K; returns the advanced stage state."""
        pipe_kv.consumer_wait(kv_state)
        s = kv_state.index
        if const_expr(last and self.cfg.has_seqused_k):
            rows_used = work.seq.seqlen_k - n * self.tile_n
            if rows_used < self.tile_n:  # Note [K/V rows past seqused_k] in fa4/bwd/sm90.py
                zero_rows_from(sm.sK[None, None, s], rows_used, c.tidx, self.num_consumer_threads)
                zero_rows_from(sm.sV[None, None, s], rows_used, c.tidx, self.num_consumer_threads)
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=self.num_consumer_threads)
        gemm_sm90(self.tiled_mma_s, c.acc_S, c.tSrQ, c.tSrK[None, None, None, s], zero_init=True)
        gemm_sm90(self.tiled_mma_s, c.acc_dP, c.tdPrdO, c.tdPrV[None, None, None, s], zero_init=True)
        warpgroup.wait_group(1)  # S
        tanh_S = None
        if const_expr(self.cfg.has_softcap):
            apply_softcap(c.acc_S, prescale)
            tanh_S = cute.make_rmem_tensor_like(c.acc_S)
            tanh_S.store(c.acc_S.load())
        raw_S = None
        if const_expr(work.umod is not None):  # the user's functions, every block (fa4/mods.py)
            if const_expr(self.score_mod is not None):  # Q K^T as the score_mod read it, for its derivative
                raw_S = cute.make_rmem_tensor_like(c.acc_S)
                raw_S.store(c.acc_S.load())
            work.umod.apply(c.acc_S, c.thr_s, work.m_block, n, prescale, clamp_keys=last)
        work.mask.apply_block(c.acc_S, c.thr_s, work.m_block, n, last, mask_window, window_if)
        acc_S_mn = make_acc_mn_view(c.acc_S)
        exp2_rows(acc_S_mn, c.rLSE, scale_log2, 0.0)
        warpgroup.wait_group(0)  # dP
        acc_dP_mn = make_acc_mn_view(c.acc_dP)
        for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[1])):
                acc_dP_mn[r, j] = acc_S_mn[r, j] * (acc_dP_mn[r, j] - c.rD[r])
        if const_expr(self.cfg.has_softcap):
            softcap_grad(c.acc_dP, tanh_S)
        if const_expr(self.score_mod is not None):  # through the score_mod: its derivative
            work.umod.apply_bwd(c.acc_dP, raw_S, c.thr_s, work.m_block, n, prescale)
        rdS = cute.make_rmem_tensor_like(c.acc_dP, self.dtype)
        convert_f32_to_half(c.acc_dP, rdS)
        gemm_sm90(self.tiled_mma_dq, c.acc_dQ, make_acc_as_A(rdS), c.tdQrKt[None, None, None, s])
        warpgroup.wait_group(0)
        pipe_kv.consumer_release(kv_state)
        kv_state.advance()
        return kv_state

    @cute.jit
    def epilogue(self, acc_dQ, mdQ, sm, work, softmax_scale: Float32, tidx: Int32) -> None:
        """dQ *= softmax_scale -> 16 bits -> smem (over sQ) -> gmem, the sequence's rows only."""
        acc_dQ.store(acc_dQ.load() * softmax_scale)
        # Every warpgroup is done reading sQ (its last wgmmas completed before this).
        cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=self.num_consumer_threads)
        r2s = cute.make_tiled_copy_C(stmatrix_atom(self.dtype), self.tiled_mma_dq).get_slice(tidx)
        rdQ = cute.make_rmem_tensor_like(acc_dQ, self.dtype)
        convert_f32_to_half(acc_dQ, rdQ)
        cute.copy(r2s, r2s.retile(rdQ), r2s.partition_D(sm.sQ))
        cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=self.num_consumer_threads)
        gdQ = cute.local_tile(work.seq.q_view(mdQ, work.batch, work.head), (self.tile_m, self.hd), (work.m_block, 0))
        store_rows_16B(sm.sQ, gdQ, work.seq.seqlen_q - work.m_block * self.tile_m, mdQ.shape[3], tidx,
                       self.num_consumer_threads)


def largest_tile(cfg: BwdDqSm90Config) -> BwdDqSm90Config:
    """``cfg`` with the largest ``tile_n`` that :meth:`FlashBwdDqSm90.can_implement` accepts (two K/V
    stages in shared memory, the accumulators in registers)."""
    for n in (128, 112, 96, 80, 64, 48, 32):
        c = replace(cfg, tile_n=n)
        try:
            FlashBwdDqSm90.can_implement(c)
            return c
        except ValueError:
            continue
    raise ValueError(f"no dQ pass tile fits head_dim {cfg.head_dim}")


@functools.lru_cache(maxsize=256)  # once per main-kernel config: it is on every backward call's host path
def config_for(main_cfg) -> BwdDqSm90Config:
    """The dQ pass of a main-kernel config (its dtype, head dims, masks and varlen flags, and its
    ``block_skip`` where the pass's tile allows it), with the largest K/V tile that fits."""
    cfg = largest_tile(BwdDqSm90Config(
        arch=main_cfg.arch, dtype=main_cfg.dtype, head_dim=main_cfg.head_dim, head_dim_v=main_cfg.head_dim_v,
        rows_tile_m=main_cfg.tile_m, causal=main_cfg.causal, local=main_cfg.local, has_softcap=main_cfg.has_softcap,
        varlen_q=main_cfg.varlen_q, varlen_k=main_cfg.varlen_k, has_seqused_k=main_cfg.has_seqused_k,
        score_mod=main_cfg.score_mod, mask_mod=main_cfg.mask_mod, aux=main_cfg.aux,
        score_mod_bwd=main_cfg.score_mod_bwd))
    skip = BlockSkip.table_fits(getattr(main_cfg, "block_skip", ()), cfg.tile_m, cfg.tile_n)
    return replace(cfg, block_skip=skip) if skip else cfg


def variants(arch: str) -> list[BwdDqSm90Config]:
    """A covering set on sm_90a: every padded head dim bucket (64-256, and (192, 128)), every mask,
    softcap, varlen with seqused_k, both dtypes."""
    if arch != "sm_90a":
        return []

    def cfg(hd, hdv=0, **kw):
        return largest_tile(BwdDqSm90Config(arch=arch, head_dim=hd, head_dim_v=hdv, **{"dtype": "bf16", **kw}))

    return [
        cfg(256), cfg(256, causal=True), cfg(256, local=True, has_softcap=True),
        cfg(256, dtype="fp16", causal=True, varlen_q=True, varlen_k=True, has_seqused_k=True),
        cfg(224, causal=True), cfg(192), cfg(192, causal=True, varlen_q=True, varlen_k=True), cfg(160, local=True),
        cfg(160, has_softcap=True),
        cfg(192, 128, causal=True), cfg(128), cfg(128, causal=True, varlen_q=True, varlen_k=True),
        cfg(64, local=True), cfg(96, dtype="fp16"), cfg(128, has_softcap=True),
    ]
