"""Hopper (sm90 family) attention forward: TMA + wgmma, warp-specialized, persistent.

One CTA tile = ``tile_m`` query rows of one (batch, head) (packed GQA: of the q heads of one kv
head, Note [Pack GQA] in fa4/pack_gqa.py), over the K blocks of its split (split-KV: Note
[Split-KV partials] there); ``tile_m / 64`` consumer warpgroups each own 64 of the rows and every
key of a K/V block. :class:`FlashFwdSm90`:

Warp roles (``kernel`` dispatches; ``128 * (num_wg + 1)`` threads)
    * warpgroup 0, the **producer** (``setmaxnreg`` down to ``producer_regs``): warp 0 runs
      :meth:`load` (TMA loads of Q once per tile, unless packed rows are copied by the consumers
      (below), and of K and V per block, paged
      K/V by page chunks: Note [Paged K/V]; all completing on the pipelines' mbarriers); warps
      1-3 exit.
    * warpgroups 1..num_wg, the **consumers** (``setmaxnreg`` up to ``consumer_regs``): run
      :meth:`mma_softmax` (``S = Q K^T`` by wgmma from smem, mask, online softmax, P kept in
      registers as the A operand of ``O += P V``) and :meth:`epilogue` (O through smem and a TMA
      store, or row stores for varlen / ``seqused_q`` and for packed rows copied by rows; split-KV:
      float32 O straight from registers into its partial slot; LSE from registers). Packed rows go
      by TMA boxes of whole positions (Note [Packed rows by TMA] in fa4/pack_gqa.py: ``tile_m / g``
      positions, or ``tile_m // g`` where ``g`` does not divide the tile, the last ``tile_m % g``
      rows then padding); with user functions or ``pack_tma`` off the consumers copy Q's rows
      themselves (:func:`fa4.pack_gqa.load_q_rows`).

Pipelines (``cutlass.pipeline.PipelineTmaAsync``; producer = the TMA warp, arriving once with the
expected transaction bytes; a consumer arrive is one per warp, from lane 0)
    * ``pipeline_q``: 1 stage, 2 with ``overlap_tiles`` (Note [Tiles overlapped]); unused with packed
      rows copied by rows. Consumers: every consumer warp
      (``num_wg * 4`` arrives) after its last ``Q K^T`` of the tile; when sO reuses sQ's memory
      (``o_in_q``, large head dims) only the storing warp arrives (1), once the TMA store of O has
      finished reading smem. With ``o_in_q`` a tile with no K block (every row sees no key) takes
      the stage too: its Q is loaded and waited for although unused, so that the epilogue's zero O
      written over sQ cannot race the next tile's Q load (Note [Empty tiles and o_in_q]).
    * ``pipeline_k``, ``pipeline_v``: ``num_stages`` stages each, one shared stage counter (block
      ``i`` of a tile uses stage ``i % num_stages`` for both). Consumers: ``num_wg * 4`` arrives;
      with ``kv_mcast`` (clusters of two, Note [K/V multicast]) ``2 * num_wg * 4``: lanes 0 and 1 of
      every consumer warp of both CTAs arrive at CTA 0's and CTA 1's stage, and each CTA's producer
      loads half of the block into both, its full barrier expecting the whole block's bytes.
      Producer order per tile: K[last], Q, then each next block's K before the V of the block
      before it in the walk's order (K[n] before V[n + 1] descending; a local tile's edges first:
      Note [Edges first] in fa4/mask.py), then the last block's V; the consumers use K one block
      ahead of V (Note [intra-warpgroup overlap]).
    * ``pipes["sched"]`` (``dynamic_sched`` only; ``cutlass.pipeline.PipelineAsync``, 2 stages):
      the next tile's index in smem (:class:`fa4.sched.tile.DynamicTileScheduler`). Producer: the
      TMA warp's 32 lanes, once it has issued a tile's loads it claims the next tile from the
      global counter (32 arrives); consumers: every consumer thread after its tile's epilogue, or
      with ``overlap_tiles`` right after a tile's last ``P V`` issue (``num_wg * 128`` arrives).

Named barriers: 1 = epilogue (all consumer threads; with ``wg_store_o`` 7, 8, 9: each consumer
warpgroup's own, Note [Warpgroup stores]); 2, 3 = the ping-pong of two consumer
warpgroups (Note [ping-pong]); 4 = V rows past ``seqused_k`` zeroed (all consumer threads,
:meth:`FlashFwdSm90.clear_v_tail`); 5 = packed Q rows (all consumer threads: once before the
consumers overwrite sQ, every read of the last tile's Q is done; once after, the new Q is in).

Note [Paged K/V]
    With a page table, K and V are ``(num_pages, page_size, h_k, d)`` and the TMA atoms see them
    as ``(page_size, d, h_k, num_pages)``. A K/V block of ``tile_n`` rows is ``tile_n /
    page_rows`` TMA boxes of ``page_rows = gcd(page_size, tile_n)`` rows (a multiple of 8, so a
    box is whole 128-byte swizzle atoms and lands at its rows of the stage), each from the page
    that holds it: :meth:`FlashFwdSm90.load_block` reads the block's page indices (clamped to the
    table) before it waits for the stage, then issues the boxes on the stage's one mbarrier (the
    transaction count is the whole block's). Rows past ``seqused_k`` are masked (K) and zeroed
    (V) as with any KV cache.

Note [intra-warpgroup overlap]
    A K-block step issues ``S_next = Q K[n]^T`` and then ``O += P V[n + 1]`` (P of the previous
    block) as two wgmma groups, waits for the first only (``wait_group(1)``), runs mask and softmax
    on ``S_next`` while the second runs on the tensor cores, then waits for it, rescales O (the
    softmax's row scales, :meth:`fa4.softmax.OnlineSoftmax.update` / ``rescale_O``) and converts
    ``S_next`` into the next P. The first block has only its ``Q K^T``, the tile ends with the last
    ``P V``.

Note [ping-pong]
    With two or three consumer warpgroups (``pingpong``), each brackets its wgmma issues by a sync
    on its own named barrier and an arrive on the next one's (round robin), so they take turns on
    the tensor cores: one issues GEMMs while the others run their softmax. The last warpgroup
    arrives on warpgroup 0's barrier once at the start. Every warpgroup of a tile issues the same
    number of groups (the first ``Q K^T``, one per further K block, the last ``P V``), so the
    order never drifts. Barrier ids: ``_BAR_PP0 + w`` for warpgroups 0 and 1, ``_BAR_PP2`` for 2.
    ``pp_steps_only`` brackets the K-block steps only, as flash-attn-4 does: a tile's first ``Q K^T``
    and last ``P V`` go without a turn. Every warpgroup of a tile still takes as many turns (one per
    K block after the first), and the last arrive of a tile opens the next tile's first turn.

Note [Empty tiles and o_in_q]
    A tile none of whose rows sees a key (causal with ``seqlen_q > seqlen_k``, ``seqused_k`` 0, a
    window past the keys) has no K block: it writes O = 0 and LSE = -inf. Where sO is sQ's memory
    (``o_in_q``), its epilogue writes sQ; had the producer skipped its Q (as it skips its K/V), the
    stage would be free and the producer could already be loading the next tile's Q into sQ while
    the zeros are written: the next tile then computed with zeros in Q, or this tile stored Q's
    values as O (found on the H200 in session 14: varlen d256 causal, wrong O in about half the
    runs). So with ``o_in_q`` the producer loads Q for every active tile, and the consumers of an
    empty tile wait for it before the epilogue; the stage is released by the storing warp as for
    any tile. (A wasted 16-bit Q tile per empty tile, which stores a tile of zeros anyway.)

Note [TMA and varlen / padding]
    The TMA atoms see the kernel-boundary tensors as ``(s, d, h, b)`` (:func:`fa4.seqlen.to_sdhb`);
    a varlen sequence is a coordinate offset into the packed ``(total, d, h, 1)`` tensor (packed GQA
    rows: the ``((g, s), d, h_k, b)`` view of Note [Packed rows by TMA]). Boxes
    past the tensor's end read zeros; rows past a varlen sequence's end read the next sequence:
    keys there are masked (``-inf``, P = 0), query rows there are never stored. With ``seqused_k``
    the rows between the used length and the block's end are KV-cache slots that may hold
    anything, NaN included, and ``P V`` would multiply them by P = 0: they are zeroed in smem
    first (:meth:`FlashFwdSm90.clear_v_tail`; K there is harmless, its scores are masked to
    ``-inf`` by value). Head dims are padded
    to the tile's (a multiple of 32): the padded columns read as zeros and are never stored.

Note [no ``from __future__ import annotations``]
    ``cute.struct`` reads the field annotations of ``SharedStorage`` as objects.
"""

from dataclasses import dataclass, replace
from functools import partial
from types import SimpleNamespace
from typing import Callable, Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr, pipeline
from cutlass.cute.nvgpu import cpasync, warpgroup
import cutlass.utils.hopper_helpers as sm90_utils

from fa4.arch import SM90_SMEM_PER_CTA, resident_clusters
from fa4.config import AttnFwdConfig, AttnProblem, KernelOptions
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
from fa4.fwd import common as fwd_common
from fa4.mask import AttentionMask, edges_first_block, walk_blocks, window_bounds
from fa4.mods import check_config, launch_aux, lookup
from fa4.mods_kernel import BlockSkip, UserMods, block_mods, check_block_skip, fake_aux
from fa4.pack_gqa import (
    TileRows, batch_slot, load_q_rows, packed_rows_view, packed_tile, partial_slot, row_sinks, store_acc_rows,
    store_lse_rows, store_rows,
)
from fa4.sched.tile import (LOOSE_BOUND_RATIO, ClusterPairDynamicScheduler, ClusterPairScheduler,
                            CompactVarlenTileScheduler, DynamicTileScheduler, PersistentTileScheduler, loose_bound,
                            loose_plan, shape_bound, split_head, split_range)
from fa4.seqlen import SeqlenInfo, to_sdhb
from fa4.softmax import OnlineSoftmax, apply_softcap, rescale_rows, score_scales

SMEM_CAPACITY = SM90_SMEM_PER_CTA  # (fa4/arch.py)
SMEM_RESERVED = 1024  # mbarriers and alignment
_DTYPES = fwd_common.DTYPES
# (consumer, producer) registers per thread after setmaxnreg, by consumer warpgroups: the
# 64K-register file split as 128 * (producer + num_wg * consumer) <= 65536.
_REGS = {1: (256, 56), 2: (240, 24), 3: (160, 32)}
_BAR_EPI, _BAR_PP0, _BAR_VTAIL, _BAR_Q, _BAR_PP2 = 1, 2, 4, 5, 6
_BAR_EPI_WG = 7  # 7, 8, 9: each warpgroup's own epilogue barrier (``wg_store_o``, Note [Warpgroup stores])


_pad32 = fwd_common.pad32


def _first_rows(s, rows: int, cols: int, tile_rows: int):
    """The first ``rows`` rows of a ``(tile_rows, cols)`` smem layout or tensor ``s``: ``s`` composed
    with ``(rows, cols):(1, tile_rows)``, so a TMA box landing there keeps the tile's swizzle and
    column-block strides (a paged K/V chunk, a packed box of whole positions)."""
    return cute.composition(s, cute.make_layout((rows, cols), stride=(1, tile_rows)))


@dataclass(frozen=True)
class FwdSm90Config(AttnFwdConfig):
    """Compile key of the sm90 forward. ``tile_m`` = 64 x consumer warpgroups; ``persistent``: a
    grid of at most one CTA per SM looping over tiles (else one tile per CTA); ``pingpong``: two
    or three consumer warpgroups take turns on the tensor cores (Note [ping-pong]); ``rescale_o_before_pv``:
    O is rescaled just before the next ``P V``, under the ``Q K^T`` already issued, instead of
    right after the softmax. The next ``Q K^T`` always overlaps the softmax (Note
    [intra-warpgroup overlap]). ``qhead_per_kvhead > 1``: pack GQA, the tile's rows are that
    many q heads of one kv head (Note [Pack GQA] in fa4/pack_gqa.py); ``split_kv``: O and LSE are
    float32 partials of a runtime number of K splits (Note [Split-KV partials] there).
    ``l2_section_mb``: the K/V megabytes of one L2 section of the tile order
    (:mod:`fa4.sched.tile`; 0: one (head, batch) pair per section); ``dynamic_sched`` (with
    ``persistent``): tiles after the first are claimed from a global counter
    (:class:`fa4.sched.tile.DynamicTileScheduler`) instead of the static snake.
    ``pp_steps_only`` (with ``pingpong``): the turns bracket only the K-block steps; a tile's first
    ``Q K^T`` and last ``P V`` are issued without waiting for a turn (Note [ping-pong]); the d64
    default's three warpgroups take it (v0.12). ``skip_empty`` (dynamic grid, varlen or seqused Q):
    the producer claims past tiles with no rows instead of handing them to the consumers (Note
    [Skipped claims] in fa4/sched/tile.py). ``compact_grid`` (varlen Q through cu_seqlens_q, not
    ``persistent``): one CTA per tile of ``total_q * g // tile_m + batch`` slots per scheduler head
    instead of ``ceil(max_seqlen_q * g / tile_m) * batch`` (Note [Compact varlen grid],
    :class:`fa4.sched.tile.CompactVarlenTileScheduler`; the grid of a varlen call without
    ``max_seqlen_q``, ``COMPACT_WITHOUT_LENGTHS``, timed in v0.38; an option otherwise). ``block_skip``
    ``(slot, block_q, block_k)``: aux tensor ``slot`` is a block-sparse call's block table, and the
    producer and consumers skip the K blocks it hides (:class:`fa4.mods_kernel.BlockSkip`; not
    with pack GQA, whose rows span several heads' table rows). ``pack_tma`` (pack GQA): Q, and O
    where it goes by TMA at all, by TMA boxes of whole positions where ``tile_m`` is a multiple of
    ``qhead_per_kvhead`` (Note [Packed rows by TMA] in fa4/pack_gqa.py); off, packed rows are
    copied row by row by the consumers, as before v0.42. ``pack_tma_partial`` (v0.43): where
    ``qhead_per_kvhead`` does not divide ``tile_m``, TMA boxes of ``tile_m // g`` positions
    (``packed_block_rows`` rows of the tile); off, such groups are copied row by row.
    ``fold_first`` (causal / local, separate loops): the tile's first K block runs in the loop over
    the blocks at the window's edges instead of in its own code (Note [The first block in the
    masked loop]; a local tile's two edges share that loop: Note [Edges first] in fa4/mask.py); the
    default for causal tiles since v0.44 and for d64 local tiles since v0.45. ``kv_mcast``
    (dense tiles without a window or user functions, on the plain, persistent or dynamic grid; causal
    pairs walk the union of their ranges: v0.52, the d128 causal default from s_k 8192 on the dynamic
    grid, ``KV_MCAST_CAUSAL_HEAD_DIMS``, with pair claims; the non-causal d128 default on the
    persistent grid from s_k 4096 since v0.50 (packed GQA rows too since v0.53, ``KV_MCAST_GQA``) on
    132-SM GPUs, where all its clusters were measured
    resident at once, and since v0.51 wherever the driver counts them resident
    (:func:`fa4.arch.resident_clusters`), elsewhere on the plain grid from 8192,
    ``KV_MCAST_HEAD_DIMS``, ``KV_MCAST_PERSISTENT_SMS``): CTAs launch in clusters of two, on
    m-blocks ``2m`` and ``2m + 1`` of one head, and each loads half of every K / V block by TMA
    multicast into both (Note [K/V multicast]). ``overlap_tiles`` (persistent grids, Q by TMA, sO
    apart from sQ, no ping-pong turns at a tile's edges): the next tile's first ``Q K^T`` is issued
    behind this tile's last ``P V``, and this tile's epilogue runs under it (Note [Tiles
    overlapped]). ``wg_store_o`` (O by TMA, not packed, sO apart from sQ): each consumer warpgroup
    stages and stores its own 64 rows of O, with its own barrier (Note [Warpgroup stores]).
    ``pdl`` (``split_kv``): each CTA lets the combine launch once its barriers are set up, and the
    combine is launched as a programmatic dependent (Note [Combine launched early] in
    fa4/combine.py; the default where :data:`SPLIT_PDL`). ``stmatrix_o`` (the default where
    :data:`STMATRIX_O_MIN_DV`): O is staged in sO by ``stmatrix`` instead of 32-bit stores (Note [O
    staged by stmatrix])."""

    head_dim: int = 128
    head_dim_v: int = 128
    tile_m: int = 128
    tile_n: int = 128
    num_stages: int = 2
    pingpong: bool = False
    persistent: bool = True
    has_lse: bool = True
    exp2_emu_frac: float = 0.0
    rescale_threshold: float = 0.0
    sum_rounded: bool = False
    rescale_o_before_pv: bool = False
    qhead_per_kvhead: int = 1
    split_kv: bool = False
    l2_section_mb: int = 0
    dynamic_sched: bool = False
    pp_steps_only: bool = False
    skip_empty: bool = False  # v0.28: tested, and not faster (varlen d128 -3 to -5%, masked rows +-3%)
    compact_grid: bool = False
    block_skip: tuple = ()
    pack_tma: bool = True
    pack_tma_partial: bool = True
    kv_mcast: bool = False
    overlap_tiles: bool = False
    wg_store_o: bool = False
    pdl: bool = False
    stmatrix_o: bool = False

    KERNEL = "fa4.fwd.sm90:FlashFwdSm90"
    REQUIRED_SASS = ("HGMMA", "UTMALDG")  # checked in the SASS of every compile variant (tests/test_compile.py)

    @property
    def num_wg(self) -> int:
        return self.tile_m // 64

    def kv_mcast_blockers(self) -> list[str]:
        """The fields (by name) whose values keep this config's tiles from sharing K / V in clusters
        of two (Note [K/V multicast]): both tiles of a cluster must walk the same K blocks in the
        same order (a causal pair walks the union of its two ranges). The grid's own field (not the
        compact one) is :meth:`FlashFwdSm90.can_implement`'s to check."""
        fields = dict(local=self.local, varlen_q=self.varlen_q, varlen_k=self.varlen_k,
                      has_seqused_q=self.has_seqused_q, has_seqused_k=self.has_seqused_k, page_rows=self.page_rows,
                      split_kv=self.split_kv, block_skip=self.block_skip, score_mod=self.score_mod,
                      mask_mod=self.mask_mod)
        return [k for k, v in fields.items() if v]

    def overlap_tiles_blockers(self) -> list[str]:
        """What keeps this config from ``overlap_tiles`` (Note [Tiles overlapped]), in words."""
        out = []
        if not self.persistent:
            out.append("persistent=False (one tile per CTA)")
        if self.qhead_per_kvhead > 1 and not self.pack_tma_takes:
            out.append("packed Q rows copied by the consumers")
        if self.o_in_q and self.o_via_smem:
            out.append("sO in sQ's memory (o_in_q)")
        if self.pingpong and self.num_wg in (2, 3) and not self.pp_steps_only:
            out.append("ping-pong turns at the tile's edges")
        if self.split_kv:
            out.append("split_kv (not tested with it)")
        return out

    @property
    def num_threads(self) -> int:
        """A producer warpgroup, then one consumer warpgroup per 64 rows."""
        return 128 * (self.num_wg + 1)

    @property
    def split_tile_n(self) -> int:
        """The K blocks the split-KV rule counts in (:func:`fa4.fwd.common.split_tile_n`): the tuning
        table's ``tile_n``, which the rule was measured with, whatever this tile's (a decode tile's
        64-row blocks, v0.28, or a user's ``tile_n``), so a tile's K rows do not change the split."""
        return TUNING[_bucket(max(self.head_dim, self.head_dim_v))][1]

    @property
    def pack_tma_takes(self) -> bool:
        """Packed rows go by TMA boxes (Note [Packed rows by TMA]): ``pack_tma``, and the tile holds
        whole positions (``tile_m % g == 0``), or ``pack_tma_partial`` (no user functions, whose
        row positions assume whole tiles; ``g <= tile_m``): boxes of ``tile_m // g`` positions."""
        g = self.qhead_per_kvhead
        return g > 1 and self.pack_tma and (self.tile_m % g == 0 or (
            self.pack_tma_partial and g <= self.tile_m and not (self.score_mod or self.mask_mod)))

    @property
    def packed_block_rows(self) -> int:
        """Rows of the sequence one Q block holds: ``tile_m``, or ``(tile_m // g) * g`` for packed
        rows by TMA boxes of ``tile_m // g`` positions (``pack_tma_partial``)."""
        g = self.qhead_per_kvhead
        return (self.tile_m // g) * g if self.pack_tma_takes else self.tile_m

    @property
    def lpt(self) -> bool:
        return (self.causal or self.local or self.varlen_q or self.varlen_k or self.has_seqused_k
                or self.has_seqused_q)

    def wg_store_o_blockers(self) -> list[str]:
        """What keeps this config from ``wg_store_o`` (Note [Warpgroup stores]), in words."""
        out = []
        if self.varlen_q or self.has_seqused_q or self.split_kv:
            out.append("O stored by rows or as split-KV partials (varlen / seqused Q, split_kv)")
        if self.qhead_per_kvhead > 1:
            out.append("packed GQA rows")
        if self.o_in_q and self.o_via_smem:
            out.append("sO in sQ's memory (o_in_q)")
        return out

    @property
    def q_stages(self) -> int:
        """Q's stages: two with ``overlap_tiles``, so the next tile's Q lands while this one runs
        (Note [Tiles overlapped])."""
        return 2 if self.overlap_tiles else 1

    def smem_qkv_bytes(self) -> int:
        d, dv = _pad32(self.head_dim), _pad32(self.head_dim_v)
        return 2 * (self.q_stages * self.tile_m * d + self.num_stages * self.tile_n * (d + dv))

    @property
    def o_in_q(self) -> bool:
        """sO reuses sQ's memory when a separate O tile does not fit (Note in the class docstring)."""
        so = 2 * self.tile_m * _pad32(self.head_dim_v)
        return self.smem_qkv_bytes() + so + SMEM_RESERVED > SMEM_CAPACITY

    @property
    def o_via_smem(self) -> bool:
        """O is staged in smem (16 bits); split-KV partials go to gmem straight from registers."""
        return not self.split_kv

    def smem_bytes(self) -> int:
        so = 0 if (self.o_in_q or not self.o_via_smem) else 2 * self.tile_m * _pad32(self.head_dim_v)
        return self.smem_qkv_bytes() + so + SMEM_RESERVED


class FlashFwdSm90:
    """See the module docstring."""

    def __init__(self, cfg: FwdSm90Config):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.num_stages = cfg.tile_m, cfg.tile_n, cfg.num_stages
        self.tile_hdim, self.tile_hdimv = _pad32(cfg.head_dim), _pad32(cfg.head_dim_v)
        self.num_wg = cfg.num_wg
        self.num_consumer_threads = 128 * self.num_wg
        self.num_threads = cfg.num_threads
        self.consumer_regs, self.producer_regs = _REGS[self.num_wg]
        self.pingpong = cfg.pingpong and self.num_wg in (2, 3)
        self.pack = cfg.qhead_per_kvhead > 1
        self.split = cfg.split_kv
        self.o_in_q = cfg.o_in_q and cfg.o_via_smem
        self.mcast = cfg.kv_mcast  # Note [K/V multicast]: clusters of two CTAs share K / V
        self.kv_casts = 2 if cfg.kv_mcast else 1  # CTAs each K / V block lands in
        # Clusters on the dynamic grid claim pairs of tiles (Note [Pair claims] in fa4/sched/tile.py).
        self.pair_claims = cfg.kv_mcast and cfg.dynamic_sched
        # User functions traced into the softmax step (fa4/mods.py); None when absent.
        self.score_mod, self.mask_mod = lookup(cfg.score_mod), lookup(cfg.mask_mod)
        self.user_mods = self.score_mod is not None or self.mask_mod is not None
        # Packed rows go by TMA where the tile holds whole positions (Note [Packed rows by TMA]),
        # else row by row (Note [Pack GQA]); ``q_rows``: the rows of the sequence a tile holds.
        self.tma_q = not self.pack or cfg.pack_tma_takes
        self.tma_o = not (cfg.varlen_q or cfg.has_seqused_q or self.split) and self.tma_q
        self.wg_store = cfg.wg_store_o  # each consumer warpgroup stores its 64 rows (Note [Warpgroup stores])
        self.q_rows = cfg.packed_block_rows
        # Only a ragged Q has empty tiles (Note [Skipped claims] in fa4/sched/tile.py).
        self.skip_empty = cfg.skip_empty and cfg.dynamic_sched and (cfg.varlen_q or cfg.has_seqused_q)
        self.page_rows = cfg.page_rows
        # A local tile's two masked runs of K blocks walked one after the other (Note [Edges first]
        # in fa4/mask.py): the producer and the consumers visit the same order.
        self.edges_first = cfg.local and not cfg.one_step_loop and not cfg.block_skip

    # ----------------------------------------------------------------------------------------
    # Host side
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def can_implement(cfg: FwdSm90Config) -> None:
        cfg.check_target(_DTYPES)
        if cfg.arch != "sm_90a":
            raise ValueError(f"FwdSm90Config.arch must be sm_90a (wgmma, setmaxnreg), got {cfg.arch!r}")
        fwd_common.check_head_dims(cfg)
        if cfg.tile_m not in (64, 128, 192):
            raise ValueError(f"FwdSm90Config.tile_m (KernelOptions.tile_m) must be 64, 128 or 192 (64 rows per "
                             f"consumer warpgroup), got {cfg.tile_m}")
        if cfg.tile_n % 16 or not 16 <= cfg.tile_n <= 256:
            raise ValueError(f"FwdSm90Config.tile_n (KernelOptions.tile_n) must be a multiple of 16 in [16, 256], "
                             f"got {cfg.tile_n}")
        if cfg.num_stages not in (1, 2, 3, 4):
            raise ValueError(f"FwdSm90Config.num_stages (KernelOptions.num_stages) must be 1-4, got {cfg.num_stages}")
        if cfg.overlap_tiles:
            on = cfg.overlap_tiles_blockers()
            if on:
                raise ValueError(f"FwdSm90Config.overlap_tiles (Note [Tiles overlapped]) needs a persistent grid, Q by "
                                 f"TMA, sO apart from sQ, no ping-pong turns at a tile's edges and no split-KV; this "
                                 f"config has {', '.join(on)}")
        if cfg.wg_store_o:
            on = cfg.wg_store_o_blockers()
            if on:
                raise ValueError(f"FwdSm90Config.wg_store_o (Note [Warpgroup stores]) needs O stored by TMA from sO "
                                 f"apart from sQ, without packed rows; this config has {', '.join(on)}")
        if cfg.smem_bytes() > SMEM_CAPACITY:
            raise ValueError(f"shared memory of tile_m={cfg.tile_m}, tile_n={cfg.tile_n}, num_stages={cfg.num_stages} "
                             f"(KernelOptions){' with two Q stages (overlap_tiles)' if cfg.q_stages > 1 else ''} at "
                             f"head_dim {cfg.head_dim}/{cfg.head_dim_v} is {cfg.smem_bytes()} "
                             f"bytes, over the {SMEM_CAPACITY} of sm_90a")
        # fp32 accumulators per consumer thread: O, S, and (overlapped) the 16-bit P of the previous block.
        acc = _pad32(cfg.head_dim_v) // 2 + cfg.tile_n // 2 + cfg.tile_n // 4
        budget = _REGS[cfg.num_wg][0] - 32
        if acc > budget:
            raise ValueError(f"tile_n={cfg.tile_n} (KernelOptions) at head_dim_v {cfg.head_dim_v} needs {acc} "
                             f"accumulator registers per thread, over the {budget} left with {cfg.num_wg} consumer "
                             f"warpgroups: use a smaller tile_n or tile_m")
        fwd_common.check_softmax_options(cfg)
        if cfg.qhead_per_kvhead < 1:
            raise ValueError(f"FwdSm90Config.qhead_per_kvhead must be >= 1, got {cfg.qhead_per_kvhead}")
        if cfg.page_rows and (cfg.page_rows % 8 or cfg.tile_n % cfg.page_rows):
            raise ValueError(f"FwdSm90Config.page_rows must be a multiple of 8 dividing tile_n={cfg.tile_n} (a TMA "
                             f"box of whole 8-row swizzle atoms), got {cfg.page_rows}")
        if cfg.dynamic_sched and not cfg.persistent:
            raise ValueError("FwdSm90Config.dynamic_sched needs persistent (a grid of at most one CTA per SM)")
        if cfg.compact_grid and (cfg.persistent or not cfg.varlen_q):
            raise ValueError("FwdSm90Config.compact_grid (Note [Compact varlen grid]) needs varlen_q (cu_seqlens_q) "
                             "and persistent=False (one CTA per tile)")
        check_block_skip(cfg, "FwdSm90Config", pack_gqa=cfg.qhead_per_kvhead != 1)
        if cfg.split_kv and not cfg.has_lse:
            raise ValueError("FwdSm90Config.split_kv needs has_lse (the combine reads every split's LSE)")
        if cfg.pdl and not cfg.split_kv:
            raise ValueError("FwdSm90Config.pdl (Note [Combine launched early]) serves split_kv calls: without "
                             "splits no combine follows the forward")
        if cfg.kv_mcast:
            on = cfg.kv_mcast_blockers() + (["compact_grid"] if cfg.compact_grid else [])
            if on:
                raise ValueError(f"FwdSm90Config.kv_mcast (Note [K/V multicast]) serves dense tiles without a window "
                                 f"or user functions (causal ones too) on the plain, persistent or dynamic grid; this "
                                 f"config has {', '.join(on)}")
        check_config(cfg, "FwdSm90Config", backward=False)

    @staticmethod
    def fake_args(cfg: FwdSm90Config) -> tuple:
        counter = None
        if cfg.dynamic_sched:
            counter = cute.runtime.make_fake_compact_tensor(Int32, (1,), assumed_align=4)
        return fwd_common.fake_args(cfg, extra=(Int32(1), Int32(1), counter, fake_aux(cfg.aux)))

    def _setup(self):
        """Smem layouts, tiled MMAs and the shared storage struct (trace-time constants)."""
        dt = self.dtype
        self.q_stages = self.cfg.q_stages
        if const_expr(self.q_stages > 1):
            self.sQ_layout = smem_layout_sm90(dt, self.tile_m, self.tile_hdim, self.q_stages)
        else:
            self.sQ_layout = smem_layout_sm90(dt, self.tile_m, self.tile_hdim)
        self.sK_layout = smem_layout_sm90(dt, self.tile_n, self.tile_hdim, self.num_stages)
        self.sV_layout = smem_layout_sm90(dt, self.tile_n, self.tile_hdimv, self.num_stages)
        self.sO_layout = smem_layout_sm90(dt, self.tile_m, self.tile_hdimv)
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        self.tiled_mma_qk = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K, K, Float32, (self.num_wg, 1, 1), (64, self.tile_n))
        self.tiled_mma_pv = sm90_utils.make_trivial_tiled_mma(
            dt, dt, K, MN, Float32, (self.num_wg, 1, 1), (64, self.tile_hdimv), warpgroup.OperandSource.RMEM)
        # The box's elements, not ``size_in_bytes`` (its cosize): the first rows of a tile of several
        # column blocks span past their own bytes (126 of 128 rows at d128: 32512 against 32256), and
        # an expected count the box never delivers leaves the consumers waiting for ever.
        self.tma_bytes_q = cute.size(self.rows_box(self.sQ_stage_layout(), self.tile_hdim)) * dt.width // 8
        self.tma_bytes_k = cute.size_in_bytes(dt, cute.select(self.sK_layout, mode=[0, 1]))
        self.tma_bytes_v = cute.size_in_bytes(dt, cute.select(self.sV_layout, mode=[0, 1]))

        q_elems = cute.cosize(self.sQ_layout)
        if const_expr(self.o_in_q):
            q_elems = max(q_elems, cute.cosize(self.sO_layout))
        o_elems = 0 if const_expr(self.o_in_q or self.split) else cute.cosize(self.sO_layout)
        stages = self.num_stages

        @cute.struct
        class SharedStorage:
            mbar_sched: cute.struct.MemRange[cutlass.Int64, 4]
            next_idx: cute.struct.MemRange[Int32, 2]
            mbar_mail: cute.struct.MemRange[cutlass.Int64, 4 if self.pair_claims else 1]  # Note [Pair claims]
            mailbox: cute.struct.MemRange[Int32, 2 if self.pair_claims else 1]
            mbar_q: cute.struct.MemRange[cutlass.Int64, 2 * self.q_stages]
            mbar_k: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            mbar_v: cute.struct.MemRange[cutlass.Int64, 2 * stages]
            sQ: cute.struct.Align[cute.struct.MemRange[dt, q_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sK_layout)], 1024]
            sV: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sV_layout)], 1024]
            sO: cute.struct.Align[cute.struct.MemRange[dt, max(o_elems, 1)], 1024]

        self.SharedStorage = SharedStorage

    def sQ_stage_layout(self):
        """One Q stage's ``(tile_m, d)`` smem layout."""
        if const_expr(self.q_stages > 1):
            return cute.select(self.sQ_layout, mode=[0, 1])
        return self.sQ_layout

    def q_stage(self, t, index):
        """Stage ``index`` of a staged sQ tensor or fragment (its last mode), or ``t`` itself."""
        if const_expr(self.q_stages > 1):
            return t[(None,) * (cute.rank(t) - 1) + (index,)]
        return t

    def rows_box(self, s, cols: int):
        """The first ``q_rows`` rows of a ``(tile_m, cols)`` smem layout or tensor ``s`` (sQ / sO): the
        whole tile, or (packed boxes of ``tile_m // g`` positions, Note [Packed rows by TMA]) ``s``
        composed with ``(q_rows, cols):(1, tile_m)``, so the box keeps the tile's swizzle."""
        if const_expr(self.q_rows == self.tile_m):
            return s
        return _first_rows(s, self.q_rows, cols, self.tile_m)

    def kv_box_layout(self, s_layout, cols: int):
        """The smem layout a K/V TMA box lands in: a whole stage, or (paged) the first
        ``page_rows`` rows of one: the stage layout composed with ``(page_rows, cols):(1, tile_n)``,
        so the box's rows keep the stage's swizzle and column-block strides."""
        stage = cute.select(s_layout, mode=[0, 1])
        if const_expr(not self.page_rows):
            return stage
        return _first_rows(stage, self.page_rows, cols, self.tile_n)

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
        mPageTable: Optional[cute.Tensor],  # (b, max_pages) int32; K/V then (num_pages, page_size, h_k, d)
        mSink: Optional[cute.Tensor],  # (h,) float32: learnable sink logits (cfg.has_sink)
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_q: Int32,  # longest query sequence (= s_q when not varlen): sizes the grid
        max_ctas: Int32,  # persistent grid size (the SM count); ignored unless cfg.persistent
        num_splits: Int32,  # split-KV: K splits per tile (1 unless cfg.split_kv)
        mTileCounter: Optional[cute.Tensor],  # (1,) int32, zero: the dynamic scheduler's claims
        mAux: Optional[tuple],  # the user functions' aux tensors (cfg.aux; fa4/mods.py)
        stream,
    ):
        self._setup()
        cfg = self.cfg
        if const_expr(not self.split):
            num_splits = Int32(1)
        # Keys of a sequence without cu_seqlens_k / seqused_k: the K tensor's, or the page table's capacity.
        seqlen_k_static = mK.shape[1] if const_expr(not self.page_rows) else mPageTable.shape[1] * mK.shape[1]
        num_batch, num_m_blocks, section, sched_heads = fwd_common.grid_extent(
            mQ, mK, mCuSeqlensQ, mCuSeqlensK, max_seqlen_q, self.q_rows, 2 * (self.tile_hdim + self.tile_hdimv),
            cfg.qhead_per_kvhead, num_splits, mPageTable, cfg.l2_section_mb << 20, pow2_sections=True)
        prescale, scale_log2 = score_scales(softmax_scale, softcap, cfg.has_softcap, self.score_mod is not None)

        # TMA atoms over (s, d, h, b) views (Note [TMA and varlen / padding]).
        mQ_t, mK_t, mV_t, mO_t = (to_sdhb(t) for t in (mQ, mK, mV, mO))
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        tma_q, mQ_tma = None, mQ
        q_tiler = self.tile_m
        if const_expr(self.pack):  # Note [Packed rows by TMA]
            g = cfg.qhead_per_kvhead
            mQ_t, mO_t = packed_rows_view(mQ, g), packed_rows_view(mO, g)
            q_tiler = (g, self.tile_m // g)
        if const_expr(self.tma_q):
            q_box = self.rows_box(self.sQ_stage_layout(), self.tile_hdim)
            tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, mQ_t, q_box, (q_tiler, self.tile_hdim))
        # Paged K/V: one TMA per chunk of page_rows rows (Note [Paged K/V]).
        kv_rows = self.tile_n if const_expr(not self.page_rows) else self.page_rows
        g2s_kv = cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.mcast) else g2s
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s_kv, mK_t, self.kv_box_layout(self.sK_layout, self.tile_hdim),
                                                    (kv_rows, self.tile_hdim), self.kv_casts)
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(g2s_kv, mV_t, self.kv_box_layout(self.sV_layout, self.tile_hdimv),
                                                    (kv_rows, self.tile_hdimv), self.kv_casts)
        tma_o, mO_tma = None, None
        if const_expr(self.tma_o):
            o_box, o_tiler = self.rows_box(self.sO_layout, self.tile_hdimv), q_tiler
            if const_expr(self.wg_store):  # one warpgroup's 64 rows (Note [Warpgroup stores])
                o_box, o_tiler = _first_rows(self.sO_layout, 64, self.tile_hdimv, self.tile_m), 64
            tma_o, mO_tma = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileS2GOp(), mO_t, o_box,
                                                        (o_tiler, self.tile_hdimv))
        if const_expr(self.mcast):  # whole clusters: an odd count gets a tile past the rows (Note [K/V multicast])
            num_m_blocks = (num_m_blocks + 1) // 2 * 2
        max_grid = max_ctas if const_expr(cfg.persistent) else num_m_blocks * sched_heads * num_batch
        scheduler = ClusterPairScheduler if const_expr(self.mcast) else PersistentTileScheduler
        grid = scheduler.grid(num_m_blocks, sched_heads, num_batch, max_grid)
        if const_expr(cfg.compact_grid):  # Note [Compact varlen grid]: slots per scheduler head
            num_m_blocks = mQ.shape[1] * cfg.qhead_per_kvhead // self.q_rows + num_batch
            grid = CompactVarlenTileScheduler.grid(num_m_blocks, sched_heads)
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mO_tma if const_expr(self.tma_o) else mO, mLSE,
            mCuSeqlensQ, mCuSeqlensK, mSeqUsedQ, mSeqUsedK, mPageTable, mSink, mTileCounter, mAux, tma_q, tma_k,
            tma_v, tma_o,
            scale_log2, prescale, window_left, window_right, num_m_blocks, sched_heads, num_batch, num_splits,
            section, mQ.shape[1], seqlen_k_static,
            self.sQ_layout, self.sK_layout, self.sV_layout, self.sO_layout, self.tiled_mma_qk, self.tiled_mma_pv,
        ).launch(
            grid=grid,
            block=[self.num_threads, 1, 1],
            smem=self.SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            cluster=[self.kv_casts, 1, 1] if const_expr(self.mcast) else None,
        )

    # ----------------------------------------------------------------------------------------
    # Device side
    # ----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinates (s_q, d, h, b), packed ((g, s_q), d, h_k, b); row copies: (b, s_q, h, d)
        mK: cute.Tensor,  # TMA coordinates (s_k, d, h_k, b)
        mV: cute.Tensor,  # TMA coordinates (s_k, dv, h_k, b)
        mO: cute.Tensor,  # TMA coordinates as mQ; stored by rows (varlen / seqused Q, split, row copies): (b, s, h, dv)
        mLSE: Optional[cute.Tensor],
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedQ: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mPageTable: Optional[cute.Tensor],
        mSink: Optional[cute.Tensor],
        mTileCounter: Optional[cute.Tensor],
        mAux: Optional[tuple],
        tma_q: Optional[cute.CopyAtom],
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_o: Optional[cute.CopyAtom],
        scale_log2: Float32,
        prescale: Optional[Float32],
        window_left: Int32,
        window_right: Int32,
        num_m_blocks: Int32,
        sched_heads: Int32,
        num_batch: Int32,
        num_splits: Int32,
        section: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        sQ_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sO_layout: cute.ComposedLayout,
        tiled_mma_qk: cute.TiledMma,
        tiled_mma_pv: cute.TiledMma,
    ):
        # Layouts and MMAs arrive as kernel arguments (values of the host function cannot be used
        # in the kernel's region); the role methods read them from self.
        self.tiled_mma_qk, self.tiled_mma_pv = tiled_mma_qk, tiled_mma_pv
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_o):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.SharedStorage)
        pipes = self.make_pipelines(storage)
        if const_expr(self.pair_claims):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    ClusterPairDynamicScheduler.init_mailbox(storage.mbar_mail.data_ptr())
        cute.arch.mbarrier_init_fence()
        if const_expr(self.mcast):  # the peer's barriers are initialized before any TMA or release reaches them
            cute.arch.cluster_arrive_relaxed()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        if const_expr(self.cfg.pdl):  # the combine may launch (Note [Combine launched early] in fa4/combine.py)
            cute.arch.griddepcontrol_launch_dependents()

        if const_expr(self.pair_claims):
            sched = ClusterPairDynamicScheduler(num_m_blocks, sched_heads, num_batch, section, reverse=self.cfg.lpt,
                                                counter=mTileCounter.iterator,
                                                next_idx=storage.next_idx.get_tensor(cute.make_layout(2)),
                                                pipe=pipes["sched"],
                                                mailbox=storage.mailbox.get_tensor(cute.make_layout(2)),
                                                mail_bar=storage.mbar_mail.data_ptr())
        elif const_expr(self.cfg.dynamic_sched):
            sched = DynamicTileScheduler(num_m_blocks, sched_heads, num_batch, section, reverse=self.cfg.lpt,
                                         counter=mTileCounter.iterator,
                                         next_idx=storage.next_idx.get_tensor(cute.make_layout(2)),
                                         pipe=pipes["sched"])
        elif const_expr(self.mcast):
            sched = ClusterPairScheduler(num_m_blocks, sched_heads, num_batch, section, reverse=self.cfg.lpt)
        elif const_expr(self.cfg.compact_grid):
            sched = CompactVarlenTileScheduler(num_m_blocks, sched_heads, num_batch, section, reverse=self.cfg.lpt,
                                               mCuSeqlens=mCuSeqlensQ, tile_rows=self.q_rows,
                                               mult=self.cfg.qhead_per_kvhead)
        else:
            sched = PersistentTileScheduler(num_m_blocks, sched_heads, num_batch, section, reverse=self.cfg.lpt)
        tile_info = partial(self.tile_info, sched=sched, mCuSeqlensQ=mCuSeqlensQ, mCuSeqlensK=mCuSeqlensK,
                            mSeqUsedK=mSeqUsedK, mSeqUsedQ=mSeqUsedQ, seqlen_q_static=seqlen_q_static,
                            seqlen_k_static=seqlen_k_static, window_left=window_left, window_right=window_right,
                            num_splits=num_splits, mAux=mAux)
        sQ = storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner)
        sK = storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner)
        sV = storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner)
        if const_expr(self.o_in_q):
            sO = storage.sQ.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)
        else:
            sO = storage.sO.get_tensor(sO_layout.outer, swizzle=sO_layout.inner)

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipes, sched, tile_info, mPageTable, mAux)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.mma_softmax(mQ, mO, mLSE, sQ, sK, sV, sO, tma_o, pipes, sched, tile_info, scale_log2, prescale,
                             num_batch, mSink, mAux)
        if const_expr(self.mcast):  # no CTA exits while its peer may still write its smem or arrive on its barriers
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    def make_pipelines(self, storage):
        """The Q, K and V pipelines (arrive counts: module docstring)."""
        group = partial(pipeline.CooperativeGroup, pipeline.Agent.Thread)
        consumer_warps = self.num_consumer_threads // 32
        mk = partial(pipeline.PipelineTmaAsync.create, producer_group=group(1), defer_sync=True)
        # K / V multicast (Note [K/V multicast]): a stage is free once both CTAs' consumer warps released it
        # (lanes 0 and 1 of each warp arrive at CTA 0 and 1).
        kv_casts = self.kv_casts
        mk_kv = partial(mk, cta_layout_vmnk=cute.make_layout((1, kv_casts, 1, 1)))
        pipes = {}
        if const_expr(self.cfg.dynamic_sched):
            # Tile claims (DynamicTileScheduler): the producer warp's lanes -> every consumer thread.
            pipes["sched"] = pipeline.PipelineAsync.create(
                barrier_storage=storage.mbar_sched.data_ptr(), num_stages=2, producer_group=group(32),
                consumer_group=group(self.num_consumer_threads), defer_sync=True)
        return dict(
            pipes,
            q=mk(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, tx_count=self.tma_bytes_q,
                 consumer_group=group(1 if self.o_in_q else consumer_warps)),
            k=mk_kv(barrier_storage=storage.mbar_k.data_ptr(), num_stages=self.num_stages,
                    tx_count=self.tma_bytes_k, consumer_group=group(kv_casts * consumer_warps)),
            v=mk_kv(barrier_storage=storage.mbar_v.data_ptr(), num_stages=self.num_stages,
                    tx_count=self.tma_bytes_v, consumer_group=group(kv_casts * consumer_warps)),
        )

    @cute.jit
    def tile_info(self, idx: Int32, sched, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, mSeqUsedQ, seqlen_q_static,
                  seqlen_k_static, window_left, window_right, num_splits, mAux=None):
        """``(m_block, head, split, batch, seqlen, mask, n_min, n_max, active)`` of tile ``idx``:
        ``head`` is the kv head when packed; ``[n_min, n_max)`` the K blocks of the tile's split
        (may be empty; with ``block_skip``, from its lowest to its highest visible block);
        ``active`` is false for a varlen tile past its sequence."""
        m_block, sched_head, batch = sched.tile(idx)
        head, split = sched_head, Int32(0)
        if const_expr(self.split):
            head, split = split_head(sched_head, num_splits)
        seqlen = SeqlenInfo.create(batch, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
                                   mSeqUsedQ)
        mask = AttentionMask(self.tile_m, self.tile_n, self.cfg.causal, self.cfg.local, seqlen.seqlen_q,
                             seqlen.seqlen_k, window_left, window_right, self.cfg.qhead_per_kvhead, self.q_rows)
        n_min, n_max = mask.n_block_range(m_block)
        if const_expr(self.mcast and self.cfg.causal):
            # Both tiles of a cluster walk their pair's blocks, the union of their ranges; the first
            # tile's blocks past its own diagonal are masked whole (Note [K/V multicast], causal pairs).
            other_min, other_max = mask.n_block_range(m_block + 1 - 2 * (m_block % 2))
            n_min, n_max = cutlass.min(n_min, other_min), cutlass.max(n_max, other_max)
        if const_expr(self.split):
            n_min, n_max = split_range(n_min, n_max, split, num_splits)
        if const_expr(self.cfg.block_skip):
            n_min, n_max = self.block_skipper(mAux, batch, head, m_block).narrow(n_min, n_max)
        active = m_block * self.q_rows < seqlen.seqlen_q * self.cfg.qhead_per_kvhead
        if const_expr(self.mcast):
            active = True  # a tile past the rows still loads its half of K / V for its peer (Note [K/V multicast])
        return m_block, head, split, batch, seqlen, mask, n_min, n_max, active

    def block_skipper(self, mAux, batch, head, m_block):
        """The tile's :class:`BlockSkip` (``cfg.block_skip``), or None."""
        if const_expr(not self.cfg.block_skip):
            return None
        slot, bq, bk = self.cfg.block_skip
        return BlockSkip(mAux[slot], bq, bk, self.tile_m, self.tile_n, batch, head, m_block)

    # --- producer ---------------------------------------------------------------------------

    @cute.jit
    def load(self, mQ, mK, mV, sQ, sK, sV, tma_q, tma_k, tma_v, pipes, sched, tile_info, mPageTable,
             mAux=None) -> None:
        """Warp 0: per tile, K[last], Q (by TMA unless packed rows are copied), then K[n] / V[n + 1] pairs, then
        V[first], over the K blocks of the tile's split (module docstring); with ``block_skip``
        the pairs are of visible blocks (K[n] / V[the previous visible one]); with ``edges_first``
        (local tiles) of the blocks in that order (K[next] / V[previous], Note [Edges first])."""
        pq, pk, pv = pipes["q"], pipes["k"], pipes["v"]
        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
        head_ratio = mQ.shape[2] // mK.shape[2]
        t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 2)
        idx = sched.first()
        while sched.valid(idx):
            m_block, head, split, batch, seqlen, mask, n_min, n_max, active = tile_info(idx)
            if active and n_min < n_max:
                head_kv = head if const_expr(self.pack) else head // head_ratio
                if const_expr(not self.page_rows):
                    gK = cute.local_tile(seqlen.k_view_sd(mK, batch, head_kv), (self.tile_n, self.tile_hdim),
                                         (None, 0))
                    gV = cute.local_tile(seqlen.k_view_sd(mV, batch, head_kv), (self.tile_n, self.tile_hdimv),
                                         (None, 0))
                    rank, casts = 0, cute.make_layout(self.kv_casts)
                    if const_expr(self.mcast):  # this CTA's half of each block, to both (Note [K/V multicast])
                        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
                    tKsK, tKgK = cpasync.tma_partition(tma_k, rank, casts, cute.group_modes(sK, 0, 2),
                                                       cute.group_modes(gK, 0, 2))
                    tVsV, tVgV = cpasync.tma_partition(tma_v, rank, casts, cute.group_modes(sV, 0, 2),
                                                       cute.group_modes(gV, 0, 2))
                else:  # paged: (TMA operands, batch, kv head), each block chunked by load_block
                    tKgK, tKsK = (mK, sK), (mPageTable, batch, head_kv)
                    tVgV, tVsV = (mV, sV), (mPageTable, batch, head_kv)

                self.load_block(tma_k, pk, tKgK, tKsK, n_max - 1, kv_state)
                if const_expr(self.tma_q):  # (else packed Q rows: the consumers load them, Note [Pack GQA])
                    self.load_q(tma_q, mQ, self.q_stage(sQ, q_state.index), pq, q_state, seqlen, batch, head, m_block)
                    q_state.advance()
                v_state = kv_state.clone()
                kv_state.advance()
                if const_expr(not self.cfg.block_skip):
                    if const_expr(self.edges_first):  # (the consumers' order, Note [Edges first])
                        n_a, n_b = window_bounds(mask, m_block, n_min, n_max)
                    prev = n_max - 1
                    for i in cutlass.range(n_max - 1 - n_min, unroll=1):
                        n = n_max - 2 - i
                        if const_expr(self.edges_first):
                            n = edges_first_block(i + 1, n_max, n_min, n_a, n_b)
                        self.load_block(tma_k, pk, tKgK, tKsK, n, kv_state)
                        self.load_block(tma_v, pv, tVgV, tVsV, prev, v_state)
                        kv_state.advance()
                        v_state.advance()
                        prev = n
                    self.load_block(tma_v, pv, tVgV, tVsV, prev, v_state)
                else:
                    skip = self.block_skipper(mAux, batch, head, m_block)
                    prev = n_max - 1
                    for i in cutlass.range(n_max - 1 - n_min, unroll=1):
                        n = n_max - 2 - i
                        if skip.visible(n):
                            self.load_block(tma_k, pk, tKgK, tKsK, n, kv_state)
                            self.load_block(tma_v, pv, tVgV, tVsV, prev, v_state)
                            kv_state.advance()
                            v_state.advance()
                            prev = n
                    self.load_block(tma_v, pv, tVgV, tVsV, prev, v_state)
            if const_expr(self.tma_q and self.o_in_q):
                if active and n_min >= n_max:  # no K block: its Q anyway (Note [Empty tiles and o_in_q])
                    self.load_q(tma_q, mQ, self.q_stage(sQ, q_state.index), pq, q_state, seqlen, batch, head, m_block)
                    q_state.advance()
            if const_expr(self.skip_empty):  # claims past empty varlen tiles (Note [Skipped claims])
                idx, t_state = sched.next_producer(idx, t_state, partial(self.tile_empty, tile_info=tile_info))
            else:
                idx, t_state = sched.next_producer(idx, t_state)

    @cute.jit
    def tile_empty(self, idx: Int32, tile_info):
        """Whether tile ``idx`` (valid) has no rows: a varlen / seqused_q tile past its sequence."""
        *_, active = tile_info(idx)
        return not active

    @cute.jit
    def load_q(self, tma_q, mQ, sQ, pq, q_state, seqlen: SeqlenInfo, batch: Int32, head: Int32,
               m_block: Int32) -> None:
        """The tile's Q, by TMA completing on the Q stage's mbarrier (packed: ``head`` is the kv
        head, Note [Packed rows by TMA])."""
        gQ = self.q_tile(mQ, seqlen, batch, head, m_block, self.tile_hdim)
        tQsQ, tQgQ = cpasync.tma_partition(tma_q, 0, cute.make_layout(1),
                                           cute.group_modes(self.rows_box(sQ, self.tile_hdim), 0, 2),
                                           cute.group_modes(gQ, 0, 2))
        pq.producer_acquire(q_state)
        cute.copy(tma_q, tQgQ, tQsQ, tma_bar_ptr=pq.producer_get_barrier(q_state))

    def q_tile(self, mT, seqlen: SeqlenInfo, batch: Int32, head: Int32, m_block: Int32, cols: int) -> cute.Tensor:
        """Tile ``m_block`` of a TMA coordinate tensor on the Q side (Q or O): of ``(s, d, h, b)``,
        or packed of ``((g, s), d, h_k, b)`` (Note [Packed rows by TMA])."""
        if const_expr(self.pack):
            return packed_tile(mT, self.cfg.qhead_per_kvhead, self.tile_m, cols, m_block, head,
                               batch_slot(batch, self.cfg.varlen_q), seqlen.offset_q, self.cfg.varlen_q)
        return cute.local_tile(seqlen.q_view_sd(mT, batch, head), (self.tile_m, cols), (m_block, 0))

    def block_pages(self, tXsX, mX, n: Int32) -> list:
        """The page indices of paged block ``n``'s chunks (Note [Paged K/V]), clamped to the table:
        rows past it (the last block's tail) read a valid page, masked / zeroed later."""
        mPageTable, batch, _ = tXsX
        page_size = mX.shape[0]  # TMA coordinates (page_size, d, h_k, num_pages)
        last_slot = mPageTable.shape[1] - 1
        rows = self.page_rows
        return [mPageTable[batch, cutlass.min((n * self.tile_n + c * rows) // page_size, last_slot)]
                for c in range(self.tile_n // rows)]

    @cute.jit
    def load_block(self, tma, pipe, tXgX, tXsX, n: Int32, state) -> None:
        """Wait for the stage to be free, then TMA block ``n`` into it (completing on its mbarrier).
        Paged (``tXgX = (mX, sX)``, ``tXsX = (page table, batch, kv head)``): one TMA per chunk of
        ``page_rows`` rows, from the page holding it (Note [Paged K/V])."""
        if const_expr(not self.page_rows):
            to_all = {}  # (K / V multicast: to every CTA of the cluster, Note [K/V multicast])
            if const_expr(self.mcast):
                to_all = dict(mcast_mask=cutlass.Int16((1 << self.kv_casts) - 1))
            pipe.producer_acquire(state)
            cute.copy(tma, tXgX[None, n], tXsX[None, state.index], tma_bar_ptr=pipe.producer_get_barrier(state),
                      **to_all)
        else:
            (mX, sX), (mPageTable, batch, head_kv) = tXgX, tXsX
            rows, cols = self.page_rows, cute.size(sX, mode=[1])
            page_size = mX.shape[0]  # TMA coordinates (page_size, d, h_k, num_pages)
            one = cute.make_layout(1)
            # The block's page indices are read before waiting for the stage, so their latency
            # hides under the wait.
            chunks = self.tile_n // rows
            pages = self.block_pages(tXsX, mX, n)
            pipe.producer_acquire(state)
            for c in cutlass.range_constexpr(chunks):
                row = n * self.tile_n + c * rows
                slot = row // page_size
                page = pages[c]
                gX = cute.local_tile(mX[None, None, head_kv, page], (rows, cols), (None, 0))
                sC = cute.local_tile(sX[None, None, state.index], (rows, cols), (c, 0))
                tXs, tXg = cpasync.tma_partition(tma, 0, one, cute.group_modes(sC, 0, 2), cute.group_modes(gX, 0, 2))
                cute.copy(tma, tXg[None, (row - slot * page_size) // rows], tXs,
                          tma_bar_ptr=pipe.producer_get_barrier(state))

    # --- consumers --------------------------------------------------------------------------

    def pp_bar(self, wg):
        """The ping-pong barrier of warpgroup ``wg`` (Note [ping-pong])."""
        if const_expr(self.num_wg == 2):
            return _BAR_PP0 + wg
        return _BAR_PP0 + wg + (wg // 2) * (_BAR_PP2 - _BAR_PP0 - 2)

    def pp_sync(self, wg: Int32, edge: bool = False) -> None:
        """Wait for this warpgroup's turn on the tensor cores (Note [ping-pong]). ``edge``: a tile's
        first ``Q K^T`` or last ``P V``, outside the turns with ``pp_steps_only``."""
        if const_expr(self.pingpong and not (edge and self.cfg.pp_steps_only)):
            cute.arch.barrier(barrier_id=self.pp_bar(wg), number_of_threads=256)

    def pp_arrive(self, wg: Int32, edge: bool = False) -> None:
        """Hand the tensor cores to the next warpgroup."""
        if const_expr(self.pingpong and not (edge and self.cfg.pp_steps_only)):
            if const_expr(self.num_wg == 2):
                cute.arch.barrier_arrive(barrier_id=_BAR_PP0 + 1 - wg, number_of_threads=256)
            else:
                cute.arch.barrier_arrive(barrier_id=self.pp_bar((wg + 1) % self.num_wg), number_of_threads=256)

    @cute.jit
    def mma_softmax(self, mQ, mO, mLSE, sQ, sK, sV, sO, tma_o, pipes, sched, tile_info, scale_log2, prescale,
                    num_batch, mSink, mAux) -> None:
        """Consumer warpgroups: per tile, the K-block loop (Note [intra-warpgroup overlap]), then
        :meth:`epilogue`."""
        cfg = self.cfg
        pq, pk, pv = pipes["q"], pipes["k"], pipes["v"]
        tidx = cute.arch.thread_idx()[0] - 128
        wg = cute.arch.make_warp_uniform(tidx // 128)
        thr_mma_qk = self.tiled_mma_qk.get_slice(tidx)
        thr_mma_pv = self.tiled_mma_pv.get_slice(tidx)
        wg_mma_qk = self.tiled_mma_qk.get_slice(wg * 128)
        wg_mma_pv = self.tiled_mma_pv.get_slice(wg * 128)
        # V^T (dv, tile_n, stages): the B operand of P @ V, MN-major.
        sVt = transposed(sV)
        tSrQ = wg_mma_qk.make_fragment_A(wg_mma_qk.partition_A(sQ))
        tSrK = wg_mma_qk.make_fragment_B(wg_mma_qk.partition_B(sK))
        tOrVt = wg_mma_pv.make_fragment_B(wg_mma_pv.partition_B(sVt))
        acc_S = thr_mma_qk.make_fragment_C(thr_mma_qk.partition_shape_C((self.tile_m, self.tile_n)))
        acc_O = thr_mma_pv.make_fragment_C(thr_mma_pv.partition_shape_C((self.tile_m, self.tile_hdimv)))
        rP = cute.make_rmem_tensor_like(acc_S, self.dtype)
        tOrP = make_acc_as_A(rP)
        softmax = OnlineSoftmax(scale_log2, cute.size(make_acc_mn_view(acc_S).shape[0]), cfg.exp2_emu_frac,
                                cfg.rescale_threshold, self.dtype if cfg.sum_rounded else None)
        # Row scales of the last softmax, applied to O just before the next P V (rescale_o_before_pv).
        row_scale_prev = cute.make_rmem_tensor(softmax.num_rows, Float32)
        c = SimpleNamespace(pk=pk, pv=pv, thr_mma_qk=thr_mma_qk, tSrQ=tSrQ, tSrK=tSrK, tOrVt=tOrVt, tOrP=tOrP,
                            acc_S=acc_S, acc_O=acc_O, rP=rP, row_scale=row_scale_prev)

        if const_expr(self.pingpong):
            if wg == self.num_wg - 1:
                cute.arch.barrier_arrive(barrier_id=_BAR_PP0, number_of_threads=256)

        kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.num_stages)
        q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
        t_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 2)
        idx = sched.first()
        # Note [Tiles overlapped]: this tile's first Q K^T was issued (and completed) under the last
        # tile's epilogue, and its Q waited for.
        prefetched = False
        if const_expr(cfg.overlap_tiles):
            prefetched = cutlass.Boolean(False)
        while sched.valid(idx):
            m_block, head, split, batch, seqlen, mask, n_min, n_max, active = tile_info(idx)
            issued = prefetched
            if const_expr(cfg.overlap_tiles):
                prefetched = cutlass.Boolean(False)
                next_idx = idx
                claimed = cutlass.Boolean(False)
            if active:
                softmax.reset()
                acc_O.fill(0.0)
                has_work = n_min < n_max
                rows = TileRows.create(cfg.qhead_per_kvhead, self.tile_m, m_block, head, seqlen.seqlen_q,
                                       self.q_rows)
                umod = None
                if const_expr(self.user_mods):
                    umod = UserMods(self.score_mod, self.mask_mod, self.tile_m, self.tile_n, cfg.qhead_per_kvhead,
                                    batch, head, seqlen, mAux,
                                    **block_mods(self.mask_mod, cfg.block_skip, self.tile_m, self.tile_n))
                ct = c
                if const_expr(self.q_stages > 1):  # this tile's Q stage (overlap_tiles)
                    ct = SimpleNamespace(**dict(vars(c), tSrQ=self.q_stage(tSrQ, q_state.index)))
                if has_work:
                    if const_expr(self.tma_q):
                        if not issued:
                            pq.consumer_wait(q_state)
                    else:
                        # Packed rows (Note [Pack GQA]): every consumer is past its last read of sQ
                        # (the previous tile's Q K^T) before the first write.
                        cute.arch.barrier(barrier_id=_BAR_Q, number_of_threads=self.num_consumer_threads)
                        load_q_rows(mQ, sQ, rows, seqlen, batch_slot(batch, cfg.varlen_q), cfg.head_dim, tidx,
                                    self.num_consumer_threads)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        cute.arch.barrier(barrier_id=_BAR_Q, number_of_threads=self.num_consumer_threads)

                    if const_expr(fwd_common.folds_first(cfg, mask, umod)):
                        # Note [The first block in the masked loop]: its Q K^T here, complete before
                        # the walk, which runs the rest of it.
                        self.first_qk(ct, kv_state, wg, issued)
                        v_state = kv_state.clone()
                        step = partial(self.step_carry, ct, softmax, mask, m_block, prescale, wg)
                        first = partial(self.first_or_masked_step, ct, softmax, mask, m_block, prescale, wg, sV,
                                        seqlen, tidx)
                        kv_state, v_state = walk_blocks(mask, m_block, n_min, n_max, step, (kv_state, v_state),
                                                        uniform_bounds=True, first_step=first,
                                                        edges_first=self.edges_first)
                    else:
                        # First block (the last K block): its Q K^T alone.
                        self.first_qk(ct, kv_state, wg, issued)
                        pk.consumer_release(kv_state)
                        skip = self.block_skipper(mAux, batch, head, m_block)
                        first_mode = None
                        if const_expr(skip is not None):
                            _, first_mode = skip.state(n_max - 1)
                        self.scores(acc_S, mask, thr_mma_qk, m_block, n_max - 1, prescale, True, True, umod=umod,
                                    mask_mode=first_mode)
                        row_scale_prev.store(softmax.update(acc_S, is_first=True)[0].load())
                        softmax.convert_P(acc_S, rP)
                        v_state = kv_state.clone()
                        if const_expr(cfg.has_seqused_k):
                            self.clear_v_tail(pv, v_state, sV, seqlen.seqlen_k - (n_max - 1) * self.tile_n, tidx)
                        kv_state.advance()
                        step = partial(self.step_carry, ct, softmax, mask, m_block, prescale, wg, umod=umod)
                        if const_expr(skip is not None):  # the hidden blocks: no step (the producer skips them too)
                            step = partial(self.step_if_visible, skip, step)
                        kv_state, v_state = walk_blocks(mask, m_block, n_min, n_max, step, (kv_state, v_state),
                                                        cfg.one_step_loop, uniform_bounds=True,
                                                        edges_first=self.edges_first)
                    if const_expr(self.tma_q and not self.o_in_q):
                        pq.consumer_release(q_state)
                        q_state.advance()
                    # Last P V.
                    if const_expr(cfg.rescale_o_before_pv):
                        rescale_rows(make_acc_mn_view(acc_O), row_scale_prev)
                    pv.consumer_wait(v_state)
                    self.pp_sync(wg, edge=True)
                    gemm_sm90(self.tiled_mma_pv, acc_O, tOrP, tOrVt[None, None, None, v_state.index])
                    self.pp_arrive(wg, edge=True)
                    if const_expr(cfg.overlap_tiles):
                        # Note [Tiles overlapped]: the next tile's first Q K^T behind this P V.
                        next_idx, t_state, prefetched = self.claim_next(sched, tile_info, idx, t_state)
                        claimed = cutlass.Boolean(True)
                        # (issued either way: ptxas serializes every wgmma of the kernel when one is
                        # issued under a runtime branch here; without a next tile it reads stale smem)
                        self.issue_first_qk(ct, self.q_stage(tSrQ, q_state.index), pq, q_state, kv_state, wg,
                                            prefetched)
                        if prefetched:
                            warpgroup.wait_group(1)
                        else:
                            warpgroup.wait_group(0)
                    else:
                        warpgroup.wait_group(0)
                    pv.consumer_release(v_state)
                if const_expr(self.tma_q and self.o_in_q):
                    if not has_work:
                        pq.consumer_wait(q_state)  # Note [Empty tiles and o_in_q]
                sinks = None
                if const_expr(cfg.has_sink and not self.split):  # split-KV: the combine adds it
                    sinks = row_sinks(mSink, thr_mma_pv, rows, self.tile_hdimv, softmax.num_rows)
                lse = softmax.finalize(acc_O, sinks)
                slot = partial_slot(split, batch, num_batch, cfg.varlen_q)
                self.epilogue(acc_O, lse, mO, mLSE, sO, tma_o, seqlen, rows, slot, m_block, head, batch, thr_mma_pv,
                              tidx)
                if const_expr(self.tma_q and self.o_in_q):  # every tile took the stage
                    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 4:
                        pq.consumer_release(q_state)
                    q_state.advance()
                if const_expr(cfg.overlap_tiles):
                    warpgroup.wait_group(0)  # the next tile's first Q K^T (none pending: a no-op)
            if const_expr(cfg.overlap_tiles):
                if not claimed:
                    next_idx, t_state = self.next_tile(sched, idx, t_state)
                idx = next_idx
            else:
                idx, t_state = sched.next_consumer(idx, t_state)
        if const_expr(self.tma_o):
            if self.is_store_warp():
                cute.arch.cp_async_bulk_wait_group(0, read=True)

    def is_store_warp(self):
        """Whether this consumer warp issues O's TMA stores: warp 4, or with ``wg_store_o`` each
        warpgroup's first warp (Note [Warpgroup stores])."""
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if const_expr(self.wg_store):
            return warp % 4 == 0
        return warp == 4

    # Note [K/V multicast]
    # ~~~~~~~~~~~~~~~~~~~~
    # Every tile of a head reads the head's whole K and V. On the H100 fa4's forward reads 20-46%
    # more L2 sectors than flash-attn-4's (d64 s8k / d128 s16k, RESULTS v0.49) for the same DRAM
    # bytes: requests for one sector are merged before the L2 counts them, and fewer of fa4's
    # merge. With ``kv_mcast`` (the d128 default without a mask from s_k 4096) that sharing is made
    # explicit: CTAs launch in clusters of two on m-blocks ``2m`` and ``2m + 1`` of one head at every
    # step (:class:`fa4.sched.tile.ClusterPairScheduler`: on the plain grid one pair per cluster, on
    # the persistent grid the snake over pairs), and each CTA's producer loads half of every K / V
    # block (``tma_partition`` over the two CTAs) by TMA multicast into both CTAs' stage, so the L2
    # serves each block once per cluster.
    # - Each CTA's full barrier expects the whole block's bytes (its half and the peer's).
    # - A stage is free only when both CTAs' consumers have released it: the K / V empty barriers
    #   count ``2 x`` consumer warps, and lanes 0 / 1 of each consumer warp arrive at CTA 0 / 1
    #   (``PipelineTmaAsync`` with a ``(1, 2, 1, 1)`` cluster layout).
    # - Both tiles of a cluster walk the same K blocks in the same order: dense tiles only, without a
    #   window, split-KV, pages or user functions (``FwdSm90Config.kv_mcast_blockers``). Pack GQA
    #   serves: a pair's two tiles hold rows of one kv head.
    # - Causal pairs (v0.52; the d128 default from s_k 8192) walk the union of their two ranges, the
    #   second tile's: the first tile's blocks past its own diagonal lie at or above its first masked block
    #   (``n_block_min_no_right_mask``), so every path (separate loops, ``fold_first``, one step body)
    #   masks them whole; its row maxes stay -inf and its O 0 until its own blocks come, and the
    #   softmax's general update from there gives scales of 0: the bits of the kernel without
    #   multicast for finite V (a non-finite V row there now reaches it as 0 x V, as one past the
    #   diagonal inside a diagonal block always did). Its cost: tile_m / tile_n more blocks a pair.
    #   On the dynamic grid CTA 0 claims the pairs (Note [Pair claims] in fa4/sched/tile.py).
    # - An odd m-block count gets one more tile per head, past the rows: it runs (its Q is TMA's
    #   zero fill, its O box and LSE rows are clipped), because its half of every block is the
    #   peer's too (``tile_info``'s ``active``).
    # - The barriers are initialized cluster-wide before any multicast or remote arrive, and no
    #   CTA exits before its peer is done with it (a cluster barrier at each end of the kernel).
    # Measured: RESULTS v0.49 and v0.50 (tests/test_fwd_sm90_gpu.py::test_kv_multicast_matches_single_cta:
    # the same bits as the plain grid without it, on both grids).

    # Note [The first block in the masked loop]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A causal tile used to inline three copies of the K-block step: the first block (its Q K^T
    # alone, both masks, the softmax's first update), the loop over the other blocks the diagonal
    # cuts (at d128 usually none: a 128 x 128 tile's diagonal is its first block), and the free loop.
    # The compile time scales with that code (LLVM and ptxas: RESULTS v0.39). With ``fold_first`` the
    # first block's Q K^T is issued and completed before the walk, and the rest of it (mask, softmax)
    # is the masked loop's first iteration, where a runtime ``is_first`` skips the issue of Q K^T and
    # of the previous block's P V (there is none); the softmax update is the general one, which from
    # row maxes of -inf and sums of 0 gives scales of 0 on a zero O, so every bit is as before
    # (tests/test_fold_first_gpu.py); the seqlen mask, a min per row, runs on every block of the
    # loop. Three constraints of the toolchain shape the code:
    # - ptxas serializes every wgmma of the kernel (a wait after each, C7515) when some path may
    #   redefine an accumulator while a wgmma is pending. A wait for the previous P V under
    #   ``not is_first`` left such a path (the branches are correlated, ptxas does not see it), so
    #   the wait is unconditional (a no-op on the first block) and only V's release is branched
    #   (tests/test_compile.py::test_fold_first_keeps_wgmmas_async).
    # - The DSL threads through a runtime branch every object whose method the branch calls (as a
    #   possibly mutated value), so a branch that called ``c.pv.consumer_wait`` rebound ``c``'s
    #   fields to values defined inside the loop, and the free loop's step read them out of scope.
    #   The branches call methods of ``self`` only (``issue_qk_pv``, ``release_v``).
    # - LLVM does not hoist the wgmma descriptors' arithmetic out of the loops; it only reuses a
    #   computation that dominates them. With the first Q K^T inside the masked loop, nothing
    #   before the free loop computed Q's descriptors, and ptxas rebuilt them there on every block
    #   (d128: 449 -> 473 instructions a free block). Issued before the walk, the first Q K^T
    #   computes them once (454). It must complete there too: a Q K^T possibly pending at the loop's
    #   head serializes the wgmmas as above.
    # Measured (H100): compile d64 / d128 causal 1.75 -> 1.40 / 2.46 -> 1.81 s; speed within the
    # rows' spread on causal rows (RESULTS v0.44, the first form; v0.45's, with Q K^T before the
    # walk, the same within 1%). A local tile folds both window edges into one loop (Note [Edges
    # first] in fa4/mask.py); the window row (1024, 0) s8k measured +2-3% at d64 and 2-5% slower at
    # d128, so local tiles fold at d64 only. ncu of that d128 row (RESULTS v0.46): the fold issues
    # 3.2% more instructions at the same cycles per instruction; ptxas rebuilds four of Q's
    # descriptors in its free loop where the separate form holds them in uniform registers.

    @cute.jit
    def first_or_masked_step(self, c: SimpleNamespace, softmax: OnlineSoftmax, mask: AttentionMask, m_block: Int32,
                             prescale, wg: Int32, sV, seqlen: SeqlenInfo, tidx: Int32, n: Int32, carry, is_first):
        """A block at the window's right edge (with ``edges_first``, either edge), the tile's first
        (``n_max - 1``, runtime ``is_first``) included: :meth:`step` with the seqlen mask too, where
        the first block, whose ``Q K^T`` the caller issued and completed before the walk, issues
        nothing (there is no ``P V`` before it). Returns the stage states: V's lags K's by one block
        (the next step's ``P V`` reads this block's V)."""
        kv_state, v_state = carry
        # (The runtime branch calls methods of ``self`` only: the DSL threads any other object
        # whose method a branch calls through it as a result, and ``c`` is shared with the free
        # loop's step.)
        if not is_first:  # (the first block's Q K^T completed before the walk)
            self.issue_qk_pv(c, kv_state, v_state, wg)
            warpgroup.wait_group(1)
        self.scores(c.acc_S, mask, c.thr_mma_qk, m_block, n, prescale, True, True)
        c.pk.consumer_release(kv_state)  # Note [K's release after the mask]
        # The first block's update as any other's: from row maxes of -inf and sums of 0, its scales
        # are 0 and O (zero) stays zero, so the bits are those of ``update(is_first=True)``.
        row_scale, do_rescale = softmax.update(c.acc_S)
        warpgroup.wait_group(0)  # (every path: ptxas keeps the wgmmas asynchronous only so)
        if not is_first:
            self.release_v(c, v_state)
        if const_expr(self.cfg.rescale_o_before_pv):
            c.row_scale.store(row_scale.load())
        else:
            softmax.rescale_O(c.acc_O, row_scale, do_rescale)
        softmax.convert_P(c.acc_S, c.rP)
        v_state = kv_state.clone()
        if const_expr(self.cfg.has_seqused_k):
            if is_first:
                self.clear_v_tail(c.pv, v_state, sV, seqlen.seqlen_k - n * self.tile_n, tidx)
        kv_state.advance()
        return kv_state, v_state

    # Note [Tiles overlapped]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # Between two tiles of a persistent CTA the tensor cores used to idle: after a tile's last P V its
    # consumers normalized O, staged it in sO, stored it by TMA (two barriers over both warpgroups),
    # and only then issued the next tile's first Q K^T, whose softmax comes before any further GEMM.
    # ``tools/tile_cost.py`` fits an SM's time per tile at 2.5-2.9 us beside 1.6 us per K block
    # (H100, d64 / d128 without a mask; flash-attn-4: 3.7-4.1 us, through its own interface). With
    # ``overlap_tiles`` the consumers read the next tile's index right after issuing the last P V
    # (:meth:`claim_next`), issue the next tile's first Q K^T behind it, wait for the P V only
    # (``wait_group(1)``), run the epilogue while the Q K^T runs, then complete it; the next tile
    # starts at its first softmax.
    # - Q has two stages, so the next tile's Q is loaded while this one runs (with one, the wait for
    #   it moved before the epilogue: the fitted tile cost rose from 2.7 to 3.6 us).
    # - ptxas serializes every wgmma of the kernel when that Q K^T is issued under a runtime branch
    #   (no next tile, or one without a K block), so it is issued either way: without a next tile
    #   with work it reads whatever the stages hold and is waited for at once (``wait_group(0)``) and
    #   discarded, the next tile issuing its own (``first_qk``'s ``issued``): here only the pipeline
    #   waits are branched. (A branched issue at the tile's start, where ``wait_group(0)`` follows at
    #   once, keeps them asynchronous.)
    # - sO must be apart from sQ (not ``o_in_q``), Q loaded by TMA, and the tile's first Q K^T outside
    #   the ping-pong turns (``pp_steps_only``): ``FwdSm90Config.overlap_tiles_blockers``.
    # - On the dynamic grid the consumers now wait for the producer's claim before the epilogue,
    #   which it used to hide: causal rows measured 1-5% slower.
    # - Measured (RESULTS v0.53, H100): rows without a mask from s_k 4096 within 1% at d128, -5% at
    #   d96, -1 to +3.5% at d64 (five rounds); the fitted cost of a tile did not fall (a fit that timed
    #   the variant by a slower host path). An option (``OVERLAP_TILES``), off by default.
    # Every tile computes the same arithmetic in the same order: the bits are those of the kernel
    # without it (tests/test_fwd_sm90_gpu.py::test_overlap_tiles_matches / _varlen).

    @cute.jit
    def first_qk(self, c: SimpleNamespace, kv_state, wg: Int32, issued) -> None:
        """A tile's first ``S = Q K^T`` (its last K block), alone, waited for; ``issued``: it was
        issued (and completed) under the last tile's epilogue (Note [Tiles overlapped])."""
        if not issued:
            self.issue_first_qk(c, c.tSrQ, None, None, kv_state, wg, True)
        warpgroup.wait_group(0)  # (every path: ptxas keeps the wgmmas asynchronous only so)

    @cute.jit
    def issue_first_qk(self, c: SimpleNamespace, tSrQ, pq, q_state, kv_state, wg: Int32, landed) -> None:
        """Issue a tile's first ``S = Q K^T``; ``landed``: once its K block (and, with ``pq``, its Q)
        landed, else at once, on whatever the stages hold (Note [Tiles overlapped])."""
        self.wait_first(pq, q_state, c.pk, kv_state, landed)
        self.pp_sync(wg, edge=True)
        gemm_sm90(self.tiled_mma_qk, c.acc_S, tSrQ, c.tSrK[None, None, None, kv_state.index], zero_init=True)
        self.pp_arrive(wg, edge=True)

    @cute.jit
    def wait_first(self, pq, q_state, pk, kv_state, landed) -> None:
        """Wait for a tile's first K block (and, with ``pq``, its Q), where ``landed``."""
        if landed:
            if const_expr(pq is not None):
                pq.consumer_wait(q_state)
            pk.consumer_wait(kv_state)

    @cute.jit
    def next_tile(self, sched, idx: Int32, t_state):
        """The consumers' next tile index (:meth:`fa4.sched.tile.TileScheduler.next_consumer`)."""
        nxt, t_state = sched.next_consumer(idx, t_state)
        return nxt, t_state

    @cute.jit
    def claim_next(self, sched, tile_info, idx: Int32, t_state):
        """The next tile's index, and whether it has a K block to start (Note [Tiles overlapped])."""
        nxt, t_state = sched.next_consumer(idx, t_state)
        work = cutlass.Boolean(False)
        if sched.valid(nxt):  # (tile_info past the last tile would read past cu_seqlens)
            *_, n_min, n_max, active = tile_info(nxt)
            if active and n_min < n_max:  # (the producer's test of a tile with loads)
                work = cutlass.Boolean(True)
        return nxt, t_state, work

    @cute.jit
    def issue_qk_pv(self, c: SimpleNamespace, kv_state, v_state, wg: Int32) -> None:
        """``S = Q K^T`` of this block, then the previous block's ``O += P V`` behind it: the issue
        half of :meth:`step` and of the folded step's later blocks."""
        c.pk.consumer_wait(kv_state)
        self.pp_sync(wg)
        gemm_sm90(self.tiled_mma_qk, c.acc_S, c.tSrQ, c.tSrK[None, None, None, kv_state.index], zero_init=True)
        if const_expr(self.cfg.rescale_o_before_pv):
            rescale_rows(make_acc_mn_view(c.acc_O), c.row_scale)  # under the Q K^T just issued
        c.pv.consumer_wait(v_state)
        gemm_sm90(self.tiled_mma_pv, c.acc_O, c.tOrP, c.tOrVt[None, None, None, v_state.index])
        self.pp_arrive(wg)

    @cute.jit
    def release_v(self, c: SimpleNamespace, v_state) -> None:
        """Free the V stage of :meth:`issue_qk_pv`'s ``P V`` once it completed."""
        c.pv.consumer_release(v_state)

    @cute.jit
    def clear_v_tail(self, pv, v_state, sV, rows_used: Int32, tidx: Int32) -> None:
        """Zero the V rows past ``seqused_k`` of the tile's first V block (the only one with such
        rows) before any ``P V`` reads it: TMA loaded them from the KV cache's unused slots, which
        may hold NaN (``P = 0`` there, but ``0 * NaN`` is NaN). Every consumer thread takes part;
        outside the ping-pong brackets, so the barrier cannot interleave with them."""
        if rows_used < self.tile_n:
            pv.consumer_wait(v_state)
            zero_rows_from(sV[None, None, v_state.index], rows_used, tidx, self.num_consumer_threads)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_BAR_VTAIL, number_of_threads=self.num_consumer_threads)

    @cute.jit
    def scores(self, acc_S, mask: AttentionMask, thr_mma_qk, m_block: Int32, n: Int32, prescale,
               mask_seqlen: cutlass.Constexpr[bool], mask_window: cutlass.Constexpr[bool], window_if=None,
               umod: Optional[UserMods] = None, mask_mode=None) -> None:
        """Raw ``Q K^T`` of block ``n`` -> softcapped (or ``score_mod``-ed), masked scores (in place).
        ``window_if``: a runtime Boolean, the window mask applied only where it is true (one step
        body for every block, ``one_step_loop``). ``umod``: the tile's user functions
        (:mod:`fa4.mods`), applied before the causal / window / length mask, on every block;
        ``mask_mode``: a block-sparse call's runtime :class:`BlockSkip` mode of the block (which mask
        function runs, if any; ``cfg.block_skip``)."""
        if const_expr(self.cfg.has_softcap):
            apply_softcap(acc_S, prescale)
        if const_expr(umod is not None):
            umod.apply(acc_S, thr_mma_qk, m_block, n, prescale, mask_mode, clamp_keys=mask_seqlen)
        mask.apply_block(acc_S, thr_mma_qk, m_block, n, mask_seqlen, mask_window, window_if)

    @cute.jit
    def step_if_visible(self, skip: BlockSkip, step, n: Int32, carry, mask_window: cutlass.Constexpr[bool],
                        window_if=None):
        """``step`` (:meth:`step_carry`) where block ``n`` is visible (``cfg.block_skip``), with the mask
        function its state asks for (:meth:`BlockSkip.state`); else the carry."""
        visible, mode = skip.state(n)
        if visible:
            carry = step(n, carry, mask_window, window_if, mask_mode=mode)
        return carry

    def step_carry(self, c, softmax, mask, m_block, prescale, wg, n, carry, mask_window, window_if, umod=None,
                   mask_mode=None):
        """:meth:`step` in the form :func:`fa4.mask.walk_blocks` drives: the carry is the stage states."""
        kv_state, v_state = carry
        return self.step(c, softmax, mask, m_block, prescale, wg, n, kv_state, v_state, mask_window, window_if, umod,
                         mask_mode)

    @cute.jit
    def step(self, c: SimpleNamespace, softmax: OnlineSoftmax, mask: AttentionMask, m_block: Int32, prescale,
             wg: Int32, n: Int32, kv_state, v_state, mask_window: cutlass.Constexpr[bool], window_if=None,
             umod: Optional[UserMods] = None, mask_mode=None):
        """One K block ``n`` after the first (Note [intra-warpgroup overlap]): ``S = Q K[n]^T`` and
        the previous block's ``O += P V`` in flight together; returns the advanced stage states."""
        self.issue_qk_pv(c, kv_state, v_state, wg)
        warpgroup.wait_group(1)
        if const_expr(window_if is None):
            c.pk.consumer_release(kv_state)
        self.scores(c.acc_S, mask, c.thr_mma_qk, m_block, n, prescale, False, mask_window, window_if, umod, mask_mode)
        if const_expr(window_if is not None):
            c.pk.consumer_release(kv_state)  # Note [K's release after the mask]
        row_scale, do_rescale = softmax.update(c.acc_S)
        warpgroup.wait_group(0)
        c.pv.consumer_release(v_state)
        if const_expr(self.cfg.rescale_o_before_pv):
            # Applied before the next P V (rows that keep their max have scale 1 exactly).
            c.row_scale.store(row_scale.load())
        else:
            softmax.rescale_O(c.acc_O, row_scale, do_rescale)
        softmax.convert_P(c.acc_S, c.rP)
        kv_state.advance()
        v_state.advance()
        return kv_state, v_state

    # Note [K's release after the mask]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # The consumers free K's stage once S is complete (``wait_group(1)``). With separate loops they
    # release it before the mask and ptxas sinks the arrive below the row max anyway. With
    # ``one_step_loop`` an arrive there stays above the mask's runtime branch, and the block after
    # the branch then started with the wait for the previous P V (``wait_group(0)``) ahead of the
    # row max, which the separate loops overlap with that P V (v0.35's SASS, d64 / d128 / d192 /
    # d256 causal). Released after the mask, the one body schedules as the separate loops do: the
    # wait lands after the row max (tests/test_compile.py::test_one_step_row_max_overlaps_pv).
    # Only the one-body form and the folded right-edge loop (``first_or_masked_step``, Note [The first
    # block in the masked loop]) move their release; the other separate loops' code is as before. Measured:
    # the H100 had one_step_loop 1.4-4.5% slower than the separate loops before this (d64 / d128 /
    # d256 causal), the H200 1.2% slower on average after (another GPU: no clean before / after).

    # Note [Warpgroup stores]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # O goes through sO and one TMA store of the whole tile, so the epilogue syncs every consumer
    # thread twice (before sO is written: the last store has read it; before the store: sO is
    # written), which puts the warpgroups, free-running or taking turns otherwise, in step at every
    # tile: their epilogues, and then their first Q K^T and softmax, fall together and leave the
    # tensor cores idle. With ``wg_store_o`` each warpgroup stages its own 64 rows of sO, syncs its
    # own 128 threads (barrier ``_BAR_EPI_WG + wg``) and its first warp stores those rows by TMA
    # (a box of 64 rows, the same swizzle: its rows start on a 1024-byte boundary) and waits for its
    # own previous store before the next tile writes them. Not with packed rows (a box of positions
    # across heads), row stores (varlen, seqused Q, split-KV) or sO in sQ's memory, whose release
    # of Q counts one storing warp. The bits are those of the kernel without it
    # (tests/test_fwd_sm90_gpu.py::test_wg_store_o_matches). The default for the d64 tile's three
    # warpgroups since v0.54 (+1-2%, ``WG_STORE_O_BUCKETS``) and for d128 causal tiles under 8192 keys
    # since v0.56 (+0.6-3.2% at s1k / s4k, ``WG_STORE_O_CAUSAL_BUCKETS``); elsewhere at d128 it moved
    # by up to 3.2% both ways.

    # Note [O staged by stmatrix]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # O's 16-bit fragments go to sO by ``stmatrix`` (four 8x8 matrices a lane, one 16-byte row address
    # each), where 32-bit stores took one swizzled address per element pair (16 stores at d64, 32 at
    # d128, 64 at d256). Those addresses depend only on the thread and sO, so LLVM hoists them out of
    # the persistent tile loop and they stay live through every K block (16 registers in the d64 SASS).
    # ncu of the d64 forward beside flash-attn-4's (RESULTS v0.57, H200): the same math instruction
    # counts, 4% more stall samples, all at MUFU (wait and MIO); in the SASS, with 16 addresses held,
    # ptxas ran short of registers in the row max, waited for the previous P V before the second row's
    # max (flash-attn-4: after both maxes and a dozen exponentials) and packed the exponentials back to
    # back. With ``stmatrix`` four addresses stay (and 12 / 24 / 48 fewer store instructions in the d64
    # / d128 / d256 epilogue). Compiled with the device's toolchain (the DSL's cu13 flavor), the d64
    # causal masked loop then holds both rows' maxes (68 FMNMX) ahead of that wait, against none; d256
    # causal 44 against 26; the d64 free loop 34 against 31; d128 unchanged
    # (tests/test_compile.py::test_o_staged_by_stmatrix). On an H100 its output is bit-equal to the
    # 32-bit stores' (tests/test_fwd_sm90_gpu.py::test_stmatrix_o_matches, 72 cases) and the d256
    # causal rows gain 0-2%, d64 reads both ways and d128 -1% (RESULTS v0.58): the default where
    # head_dim_v >= :data:`STMATRIX_O_MIN_DV`.

    @cute.jit
    def epilogue(self, acc_O, lse, mO, mLSE, sO, tma_o, seqlen: SeqlenInfo, rows: TileRows, slot: Int32,
                 m_block: Int32, head: Int32, batch: Int32, thr_mma_pv, tidx: Int32) -> None:
        """O (normalized) -> 16 bits -> sO -> TMA store (or row stores for varlen / seqused Q and
        packed rows copied by rows); LSE from registers. Split-KV: the float32 O and the LSE of the split go to their
        slot of the partials straight from registers. With ``o_in_q`` the storing warp waits until
        the store has read sO, then the caller releases Q. ``slot``: the batch index of the O / LSE
        tensors (:func:`fa4.pack_gqa.partial_slot`)."""
        cfg = self.cfg
        if const_expr(cfg.has_lse):
            store_lse_rows(lse, thr_mma_pv, mLSE, rows, seqlen, slot, self.tile_hdimv)
        if const_expr(self.split):
            store_acc_rows(acc_O, thr_mma_pv, mO, rows, seqlen, slot, cfg.head_dim_v, self.tile_hdimv)
        else:
            self.store_O(acc_O, mO, sO, tma_o, seqlen, rows, m_block, head, batch, tidx)

    @cute.jit
    def store_O(self, acc_O, mO, sO, tma_o, seqlen: SeqlenInfo, rows: TileRows, m_block: Int32, head: Int32,
                batch: Int32, tidx: Int32) -> None:
        """The 16-bit O tile through sO: TMA store, or row stores (varlen / seqused Q, packed rows copied by rows).
        With ``wg_store_o`` each warpgroup stages and stores its own 64 rows (Note [Warpgroup stores])."""
        store_warp = self.is_store_warp()
        bar, bar_threads = _BAR_EPI, self.num_consumer_threads
        if const_expr(self.wg_store):
            wg = cute.arch.make_warp_uniform(tidx // 128)
            bar, bar_threads = _BAR_EPI_WG + wg, 128
        rO = cute.make_rmem_tensor_like(acc_O, self.dtype)
        convert_f32_to_half(acc_O, rO)
        if const_expr(self.tma_o):
            if store_warp:
                cute.arch.cp_async_bulk_wait_group(0, read=True)  # the last store has read sO
        # Every consumer is done with sO (last store's reads) and, with o_in_q, with sQ.
        cute.arch.barrier(barrier_id=bar, number_of_threads=bar_threads)
        if const_expr(self.cfg.stmatrix_o):  # Note [O staged by stmatrix]
            atom = stmatrix_atom(self.dtype)
        else:
            atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=32)
        r2s = cute.make_tiled_copy_C(atom, self.tiled_mma_pv).get_slice(tidx)
        cute.copy(r2s, r2s.retile(rO), r2s.partition_D(sO))
        if const_expr(self.tma_o):
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=bar, number_of_threads=bar_threads)
            if store_warp:
                gO = self.q_tile(mO, seqlen, batch, head, m_block, self.tile_hdimv)
                sO_box = self.rows_box(sO, self.tile_hdimv)
                if const_expr(self.wg_store):  # this warpgroup's 64 rows
                    gO = cute.local_tile(gO, (64, self.tile_hdimv), (wg, 0))
                    sO_box = cute.local_tile(sO, (64, self.tile_hdimv), (wg, 0))
                tOsO, tOgO = cpasync.tma_partition(tma_o, 0, cute.make_layout(1), cute.group_modes(sO_box, 0, 2),
                                                   cute.group_modes(gO, 0, 2))
                cute.copy(tma_o, tOsO, tOgO)
                cute.arch.cp_async_bulk_commit_group()
                if const_expr(self.o_in_q):
                    cute.arch.cp_async_bulk_wait_group(0, read=True)
        else:
            cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=self.num_consumer_threads)
            if const_expr(self.pack):
                store_rows(sO, mO, rows, seqlen, batch_slot(batch, self.cfg.varlen_q), self.cfg.head_dim_v, tidx,
                           self.num_consumer_threads)
            else:
                gO = cute.local_tile(seqlen.q_view(mO, batch, head), (self.tile_m, self.tile_hdimv), (m_block, 0))
                store_rows_16B(sO, gO, rows.rows_left(), self.cfg.head_dim_v, tidx, self.num_consumer_threads)
            if const_expr(self.o_in_q):
                if const_expr(self.tma_q):
                    # The next tile's Q lands in this memory by TMA (the async proxy): this tile's
                    # generic writes and reads of sO are ordered before it by a proxy fence, then
                    # the barrier, then the storing warp's release of the Q stage.
                    cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.barrier(barrier_id=_BAR_EPI, number_of_threads=self.num_consumer_threads)


# --------------------------------------------------------------------------------------------
# Tuning table, variants, launcher
# --------------------------------------------------------------------------------------------

# Per head-dim bucket: (tile_m, tile_n, num_stages, pingpong), measured on the H200 (docs/RESULTS.md,
# sm90 sweeps): d64 with three consumer warpgroups (192-row tiles) +10% over 128 rows, which take
# turns around their K-block steps (ping-pong with ``pp_steps_only``, v0.12, three interleaved rounds:
# 521.7 -> 527.0 TFLOP/s, causal 471.9 -> 486.6; with the turns around the tile's edges too it was
# 516.6 -> 484.6 and 462.3 -> 473.3 in v0.10); ping-pong measured 0-6% slower than letting the two
# warpgroups run free with intra-warpgroup overlap at d128, -1.5% to +5% in v0.12 and -2% to +0.5% in
# v0.13 (it stays an option; d256: +0.3% to +0.8%, inside the rounds' ranges); d256 128 x 80 is what
# fits 227 KB with two K/V stages.
TUNING = {
    64: (192, 128, 2, True),
    96: (128, 128, 2, False),
    128: (128, 128, 2, False),
    192: (128, 112, 2, False),
    256: (128, 80, 2, False),
}
# O rescaled under the next Q K^T (rescale_o_before_pv) for head_dim_v > 128: measured +3% / +6%
# (d256 non-causal / causal); at d128 -10% to +3% (not taken).
RESCALE_O_BEFORE_PV_MIN_DV = 129
# O staged by stmatrix (Note [O staged by stmatrix]) for head_dim_v >= 256: on an H100 (v0.58) d256
# causal +2.0% / +1.5% / +0.2% (s8k / s4k / s16k), d256 s8k without a mask -0.2%; d64 -4.7% to +2.4%
# (s4k to s16k, wide spreads) and d128 -1%, so those keep the 32-bit stores.
STMATRIX_O_MIN_DV = 256
PP_STEPS_ONLY_WG3 = True  # three warpgroups' turns bracket the K-block steps only (TUNING comment)
DEFAULT_EXP2_EMU_FRAC = 0.0  # measured: 0.1 / 0.25 are 0-14% slower on the sm90 path
# The classic rule: a rescale threshold of 8 measured up to 1.4x the output error of tau = 0 on
# inputs whose row maxes creep (docs/RESULTS.md). A threshold > 0 is still available; it then
# normalizes by the rounded P (Note [Normalizing by the rounded P]).
DEFAULT_RESCALE_THRESHOLD = 0.0
SUM_ROUNDED_WITH_THRESHOLD = True  # tools/rescale_accuracy.py turns it off to measure the difference
# The grid and tile order, measured (docs/RESULTS.md v0.8, sm90 sweeps). Non-causal rows and short
# masked rows: the static persistent grid (snake order) with L2 sections of one (head, batch) pair
# (m-blocks fastest, so the CTAs resident at once read the K/V of one or two heads, each block once
# from DRAM): +3-10% over v0.3's choice. Masked rows with s_k > 1024: the dynamic persistent grid
# (tiles claimed from a counter in the tile order, LPT for masked rows) with 8 MB sections, +3-6%
# over one tile per CTA (medians of three) except at s16k (-3%, within that row's noise). One tile
# per CTA (``persistent=False``) stays an option.
# v0.16: masked rows take 16 MB sections (Note [Section sizes] in fa4/sched/tile.py: at d256 s8k
# 8 MB is one pair, half a wave of tiles, and the LPT tail left 11% of the SM cycles idle; sweep,
# three rounds, 8 -> 16 / 32 / 64 MB: d256 642.1 -> 677.1 / 672.3 / 662.8, d128 s4k 573.9 -> 592.3
# / 586.3 / 564.6, s8k 638.1 -> 623.0 / 616.8 / 580.7, s16k 641.7 -> 651.9 / 643.3 / 633.5, d64
# 483.2 -> 485.5 / 487.7 / 474.6); rows without a mask at head dims > 128 take the dynamic grid
# too, with one-pair sections (d256 s8k, three leases: +2-5% over the static snake).
# v0.27: so do ragged rows without a mask (varlen, seqused) with s_k > 1024: the static snake hands a
# CTA tiles of sequences of different lengths, and tiles past a shorter sequence's end are empty
# slots in its walk; the claims balance them (`python -m fa4.bench --offgrid`, varlen d128, 8 sequences of
# 293-3774: static 571.8, dynamic 607.4, flash-attn-4 579.9 / 585.2; three interleaved rounds
# static / dynamic: 571.2 / 612.6, 565.5 / 584.3, 570.8 / 563.0).
# v0.28: masked varlen rows keep the masked rows' 16 MB sections. v0.27 gave them one-pair sections
# on one lease's reading (varlen GQA 32/8 d128 causal 504 -> 549); three interleaved rounds did not
# confirm it (medians, TFLOP/s, default one pair / 16 MB / 32 MB: varlen MHA d128 causal 499.7 /
# 507.2 / 497.8, GQA 498.2 / 513.7 / 491.7, d64 causal 399.0 / 409.0 / 404.3; rounds spread 3-6%),
# so the one-rule grid stays.
# v0.28: decode tiles (the 64-row tile of a short packed q) take 64-row K blocks and one CTA per
# tile (``persistent=False``, several CTAs per SM): tools/decode_sweep.py --grid, three rounds, the
# same every round to 1 us: b64 s_k 8k 483.8 -> 479.4 us, b8 s_k 32k 253.2 -> 249.1 us (the
# persistent grid alone -0.5%, the 64-row blocks alone -0.3% / -1.6%; flash-attn-4 482.6 / 349).
# Calls with seqused_k or a page table keep the table's K blocks: with 16-row pages the 64-row
# blocks measured 501.5-503.3 / 259.9-260.0 us against 488.4-488.8 / 259.5-260.8 (three rounds),
# and test_paged_kv checks a paged call's bits against the unpaged call with seqused_k.
# v0.29 (not yet timed in this form): they take one CTA per tile too; the paged cache with the
# table's blocks and one CTA per tile measured 488.7-488.8 / 256.9-257.1 us in the same rounds (the
# 128-row column of decode_sweep --grid), and a contiguous one 480.6-481.3 / 253.2-253.3 against the
# prefill grid's 483.8-484.5 / 253.2-253.5.
DYNAMIC_MIN_SEQLEN_K_MASKED = 1025
DYNAMIC_UNMASKED_MIN_HD = 129
L2_SECTION_MB_STATIC = 0  # one pair per section
L2_SECTION_MB_DYNAMIC = 16
DECODE_TILE_N = 64
DECODE_GRID = True  # tools/decode_sweep.py --grid turns it off to time the prefill tiles' grid
# v0.56: split-KV calls may let their combine launch early (Note [Combine launched early] in
# fa4/combine.py): its tests passed, and it saved 0.5 us of a 359 / 376 us decode call (b8 s_k 32k,
# contiguous / paged, five rounds, H100); the default since v0.58, after the split-KV and kvcache GPU
# files passed with it on (364 tests, H100).
SPLIT_PDL = True
# v0.38: a varlen call without max_seqlen_q (fa4 holds the packed token count: sched.tile.shape_bound)
# takes the compact varlen grid, one CTA per tile, whose size does not depend on it, with its tile,
# packing and split count judged on the average lengths (loose_plan). Measured (v0.38, H100,
# tools/device_run.sh next30e, two rounds, ms, default grids / compact grid / flash-attn-4; with the
# lengths, default): decode b64 s_k 8k GQA 32 / 8 1.26-1.32 / 0.684 (packed, as with the lengths) /
# 0.69 (0.684); varlen GQA 32 / 8 d128 causal 0.82-0.88 / 0.72-0.75 / 0.69-0.78; varlen d128
# 0.70-0.71 / 0.68-0.71 / 0.65 (0.65).
COMPACT_WITHOUT_LENGTHS = True
# v0.29's wider rule, off (not timed): any loose bound (fa4.sched.tile.loose_bound: also a given
# max_seqlen_q over LOOSE_BOUND_RATIO x the average, one long sequence among short ones).
COMPACT_LOOSE_BOUND = False
# v0.36: causal and local calls at d192 (the 192 bucket, head_dim_v == head_dim) run the K blocks
# after a tile's first through one step body (``one_step_loop``; Note [K's release after the mask]).
# On the H100 (RESULTS v0.36) it runs as fast as the separate loops: four sweeps of d192 causal s4k /
# s8k read +4.8 / +0.4%, -2.2 / +1.2%, -0.2 / -0.0% (5, 5 and 7 rounds) and v0.35's +1.1 / +0.8%,
# a window (1024, 0) +1.4% / +0.4%; and it compiles 1.1-2.4 s faster there (causal 3.69 -> 2.62 s,
# local 4.87 -> 2.52 s). The other buckets keep the separate loops, which are faster there: d64
# -0.7 / -2.7%, d128 +0.8 / -2.5%, d256 -2.9 / -1.6%, local d256 -1.9%.
ONE_STEP_LOOP_BUCKETS = frozenset({192})
# Local tiles: d256 too since v0.56, for the compile bar. Against the separate loops (edges first,
# since v0.45) one step body read +2.5% and +1.1% (three and five rounds, window (1024, 0) s8k, H100,
# v0.45; v0.35's -1.9% was before the edges-first order) and -0.7% / -1.6% (three and five rounds,
# H100, v0.56): within the rows' lease-to-lease spread; it compiles in 2.53 s against 4.42 on the H100
# host (v0.56). Its GPU tests (tests/test_one_step_loop_gpu.py::test_head_dim_256_windows and the window
# cases of the forward files) passed in v0.56. Local d128 keeps the separate loops: one step body read
# -1.2 / -1.7 / -4.6% there (v0.45), for 3.02 -> 1.86 s.
ONE_STEP_LOOP_LOCAL_BUCKETS = frozenset({192, 256})


def _one_step(head_dim: int, head_dim_v: int, causal: bool, local: bool) -> bool:
    """Whether a causal or local tile walks its K blocks through one step body (the rules above)."""
    if head_dim != head_dim_v:
        return False
    return _bucket(head_dim) in (ONE_STEP_LOOP_LOCAL_BUCKETS if local else ONE_STEP_LOOP_BUCKETS if causal else ())


# v0.44: a causal tile's first K block runs in the loop over the blocks at the diagonal, under a
# runtime ``is_first`` (``fold_first``, Note [The first block in the masked loop]): one copy of the
# masked step instead of two, 17-26% less cold compile time (H100 host, interleaved medians: d64
# causal 1.75 -> 1.40 s, d128 2.46 -> 1.81 s), the same bits, and the same speed (H100, nine rounds,
# s8k causal: d64 +0.1%, d128 +0.8%, d256 0.0%; five rounds of s4k / s8k -2.2% to +2.4%, inside the
# rows' spread). Not where one step body serves every block (d192) or the first block keeps its own
# code (block skipping, user functions: :func:`fa4.fwd.common.folds_first`).
# v0.45: with the first Q K^T before the walk (d128 causal s8k against v0.44's fold, three rounds
# of three, H100: the same within 1%) and a local tile's edges walked first (Note [Edges first] in
# fa4/mask.py: one masked step for both edges), local tiles fold at d64 only: window (1024, 0) s8k,
# H100, three / five rounds: d64 +3.1% / +1.8%, d128 -2.5% / -4.6%, d256 -1.1% / -1.6% (the local
# compile on the H100 host: d64 2.23 -> 1.42 s, d128 2.83 -> 1.96, d256 4.20 -> 3.11).
FOLD_FIRST_CAUSAL = True
FOLD_FIRST_LOCAL_BUCKETS = (64,)


def _fold_first(causal: bool, local: bool, head_dim: int, one_step: bool, user_mods: bool, block_skip) -> bool:
    """Whether a tile's first K block runs in the masked loop (the rule above)."""
    windowed = causal or (local and _bucket(head_dim) in FOLD_FIRST_LOCAL_BUCKETS)
    return fwd_common.fold_first_rule(FOLD_FIRST_CAUSAL, windowed, one_step, user_mods, block_skip)


# v0.49: dense non-causal d128 tiles from s_k 8192 share K / V in clusters of two by TMA multicast
# (Note [K/V multicast]), on the plain grid. Five interleaved rounds against the persistent grid
# without it: H200 s8k +3.0%, s16k +4.7%; H100 s1k -17.7%, s4k -1.1%, s8k 0.0%, s16k +1.6%. ncu
# at the base clock (H200, s16k): the same cycles, 42% fewer L2 sectors read, so the gain is clock
# at the power cap, and grows with the K / V each tile reads. d64 s8k -4.0% and d256 s8k -1.4%
# (H200) keep theirs.
# v0.50: on the persistent grid (the pairs' snake, :class:`fa4.sched.tile.ClusterPairScheduler`),
# from s_k 4096. Two sweeps of 5 and 9 interleaved rounds on an H100: s4k -0.6% / +2.8% against the
# persistent grid without it, s8k +3.4% / +2-5% and s16k +1.5% / +0-3% over the plain grid with it;
# s1k within 1% of the persistent grid (not taken: no gain). Two columns of one config read up to 3%
# apart in those sweeps (RESULTS v0.50).
# (head_dim, head_dim_v) as measured: d100-120 share the 128 bucket's table, not this measurement.
KV_MCAST_HEAD_DIMS = frozenset({(128, 128)})
KV_MCAST_MIN_SEQLEN_K = 4096
# v0.53: rows without a mask with packed GQA (whole positions a tile: the pair's two tiles hold rows of
# one kv head) take it too, on the persistent grid. H100, gqa-d128-s4k (32 / 8 heads, g = 4), median
# TFLOP/s, default -> multicast on the static persistent grid: 646.1 -> 668.7 (three rounds), 624.8 ->
# 649.1 (five; flash-attn-4 640.1). Causal GQA rows are left out: gqa-d128-s4k-causal +2.9% in five
# rounds (the dynamic grid; the static one -0.9%), mqa-d128-s8k-causal +0.7% (noise), and the MHA
# causal rows' own s4k measurement was mixed. Not on the plain grid (not measured with GQA); g = 8
# (16 positions a tile) rides on g = 4's measurement.
KV_MCAST_GQA = True
# The persistent grid launches num_sms / 2 clusters and counts on all of them being resident at once:
# a cluster that waits for a free pair of SMs in one GPC runs after the others, a tail as long as the
# kernel. That held where it was measured, GPUs of 132 SMs (H100 SXM, H200: the gains above), which take
# it. v0.51: on other SM counts the driver says how many are (fa4.arch.resident_clusters,
# cuOccupancyMaxActiveClusters for CTAs of an SM's whole shared memory; asked only there), and where all
# num_sms // 2 are, the persistent grid too. Elsewhere, or where the driver cannot be asked, multicast
# keeps v0.49's plain grid (one pair per cluster, scheduled as pairs of SMs free up) and its threshold.
KV_MCAST_PERSISTENT_SMS = frozenset({132})
KV_MCAST_PLAIN_MIN_SEQLEN_K = 8192
# v0.52: causal pairs (the union of their ranges; pair claims on the dynamic grid, Note [Pair claims] in
# fa4/sched/tile.py), on the persistent grids only (where all the clusters are resident, as above),
# keeping the dynamic grid. Interleaved sweeps on an H100 (medians; off -> on): d128 s8k +3.4% / +1.0%
# / +3.9% (5, 5 and 15 rounds), s16k +4.7% / +2.3%, s4k +2.5% / -0.7% / -0.6% (not taken); d64 s8k
# -3.8% and d256 s8k -1.7% (3 rounds) keep theirs (RESULTS v0.52).
KV_MCAST_CAUSAL_HEAD_DIMS: frozenset = frozenset({(128, 128)})
KV_MCAST_CAUSAL_MIN_SEQLEN_K = 8192


def _kv_mcast(cfg: FwdSm90Config, seqlen_k: int, num_sms: int, resident: Callable[[], Optional[int]]
              ) -> Optional[str]:
    """The grid on which the rule above gives ``cfg`` (on the persistent grid: not a decode or compact
    one) at ``seqlen_k`` keys K / V multicast on a GPU of ``num_sms`` SMs; ``resident()``: how many
    clusters of two it holds at once (None: unknown), asked only off ``KV_MCAST_PERSISTENT_SMS``.
    ``"persistent"``, ``"plain"`` (where not all the persistent grid's clusters are known to be
    resident), or None. Causal rows: ``KV_MCAST_CAUSAL_HEAD_DIMS`` from ``KV_MCAST_CAUSAL_MIN_SEQLEN_K``,
    on the persistent grids only; packed GQA rows (``KV_MCAST_GQA``, whole positions a tile): without a
    mask, on the persistent grid only."""
    dims = (cfg.head_dim, cfg.head_dim_v)
    g = cfg.qhead_per_kvhead
    gqa = KV_MCAST_GQA and not cfg.causal and cfg.pack_tma_takes and cfg.tile_m % g == 0
    if not (dims in (KV_MCAST_CAUSAL_HEAD_DIMS if cfg.causal else KV_MCAST_HEAD_DIMS) and cfg.persistent
            and not cfg.kv_mcast_blockers() and (g == 1 or gqa)):  # (causal GQA: not taken, v0.53)
        return None
    if num_sms in KV_MCAST_PERSISTENT_SMS or (resident() or 0) >= max(num_sms // 2, 1):
        least = KV_MCAST_CAUSAL_MIN_SEQLEN_K if cfg.causal else KV_MCAST_MIN_SEQLEN_K
        return "persistent" if seqlen_k >= least else None
    # (causal rows keep their dynamic grid: a plain grid of pairs would give up its balance; GQA rows:
    # not measured there)
    return "plain" if seqlen_k >= KV_MCAST_PLAIN_MIN_SEQLEN_K and not cfg.causal and g == 1 else None


# The next tile's first Q K^T under this tile's epilogue, Q in two stages (``overlap_tiles``, Note [Tiles
# overlapped]), v0.53, H100. Three interleaved rounds (off -> on): without a mask d64 s8k 522.5 -> 528.6,
# d128 s4k 633.3 -> 651.0, s8k 648.1 -> 657.1, s1k 552.4 -> 540.2 (ranges overlapping); causal rows (the
# dynamic grid, whose claim the consumers now wait for before the epilogue) 0.8-5% slower. Five rounds
# of the rule below (rows without a mask on the static persistent grids from s_k 4096) did not confirm
# it: d64 s4k / s8k / s16k +3.5 / -0.7 / -1.3%, d96 -5.1 / -5.6 / -5.1%, d128 +0.2 / -0.5 / -0.2%. So
# it stays an option (``OVERLAP_TILES`` turns the rule on), off by default.
OVERLAP_TILES = False
OVERLAP_TILES_MIN_SEQLEN_K = 4096


def _overlap_tiles(cfg: FwdSm90Config, seqlen_k: int) -> bool:
    """Whether the rule above gives ``cfg`` (its grid decided) ``overlap_tiles``."""
    if not (OVERLAP_TILES and seqlen_k >= OVERLAP_TILES_MIN_SEQLEN_K and not (cfg.causal or cfg.local)
            and cfg.persistent and not cfg.dynamic_sched):
        return False
    on = replace(cfg, overlap_tiles=True)
    return not on.overlap_tiles_blockers() and on.smem_bytes() <= SMEM_CAPACITY


# Each consumer warpgroup stores its own 64 rows of O (``wg_store_o``, Note [Warpgroup stores]), v0.54,
# H100, the three warpgroups of the d64 tile (192 rows): medians off -> on, d64 s8k 512.2 -> 522.7 and
# 509.4 -> 517.7, causal 483.3 -> 492.5 and 474.4 -> 479.3 (five and seven interleaved rounds, two
# leases). At d128 (two warpgroups) the rows moved both ways by up to 3.2% between the two leases (s8k
# causal -1.4 / -1.0%, s4k causal +3.2 / +1.3%, s1k -1.5 / +3.0%): not taken there in v0.54.
WG_STORE_O_BUCKETS = frozenset({64})
# v0.56: d128 causal tiles under KV_MCAST_CAUSAL_MIN_SEQLEN_K (8192) keys that do not multicast K / V
# too. Those rows gained in every lease: s1k causal +0.6 / +0.7 / +1.3% (the last ten rounds), s4k
# causal +3.2 / +1.3%; the s8k causal row, which multicasts, lost (-1.4 / -1.0%) and keeps one store,
# as do longer causal rows that do not multicast (seqused_k, user functions, other SM counts: not timed).
WG_STORE_O_CAUSAL_BUCKETS = frozenset({128})


def _stmatrix_o(head_dim_v: int, split_kv: bool) -> bool:
    """Whether O is staged by stmatrix by default (:data:`STMATRIX_O_MIN_DV`); a split call writes
    its partial O from registers, so it never stages O."""
    return head_dim_v >= STMATRIX_O_MIN_DV and not split_kv


def _wg_store_o(cfg: FwdSm90Config, table_tile_m: int, seqlen_k: int) -> bool:
    """Whether the rules above give ``cfg`` ``wg_store_o``: its bucket (at d128 a causal tile of under
    ``KV_MCAST_CAUSAL_MIN_SEQLEN_K`` keys without multicast), the table's tile (not a decode
    tile of one warpgroup, nor a user's ``tile_m``), and nothing in
    :meth:`FwdSm90Config.wg_store_o_blockers` (packed rows, row stores, split-KV, ``o_in_q``)."""
    bucket = _bucket(max(cfg.head_dim, cfg.head_dim_v))
    causal = (cfg.causal and not cfg.kv_mcast and seqlen_k < KV_MCAST_CAUSAL_MIN_SEQLEN_K
              and bucket in WG_STORE_O_CAUSAL_BUCKETS)
    return ((bucket in WG_STORE_O_BUCKETS or causal) and cfg.tile_m == table_tile_m
            and not cfg.wg_store_o_blockers())


def _loose_q(problem: AttnProblem) -> bool:
    """Whether the rules above send ``problem`` to the compact grid."""
    if not problem.varlen_q:
        return False
    return ((COMPACT_WITHOUT_LENGTHS and shape_bound(problem.seqlen_q, problem.total_q, problem.batch))
            or (COMPACT_LOOSE_BOUND and loose_bound(problem.seqlen_q, problem.total_q, problem.batch)))


def _grid_order(problem: AttnProblem) -> dict:
    """``persistent``, ``dynamic_sched`` and ``l2_section_mb`` of the measured choice above."""
    long_k = problem.seqlen_k >= DYNAMIC_MIN_SEQLEN_K_MASKED
    if long_k and (problem.causal or problem.local):
        return dict(persistent=True, dynamic_sched=True, l2_section_mb=L2_SECTION_MB_DYNAMIC)
    wide = max(problem.head_dim, problem.head_dim_v) >= DYNAMIC_UNMASKED_MIN_HD
    ragged = problem.varlen_q or problem.varlen_k or problem.has_seqused_q or problem.has_seqused_k
    return dict(persistent=True, dynamic_sched=long_k and (wide or ragged), l2_section_mb=L2_SECTION_MB_STATIC)


def _turns(table_pingpong: bool, table_tile_m: int, tile_m: int) -> tuple[bool, bool]:
    """``(pingpong, pp_steps_only)`` of a tile: the table's ping-pong belongs to the table's tile (two
    or three warpgroups), not to a user's or a decode tile_m; three warpgroups take their turns
    around the K-block steps only (:data:`PP_STEPS_ONLY_WG3`)."""
    pingpong = table_pingpong and tile_m == table_tile_m
    return pingpong, pingpong and tile_m == 192 and PP_STEPS_ONLY_WG3


def _bucket(d: int) -> int:
    return fwd_common.bucket(TUNING, d, "sm90")


def make_config(problem: AttnProblem, options: Optional[KernelOptions], arch: str, need_lse: bool,
                num_sms: Optional[int] = None) -> FwdSm90Config:
    """The tuning table (by max(head_dim, head_dim_v)) with the user's options on top, pack GQA and
    split-KV as :func:`fa4.fwd.common.pack_gqa` / :func:`fa4.fwd.common.num_splits` decide them
    (``num_sms``: the GPU's, default the current one's); raises ValueError naming the option when a
    user choice cannot be compiled."""
    options = options or KernelOptions()
    table_tile_m, table_tile_n, stages, pingpong = TUNING[_bucket(max(problem.head_dim, problem.head_dim_v))]
    tile_n = table_tile_n
    # A varlen call without max_seqlen_q (COMPACT_WITHOUT_LENGTHS; any loose bound with
    # COMPACT_LOOSE_BOUND, off): the compact grid, which does not depend on it, and, where the call
    # gave no lengths, the tile, packing and split count judged on the average ones (loose_plan; Note
    # [Compact varlen grid]).
    loose = _loose_q(problem)
    averaged = loose_plan(problem)
    plan = averaged if loose else problem
    # Decode-like shapes: one consumer warpgroup, 64-row tiles, 64-row K blocks, one CTA per tile.
    # Groups that do not divide the tile are packed by default (boxes of tile_m // g positions) for a
    # ragged Q only: g = 7 varlen causal +2-7% (H100, H200), its dense s4k row -4% (one H100 round).
    g, tile_m, decode = fwd_common.rows_plan(plan, table_tile_m, options.tile_m,
                                             whole_rows_max_group=fwd_common.PACK_WHOLE_ROWS_MAX_GROUP,
                                             partial_boxes=plan.varlen_q or plan.has_seqused_q)
    decode = decode and DECODE_GRID
    # The 64-row K blocks not with seqused_k or a page table: a paged cache measured +3% time with
    # them, and paged and unpaged-with-seqused_k calls share a config, so their outputs share their bits.
    short_blocks = decode and not problem.page_size and not problem.has_seqused_k
    pingpong, pp_steps_only = _turns(pingpong, table_tile_m, tile_m)
    if options.tile_n is not None:
        tile_n = options.tile_n
    elif short_blocks:
        tile_n = min(tile_n, DECODE_TILE_N)
    grid = (dict(persistent=False, dynamic_sched=False, l2_section_mb=L2_SECTION_MB_STATIC) if decode
            else _grid_order(problem))
    if loose:
        grid = dict(persistent=False, dynamic_sched=False, l2_section_mb=L2_SECTION_MB_STATIC, compact_grid=True)
    # The split rule counts in the table's K blocks (FwdSm90Config.split_tile_n), which it was measured
    # with, on the average lengths of any side without max_seqlen whichever grid (as the launch's
    # fwd_common.compact_splits: a call without max_seqlen_k alone would otherwise split for the bound).
    splits = fwd_common.split_count(averaged, tile_m, table_tile_n, g, num_sms, compact=loose)
    tau = float(options.rescale_threshold) if options.rescale_threshold is not None else DEFAULT_RESCALE_THRESHOLD
    # (not with pack GQA, whose rows span several heads' table rows)
    skip = BlockSkip.table_fits(problem.block_table, tile_m, tile_n) if g == 1 else ()
    one_step = _one_step(problem.head_dim, problem.head_dim_v, problem.causal, problem.local)
    cfg = FwdSm90Config(
        arch=arch,
        dtype=problem.dtype,
        head_dim=problem.head_dim,
        head_dim_v=problem.head_dim_v,
        tile_m=tile_m,
        tile_n=tile_n,
        num_stages=options.num_stages if options.num_stages is not None else stages,
        pingpong=pingpong,
        pp_steps_only=pp_steps_only,
        rescale_o_before_pv=problem.head_dim_v >= RESCALE_O_BEFORE_PV_MIN_DV,
        stmatrix_o=_stmatrix_o(problem.head_dim_v, splits > 1),
        **grid,
        has_lse=need_lse or splits > 1,
        exp2_emu_frac=float(options.exp2_emu_frac) if options.exp2_emu_frac is not None else DEFAULT_EXP2_EMU_FRAC,
        rescale_threshold=tau,
        sum_rounded=tau > 0.0 and SUM_ROUNDED_WITH_THRESHOLD,
        qhead_per_kvhead=g,
        split_kv=splits > 1,
        pdl=splits > 1 and SPLIT_PDL,
        page_rows=page_rows(problem.page_size, tile_n),
        block_skip=skip,
        one_step_loop=one_step,
        fold_first=_fold_first(problem.causal, problem.local, max(problem.head_dim, problem.head_dim_v), one_step,
                               bool(problem.score_mod or problem.mask_mod), skip),
        **FwdSm90Config.fwd_flags(problem),
    )
    mcast_grid = _kv_mcast(cfg, problem.seqlen_k, num_sms if num_sms is not None else _num_sms(None),
                           lambda: _resident_pairs(None))
    if mcast_grid == "persistent":  # (causal pairs keep the dynamic grid: their claims, Note [Pair claims])
        cfg = replace(cfg, dynamic_sched=cfg.dynamic_sched and cfg.causal, kv_mcast=True)
    elif mcast_grid == "plain":
        cfg = replace(cfg, persistent=False, dynamic_sched=False, l2_section_mb=0, kv_mcast=True)
    if _overlap_tiles(cfg, problem.seqlen_k):
        cfg = replace(cfg, overlap_tiles=True)
    if _wg_store_o(cfg, table_tile_m, problem.seqlen_k):
        cfg = replace(cfg, wg_store_o=True)
    FlashFwdSm90.can_implement(cfg)
    if options.num_threads is not None and options.num_threads != cfg.num_threads:
        raise ValueError(f"KernelOptions.num_threads={options.num_threads}: the sm90 forward runs "
                         f"{cfg.num_threads} threads with tile_m {cfg.tile_m} (a producer warpgroup and one consumer "
                         f"warpgroup per 64 rows; "
                         f"choose the rows with tile_m, or leave num_threads unset)")
    return cfg


def page_rows(page_size: int, tile_n: int) -> int:
    """Rows per TMA box of a paged K/V block: ``gcd(page_size, tile_n)`` (0 when not paged)."""
    import math

    return math.gcd(page_size, tile_n) if page_size else 0


def paged_supported(page_size: int) -> bool:
    """Page sizes the TMA path loads: boxes of whole 8-row swizzle atoms, ``gcd(page_size,
    tile_n) % 8 == 0``, which for this family's tiles (``tile_n`` a multiple of 16) means a page
    size that is a multiple of 8. Others are gathered into a contiguous K/V first
    (:func:`fa4.ops.forward`, with a one-time warning)."""
    return page_size % 8 == 0


def variants(arch: str) -> list[FwdSm90Config]:
    """A covering set of compile variants for sm_90a (none for other archs): every head-dim bucket
    (64/96/128/192/256, an unpadded 72 and the (192, 128) pair), every flag value, both dtypes,
    1-3 consumer warpgroups, persistent (static or dynamic) or not, ping-pong, O rescaled before
    P V, the threshold with l of the rounded P, pack GQA (g = 4 to 7: TMA boxes of whole positions,
    partial boxes, row copies) and split-KV, alone and together."""
    if arch != "sm_90a":
        return []
    base = FwdSm90Config(arch=arch, dtype="bf16")

    def cfg(d, dv=None, **kw):
        tile_m, tile_n, stages, pingpong = TUNING[_bucket(max(d, dv or d))]
        pp, pp_steps = _turns(pingpong, tile_m, kw.get("tile_m", tile_m))  # as make_config
        osl = kw.get("one_step_loop", _one_step(d, dv or d, kw.get("causal", False), kw.get("local", False)))
        kw = {"tile_m": tile_m, "tile_n": tile_n, "num_stages": stages, "pingpong": pp, "pp_steps_only": pp_steps,
              "one_step_loop": osl,
              "fold_first": _fold_first(kw.get("causal", False), kw.get("local", False), max(d, dv or d), osl, False,
                                        ()),
              **kw}
        c = replace(base, head_dim=d, head_dim_v=dv or d, **kw)
        if "wg_store_o" not in kw and _wg_store_o(c, tile_m, 1024):  # (as make_config at 1024 keys)
            c = replace(c, wg_store_o=True)
        if "stmatrix_o" not in kw and _stmatrix_o(c.head_dim_v, c.split_kv):  # (as make_config)
            c = replace(c, stmatrix_o=True)
        if "pdl" not in kw and c.split_kv and SPLIT_PDL:  # (as make_config)
            c = replace(c, pdl=True)
        return c

    return [
        cfg(128),
        cfg(128, causal=True),
        cfg(128, causal=True, dynamic_sched=True),
        cfg(128, persistent=False, pingpong=True),
        cfg(128, persistent=False, dynamic_sched=False, kv_mcast=True),  # Note [K/V multicast]
        cfg(128, persistent=True, dynamic_sched=False, kv_mcast=True),  # (the pairs' persistent snake)
        # Note [Tiles overlapped] (an option): the rule's d128 / d64 / d96 configs without a mask, and the
        # dynamic grid (causal, and varlen with packed rows and skipped claims).
        cfg(128, persistent=True, dynamic_sched=False, kv_mcast=True, overlap_tiles=True),
        cfg(64, overlap_tiles=True),
        cfg(96, overlap_tiles=True),
        cfg(128, causal=True, dynamic_sched=True, overlap_tiles=True),
        # Note [Warpgroup stores] (the d64 default since v0.54): two and three warpgroups, and with overlapped tiles.
        cfg(128, wg_store_o=True),
        cfg(64, causal=True, wg_store_o=True),
        cfg(64, wg_store_o=False),  # (three warpgroups with one store of the tile, the d64 default before v0.54)
        cfg(128, causal=True, dynamic_sched=True, overlap_tiles=True, wg_store_o=True),
        cfg(64, causal=True, varlen_q=True, varlen_k=True, dynamic_sched=True, skip_empty=True, qhead_per_kvhead=2,
            overlap_tiles=True),
        cfg(128, qhead_per_kvhead=4, persistent=False, dynamic_sched=False, kv_mcast=True),  # (pack GQA)
        cfg(128, qhead_per_kvhead=4, persistent=True, dynamic_sched=False, kv_mcast=True),  # (its default, v0.53)
        cfg(64, persistent=False, dynamic_sched=False, kv_mcast=True),
        cfg(128, causal=True, dynamic_sched=True, l2_section_mb=16, kv_mcast=True),  # (the d128 causal default)
        cfg(64, causal=True, dynamic_sched=False, kv_mcast=True),  # (a causal pair on the static persistent grid)
        cfg(256, rescale_o_before_pv=True, dynamic_sched=True, kv_mcast=True),  # (pair claims without a mask; o_in_q)
        cfg(128, causal=True, pingpong=True, pp_steps_only=True, dynamic_sched=True),
        cfg(256, rescale_o_before_pv=True, rescale_threshold=8.0, sum_rounded=True),
        cfg(256, rescale_o_before_pv=True, dynamic_sched=True),  # d256 without a mask: the dynamic grid (v0.16)
        cfg(256, causal=True, rescale_o_before_pv=True),  # folded, O rescaled before P V (the d256 default)
        cfg(64, dtype="fp16", has_lse=False),
        cfg(96, local=True, has_softcap=True),
        cfg(96, local=True, one_step_loop=True),
        cfg(128, causal=True, one_step_loop=True),
        cfg(128, causal=True, fold_first=False),  # the first block in its own code (before v0.44's default)
        cfg(128, causal=True, wg_store_o=False),  # (one store of the tile: the d128 causal default before v0.56)
        # Note [O staged by stmatrix] (the d256 default): the d64 / d128 rows' configs, causal and not, row stores,
        # packed rows, fp16; at d256 (sO in sQ's memory) the 32-bit stores, which are the option there.
        cfg(64, stmatrix_o=True),
        cfg(64, causal=True, wg_store_o=True, stmatrix_o=True),
        cfg(128, stmatrix_o=True),
        cfg(128, causal=True, wg_store_o=True, stmatrix_o=True),
        cfg(256, rescale_o_before_pv=True, dynamic_sched=True, kv_mcast=True, stmatrix_o=False),
        cfg(256, causal=True, rescale_o_before_pv=True, stmatrix_o=False),
        cfg(192, 128, causal=True, varlen_q=True, varlen_k=True, stmatrix_o=True),
        cfg(128, tile_m=64, pingpong=False, qhead_per_kvhead=4, stmatrix_o=True),
        cfg(96, dtype="fp16", local=True, stmatrix_o=True),
        cfg(256, local=True, varlen_q=True, varlen_k=True, has_seqused_k=True, fold_first=True),
        cfg(192, causal=True, varlen_q=True, varlen_k=True),
        cfg(192, local=True, one_step_loop=False),  # d192's separate loops (its default is one step)
        cfg(256, local=True, varlen_q=True, varlen_k=True, has_seqused_k=True),
        cfg(72, causal=True, exp2_emu_frac=0.25, rescale_threshold=0.0),
        cfg(64, tile_m=64),
        cfg(64, tile_m=192, tile_n=128),
        cfg(192, 128, has_softcap=True),
        cfg(128, tile_m=64, pingpong=False, qhead_per_kvhead=4),
        cfg(128, tile_m=64, pingpong=False, qhead_per_kvhead=4, split_kv=True, causal=True),
        cfg(128, split_kv=True, varlen_q=True, varlen_k=True, has_seqused_k=True),
        # packed rows copied row by row (the path of user functions, and of pack_tma_partial off)
        cfg(96, qhead_per_kvhead=6, local=True, varlen_q=True, varlen_k=True, dtype="fp16", pack_tma_partial=False),
        cfg(128, tile_m=64, pingpong=False, qhead_per_kvhead=4, page_rows=16, has_seqused_k=True, varlen_q=True),
        cfg(128, tile_m=64, pingpong=False, page_rows=128, has_seqused_k=True, split_kv=True, causal=True),
        cfg(64, has_seqused_q=True, has_seqused_k=True, causal=True, dynamic_sched=True),
        cfg(64, qhead_per_kvhead=4),  # packed rows with three consumer warpgroups
        cfg(64, local=True),  # the d64 local default: three ping-pong warpgroups, the fold, edges first
        cfg(256, qhead_per_kvhead=4, causal=True),  # packed rows with O staged in Q's smem (o_in_q)
        cfg(128, varlen_q=True, causal=True),  # packed q with batched k/v (mixed layouts)
        cfg(128, qhead_per_kvhead=4, causal=True, varlen_q=True, varlen_k=True),  # packed varlen Q by TMA
        # packed boxes of tile_m // g positions (126 of 128 rows; 190 of 192 with O by TMA)
        cfg(128, qhead_per_kvhead=6, causal=True, varlen_q=True, varlen_k=True, pack_tma_partial=True),
        cfg(64, qhead_per_kvhead=5, pack_tma_partial=True),
        # the decode tile's partial boxes (7 q heads: 9 positions, 63 of 64 rows) with a paged cache and splits
        cfg(128, tile_m=64, pingpong=False, persistent=False, qhead_per_kvhead=7, page_rows=64, has_seqused_k=True,
            split_kv=True),
        cfg(128, causal=True, has_sink=True, dynamic_sched=True),
        cfg(64, tile_m=64, pingpong=False, qhead_per_kvhead=4, has_sink=True, page_rows=16, has_seqused_k=True,
            varlen_q=True),
        cfg(128, split_kv=True, has_sink=True),  # the partials skip the sink (the combine adds it)
        cfg(64, pingpong=True, pp_steps_only=False),  # three warpgroups' turns around the tile's edges too
        # v0.27's grid rule for ragged rows: varlen without a mask on the dynamic grid (any head dim).
        cfg(128, varlen_q=True, varlen_k=True, dynamic_sched=True),
        cfg(64, causal=True, varlen_q=True, varlen_k=True, dynamic_sched=True),
        cfg(128, causal=True, varlen_q=True, varlen_k=True, dynamic_sched=True, skip_empty=True),  # Note [Skipped claims]
        # v0.28's decode tiles: 64-row K blocks, one CTA per tile; split, and varlen.
        cfg(128, tile_m=64, tile_n=64, pingpong=False, persistent=False, qhead_per_kvhead=4),
        cfg(128, tile_m=64, tile_n=64, pingpong=False, persistent=False, qhead_per_kvhead=4, split_kv=True),
        # (split calls launch their combine early by default, SPLIT_PDL: two plain launches, paged with seqused_k too)
        cfg(128, tile_m=64, tile_n=64, pingpong=False, persistent=False, qhead_per_kvhead=4, split_kv=True,
            pdl=False),
        cfg(128, tile_m=64, pingpong=False, persistent=False, qhead_per_kvhead=4, page_rows=16, has_seqused_k=True,
            split_kv=True, pdl=False),
        cfg(128, tile_m=64, tile_n=64, pingpong=False, persistent=False, qhead_per_kvhead=4, varlen_q=True,
            varlen_k=True),
        # v0.29: paged decode (and seqused_k) one CTA per tile, with the table's K blocks.
        cfg(128, tile_m=64, pingpong=False, persistent=False, qhead_per_kvhead=4, page_rows=16, has_seqused_k=True),
        cfg(128, tile_m=64, pingpong=False, persistent=False, qhead_per_kvhead=4, page_rows=16, has_seqused_k=True,
            split_kv=True),
        # The compact varlen grid (a call without max_seqlen_q; an option otherwise): d64 (three
        # warpgroups), causal d128 (LPT), packed GQA.
        cfg(64, persistent=False, compact_grid=True, varlen_q=True, varlen_k=True),
        cfg(128, persistent=False, compact_grid=True, causal=True, varlen_q=True, varlen_k=True),
        cfg(128, tile_m=64, pingpong=False, persistent=False, compact_grid=True, qhead_per_kvhead=4, causal=True,
            varlen_q=True, varlen_k=True),
        # Varlen decode without max_seqlen_q (COMPACT_WITHOUT_LENGTHS), split; paged.
        cfg(128, tile_m=64, tile_n=64, pingpong=False, persistent=False, compact_grid=True, qhead_per_kvhead=4,
            varlen_q=True, varlen_k=True, split_kv=True),
        cfg(128, tile_m=64, pingpong=False, persistent=False, compact_grid=True, qhead_per_kvhead=4, varlen_q=True,
            page_rows=16, has_seqused_k=True),
        cfg(128, tile_m=64, tile_n=64, pingpong=False, persistent=False, compact_grid=True, qhead_per_kvhead=4,
            varlen_q=True, varlen_k=True),
        cfg(64, persistent=False, compact_grid=True, causal=True, varlen_q=True, varlen_k=True),
    ]


def explain_notes(problem: AttnProblem, options: Optional[KernelOptions], cfg: FwdSm90Config) -> list[str]:
    """Lines for ``fa4.explain()``: the forward's rows (packed GQA or not), its grid and tile order,
    and the decode tile, each with the rule that chose it."""
    notes = []
    g = problem.heads // problem.heads_k
    if cfg.qhead_per_kvhead > 1:
        how = "row by row (Note [Pack GQA])"
        if cfg.pack_tma_takes:
            how = "by TMA boxes of whole positions (Note [Packed rows by TMA])"
            if cfg.packed_block_rows < cfg.tile_m:
                how += (f", {cfg.tile_m // cfg.qhead_per_kvhead} positions ({cfg.packed_block_rows} of the tile's "
                        f"{cfg.tile_m} rows) per block")
        notes.append(f"packed GQA rows: the {cfg.qhead_per_kvhead} q heads of each kv head share a tile's rows, so "
                     f"each K/V block is loaded once for all of them; Q is loaded {how}; pack_gqa=False turns it off")
    elif g > 1 and problem.pack_gqa is None:
        notes.append(f"GQA rows not packed: with {g} q heads per kv head (over "
                     f"fa4.fwd.common.PACK_WHOLE_ROWS_MAX_GROUP, no divisor of the tile with a dense Q, or with "
                     f"user functions / a "
                     f"block table) packing would save too few tiles (fa4.fwd.common.PACK_GQA_MAX_TILE_SHARE); "
                     f"pack_gqa=True packs them")
    decode = cfg.tile_m == 64 and not cfg.persistent
    if decode:
        if options is not None and options.tile_n is not None:
            blocks = f"the caller's {cfg.tile_n}-row K blocks (KernelOptions.tile_n)"
        elif cfg.tile_n <= DECODE_TILE_N:
            blocks = f"{cfg.tile_n}-row K blocks"
        else:
            blocks = (f"the table's {cfg.tile_n}-row K blocks (with seqused_k or a page table: 64-row blocks cost 3% "
                      "with 16-row pages)")
        notes.append(f"decode tile: {cfg.tile_m} query rows, {blocks}, one CTA per tile (several per SM), measured "
                     "faster than the persistent grid at the HBM roofline (DECODE_GRID)")
    if cfg.compact_grid:
        order = ("the compact varlen grid, one CTA per tile (Note [Compact varlen grid]: no CTA past a "
                 "sequence's end)")
        if _loose_q(problem):
            order += f"; max_seqlen_q {problem.seqlen_q} is over {LOOSE_BOUND_RATIO}x the average length"
            if shape_bound(problem.seqlen_q, problem.total_q, problem.batch):
                order += (" (the call gave none: the packed token count stands in), so the tile, packing and split "
                          "count were judged on the average")
    elif not cfg.persistent:
        order = "one CTA per tile"
    elif cfg.dynamic_sched:
        sections = f"{cfg.l2_section_mb} MB L2 sections" if cfg.l2_section_mb else "one (head, batch) pair per section"
        order = (f"the dynamic persistent grid (one CTA per SM, tiles claimed from a counter, {sections}; "
                 "masked rows past s_k 1024, ragged rows, and head dims > 128 without a mask)")
    else:
        order = "the static persistent grid (one CTA per SM, a snake over one (head, batch) pair per section)"
    if cfg.kv_mcast:
        rule = ""
        sms = _num_sms(None)
        resident = None if sms in KV_MCAST_PERSISTENT_SMS else _resident_pairs(None)  # (as the rule asks it)
        grid = _kv_mcast(replace(cfg, persistent=True), problem.seqlen_k, sms, lambda: resident)
        if sms in KV_MCAST_PERSISTENT_SMS:
            held = (f"{sms} SMs, where all its {sms // 2} clusters are resident at once (v0.50's gains; the driver's "
                    "count on an H100, v0.52), KV_MCAST_PERSISTENT_SMS")
        else:
            held = (f"the driver holds {resident} clusters of two at once on this GPU's {sms} SMs"
                    if resident is not None else f"{sms} SMs, and the driver could not be asked how many clusters fit")
        if grid == "persistent" and cfg.causal:
            rule = (f": causal rows of head dim {cfg.head_dim} without GQA or lengths from s_k "
                    f"{KV_MCAST_CAUSAL_MIN_SEQLEN_K}, KV_MCAST_CAUSAL_HEAD_DIMS; {held}")
        elif grid == "persistent":
            rule = (f": dense rows of head dim {cfg.head_dim} without a mask or lengths from s_k "
                    f"{KV_MCAST_MIN_SEQLEN_K}, KV_MCAST_MIN_SEQLEN_K"
                    f"{', packed GQA rows too (KV_MCAST_GQA)' if cfg.qhead_per_kvhead > 1 else ''}; {held}")
        elif grid == "plain":
            rule = (f": the same rows from s_k {KV_MCAST_PLAIN_MIN_SEQLEN_K} on the plain grid, where not all of "
                    f"the persistent grid's {sms // 2} clusters are known to be resident at once ({held})")
        if cfg.causal:
            rule += ("; both tiles of a pair walk the second one's K blocks, the first one's past its diagonal "
                     "masked whole")
        if cfg.dynamic_sched:
            rule += ("; CTA 0 claims each pair from the counter and hands it to CTA 1 through its shared memory "
                     "(Note [Pair claims])")
        order += (", in clusters of two CTAs on m-blocks 2m and 2m + 1 of one head that load each K/V block once "
                  f"by TMA multicast (Note [K/V multicast]{rule})")
    notes.append(f"grid: {order}; {'longest tiles first (LPT)' if cfg.lpt else 'tiles in order'}")
    if cfg.overlap_tiles:
        rule = (f"; the rule OVERLAP_TILES gives it to rows without a mask on the static persistent grids from s_k "
                f"{OVERLAP_TILES_MIN_SEQLEN_K}" if _overlap_tiles(replace(cfg, overlap_tiles=False), problem.seqlen_k)
                else "")
        notes.append("tiles overlapped: each tile's first Q K^T is issued behind the last one's P V and runs under "
                     f"its epilogue, Q in two stages (Note [Tiles overlapped]{rule})")
    if cfg.wg_store_o:
        bucket = _bucket(max(cfg.head_dim, cfg.head_dim_v))
        rule = ("; WG_STORE_O_BUCKETS, the d64 tile's three warpgroups" if bucket in WG_STORE_O_BUCKETS
                else ("; WG_STORE_O_CAUSAL_BUCKETS, the d128 causal tile under 8192 keys where K/V are not "
                      "shared by pairs") if cfg.causal and bucket in WG_STORE_O_CAUSAL_BUCKETS else "")
        notes.append("O stored by warpgroup: each consumer warpgroup stages and stores its own 64 rows, with its own "
                     f"barrier (Note [Warpgroup stores]{rule})")
    if cfg.pdl:
        notes.append("the combine launched as a programmatic dependent of this forward (Note [Combine launched "
                     "early]; SPLIT_PDL)")
    return notes


def run(cfg: FwdSm90Config, problem: AttnProblem, q, k, v, out, lse, cu_seqlens_q=None, cu_seqlens_k=None,
        seqused_k=None, seqused_q=None, page_table=None, sink=None, aux=None) -> None:
    """Launch (arguments: :func:`fa4.fwd.common.run`; the persistent grid is the SM count; ``aux``:
    the tensors of ``cfg.aux``, read by the user functions)."""
    num_sms = _num_sms(q.device)
    splits = fwd_common.launch_splits(cfg, problem, num_sms)
    counter = None
    if cfg.dynamic_sched:  # the claims counter, zero at launch (one per call: safe on any stream)
        import torch

        counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    fwd_common.run(cfg, problem, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                   extra=_extra(cfg, num_sms, splits, counter, aux), splits=splits, seqused_q=seqused_q,
                   page_table=page_table, sink=sink)


def _extra(cfg: FwdSm90Config, num_sms: int, splits: int, counter, aux) -> tuple:
    """The sm90 kernel's arguments after :func:`fa4.fwd.common.kernel_args`'s: the persistent grid
    (SM count), the K splits, the dynamic scheduler's claims counter and the user functions' aux
    tensors."""
    return num_sms, splits, counter, launch_aux(aux) if cfg.aux else None


def prepare_launch(cfg: FwdSm90Config, problem: AttnProblem, device):
    """``launch(q, k, v, out, lse)`` for a dense call of ``cfg`` whose launch needs no per-call state
    (Note [Fast path] in fa4/ops.py), with the arguments :func:`run` would pass; None for configs
    that need some (a claims counter, split-KV's partials and combine, aux tensors, block lists,
    varlen, paged or seqused tensors, a sink)."""
    if (cfg.dynamic_sched or cfg.split_kv or cfg.aux or cfg.block_skip or cfg.page_rows or cfg.varlen_q
            or cfg.varlen_k or cfg.has_seqused_q or cfg.has_seqused_k or cfg.has_sink):
        return None
    from fa4 import jit

    # Fixed by the signature (its shapes, device and scalars): the scalars, the SM count, and the grid
    # check (fwd_common.forward_tiles), which the signature's first call, the full way, passed.
    scalars = fwd_common.launch_scalars(cfg, problem)
    extra = _extra(cfg, _num_sms(device), 1, None, None)
    kernel_args = fwd_common.kernel_args

    def launch(q, k, v, out, lse):
        jit.get_kernel(cfg)(*kernel_args(cfg, q, k, v, out, lse, scalars, extra=extra))
    return launch


_num_sms = fwd_common.default_num_sms  # (a module attribute: tests/test_fwd_launch_args.py replaces it)
_resident_pairs = partial(resident_clusters, size=2)  # (a module attribute: tests replace it)
