"""What every forward family shares on the host: the kernel signature's fake arguments, the
launch arguments, the grid extent and L2 sections, the option checks, and the launcher.

Every forward kernel's ``__call__`` takes ``(mQ, mK, mV, mO, mLSE, mCuSeqlensQ, mCuSeqlensK,
mSeqUsedQ, mSeqUsedK, mPageTable, softmax_scale, softcap, window_left, window_right, max_seqlen_q,
*extra, stream)``
(DESIGN.md's tensor conventions); ``extra`` are a family's own runtime scalars (the sm90 family's
persistent grid size).
"""

from __future__ import annotations

from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.config import AttnProblem
from fa4.sched.tile import L2_BUDGET_BYTES, l2_section_size, loose_plan

DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16}


def pad32(d: int) -> int:
    """Head dims are tiled in multiples of 32 (the padded columns read as zeros, never stored)."""
    return (d + 31) // 32 * 32


def fake_args(cfg, extra: tuple = ()) -> tuple:
    """Fake tensors with symbolic sizes (64-bit strides, multiples of 16 bytes) and scalars for the
    forward signature, ``extra`` runtime scalars before the stream. With ``cfg.split_kv`` O is the
    float32 partial output and O / LSE have their own batch size ``num_splits * b`` (Note [Split-KV
    partials] in fa4/pack_gqa.py)."""
    dt = DTYPES[cfg.dtype]
    split = cfg.split_kv

    def strides():
        return tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)

    b_q, b_k, s_q, s_k, h, h_k = (cute.sym_int() for _ in range(6))
    mQ = cute.runtime.make_fake_tensor(dt, (b_q, s_q, h, cfg.head_dim), strides(), assumed_align=16)
    mK = cute.runtime.make_fake_tensor(dt, (b_k, s_k, h_k, cfg.head_dim), strides(), assumed_align=16)
    mV = cute.runtime.make_fake_tensor(dt, (b_k, s_k, h_k, cfg.head_dim_v), strides(), assumed_align=16)
    # Split partials are (num_splits * b, ...): a batch of their own (TVM-FFI checks that a shared
    # symbol has one value across the arguments).
    b_o = cute.sym_int() if split else b_q
    mO = cute.runtime.make_fake_tensor(Float32 if split else dt, (b_o, s_q, h, cfg.head_dim_v), strides(),
                                       assumed_align=16)
    mLSE = None
    if cfg.has_lse:
        mLSE = cute.runtime.make_fake_tensor(Float32, (b_o, h, s_q), (cute.sym_int64(), cute.sym_int64(), 1),
                                             assumed_align=4)

    def vec(flag):
        return cute.runtime.make_fake_compact_tensor(Int32, (cute.sym_int(),), assumed_align=4) if flag else None

    page_table = None
    if cfg.page_rows:
        page_table = cute.runtime.make_fake_tensor(Int32, (cute.sym_int(), cute.sym_int()), (cute.sym_int64(), 1),
                                                   assumed_align=4)
    sink = None
    if cfg.has_sink:  # (h,) float32, one logit per q head
        sink = cute.runtime.make_fake_compact_tensor(Float32, (cute.sym_int(),), assumed_align=4)
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (mQ, mK, mV, mO, mLSE, vec(cfg.varlen_q), vec(cfg.varlen_k), vec(cfg.has_seqused_q),
            vec(cfg.has_seqused_k), page_table, sink,
            Float32(1.0), Float32(0.0), Int32(0), Int32(0), Int32(1)) + tuple(extra) + (stream,)


def grid_extent(mQ: cute.Tensor, mK: cute.Tensor, mCuSeqlensQ: Optional[cute.Tensor],
                mCuSeqlensK: Optional[cute.Tensor], max_seqlen_q: Int32, tile_m: int, kv_row_bytes: int,
                qhead_per_kvhead: int = 1, num_splits=1, mPageTable: Optional[cute.Tensor] = None,
                l2_budget: int = L2_BUDGET_BYTES, pow2_sections: bool = False):
    """Host side of a forward ``__call__`` (traced inline): ``(num_batch, num_m_blocks, section)``,
    the L2 section of :func:`fa4.sched.tile.l2_section_size` for K/V rows of ``kv_row_bytes``.
    ``qhead_per_kvhead > 1``: packed tiles (Note [Pack GQA] in fa4/pack_gqa.py), ``seqlen_q * g``
    rows per kv head. ``num_splits``: split-KV, each (head, batch) pair is ``num_splits`` scheduler
    heads reading a share of its K/V each. ``l2_budget``: the section's K/V bytes; ``pow2_sections``:
    pairs per section rounded down to a power of two (Note [Section sizes]). Returns also the
    scheduler's head count."""
    num_heads = mQ.shape[2]
    if const_expr(mCuSeqlensQ is not None):
        num_batch = mCuSeqlensQ.shape[0] - 1
    else:
        num_batch = mQ.shape[0]
    num_m_blocks = cute.ceil_div(max_seqlen_q * qhead_per_kvhead, tile_m)
    # K/V rows of one sequence (for varlen: the average length).
    seqlen_k_avg = mK.shape[1] if const_expr(mCuSeqlensK is None) else mK.shape[1] // num_batch
    if const_expr(mPageTable is not None):  # paged K/V: (num_pages, page_size, ...), the table's capacity
        seqlen_k_avg = mPageTable.shape[1] * mK.shape[1]
    sched_heads = (num_heads // qhead_per_kvhead) * num_splits
    # q heads (scheduler heads) that share one kv head's K/V rows in L2.
    share = (num_heads // mK.shape[2] if const_expr(qhead_per_kvhead == 1) else 1) * num_splits
    section = l2_section_size(seqlen_k_avg, kv_row_bytes, share, sched_heads * num_batch, l2_budget, pow2_sections)
    return num_batch, num_m_blocks, section, sched_heads


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
        extra: tuple = (), splits: int = 1, seqused_q=None, page_table=None, sink=None) -> None:
    """Launch the kernel of ``cfg``: q/k/v/out 4D (varlen: (1, total, h, d); paged k/v:
    (num_pages, page_size, h_k, d)), lse (b, h, s_q) / (1, h, total_q) or None; outputs preallocated
    by the caller. With ``cfg.split_kv``, ``splits`` K splits through float32 partials and the
    combine (:func:`run_split`). ``sink``: float32 ``(h,)`` with ``cfg.has_sink``."""
    from fa4.jit import get_kernel

    forward_tiles(cfg, problem, q, cu_seqlens_q, splits if cfg.split_kv else 1)
    fn = get_kernel(cfg)
    scalars = launch_scalars(cfg, problem)

    def launch(o, l):
        fn(*kernel_args(cfg, q, k, v, o, l, scalars, cu_seqlens_q, cu_seqlens_k, seqused_q, seqused_k, page_table,
                        sink, extra))

    if cfg.split_kv:
        run_split(cfg, problem, launch, q, out, lse, splits, cu_seqlens_q if cfg.varlen_q else None,
                  seqused_q if cfg.has_seqused_q else None, sink if cfg.has_sink else None)
    else:
        launch(out, lse)


def kernel_args(cfg, q, k, v, o, l, scalars: tuple, cu_seqlens_q=None, cu_seqlens_k=None, seqused_q=None,
                seqused_k=None, page_table=None, sink=None, extra: tuple = ()) -> tuple:
    """The forward kernels' positional arguments, in their ``__call__``'s order: the tensors (None
    where ``cfg`` does not read them), :func:`launch_scalars`, then the family's ``extra``. The one
    place that order is written: :func:`run` and the sm90 fast path's prepared launch
    (``fa4.fwd.sm90.prepare_launch``) both build their calls here."""
    return (q, k, v, o, l if cfg.has_lse else None,
            cu_seqlens_q if cfg.varlen_q else None, cu_seqlens_k if cfg.varlen_k else None,
            seqused_q if cfg.has_seqused_q else None, seqused_k if cfg.has_seqused_k else None,
            page_table if cfg.page_rows else None, sink if cfg.has_sink else None, *scalars, *extra)


def launch_scalars(cfg, problem: AttnProblem) -> tuple:
    """The forward kernels' scalar arguments after the tensors: softmax scale, softcap, window left /
    right, the grid's query length."""
    window_left, window_right = (problem.window_left, problem.window_right) if cfg.local else (0, 0)
    return (float(problem.softmax_scale), float(problem.softcap) if cfg.has_softcap else 1.0, int(window_left),
            int(window_right), int(max(problem.seqlen_q, 1)))


MAX_GRID_X = 2**31 - 1


def forward_tiles(cfg, problem: AttnProblem, q, cu_seqlens_q, splits: int) -> int:
    """The forward's tile count as the kernels' ``__call__`` size it (:func:`grid_extent`; the
    compact varlen grid's slots, Note [Compact varlen grid]): the grid of a one-tile-per-CTA launch
    (the sm80 family, sm90 ``persistent=False``), and the range the persistent schedulers index in
    Int32. ValueError, before the launch, past 2^31 - 1 (CUDA's grid limit; the tile index wraps)."""
    compact = getattr(cfg, "compact_grid", False)
    batch = cu_seqlens_q.shape[0] - 1 if cu_seqlens_q is not None and cfg.varlen_q else q.shape[0]
    rows = getattr(cfg, "packed_block_rows", cfg.tile_m)  # (sm90: packed boxes of tile_m // g positions)
    tiles = tile_count(q.shape[2], batch, problem.seqlen_q, q.shape[1], rows, cfg.qhead_per_kvhead,
                       compact) * splits
    if tiles > MAX_GRID_X:
        what = "(packed Q rows * g // tile_m + batch)" if compact else "m_blocks * batch"
        hint = ("pass max_seqlen_q (without it the grid is sized by an upper bound from the shapes) or split the "
                "batch into several calls" if cfg.varlen_q and not compact else "split the batch into several calls")
        raise ValueError(f"the forward has {tiles} tiles, past CUDA's grid limit ({what} * scheduler heads "
                         f"{q.shape[2] // cfg.qhead_per_kvhead * splits} < 2^31): {hint}")
    return tiles


def tile_count(heads: int, batch: int, seqlen_q: int, total_q: int, tile_m: int, g: int, compact: bool) -> int:
    """Tiles of a forward without split-KV as the kernels' ``__call__`` count them (:func:`grid_extent`):
    ``ceil(s_q * g / tile_m) * batch`` per scheduler head (``heads // g``), or on the compact varlen
    grid (Note [Compact varlen grid]) ``total_q * g // tile_m + batch`` slots, independent of ``s_q``."""
    if compact:
        return (total_q * g // tile_m + batch) * (heads // g)
    return -(-max(seqlen_q, 1) * g // tile_m) * (heads // g) * batch


# --------------------------------------------------------------------------------------------
# Pack GQA and split-KV: the host decisions (Notes [Pack GQA], [Split-KV partials] in fa4/pack_gqa.py)
# --------------------------------------------------------------------------------------------

MAX_SPLITS = 128
"""Most K splits of one tile (the combine kernel's limit is higher)."""


PACK_GQA_MAX_TILE_SHARE = 0.94
"""Where the whole-rows rule (:data:`PACK_WHOLE_ROWS_MAX_GROUP`) does not pack (the sm80 family, which
copies packed rows row by row; in sm90, groups past it, groups that do not divide the tile with a
dense Q, queries of at most 64 positions), rows are packed by default only when that leaves at most
this share of the unpacked tiles: the row-by-row path loads Q and stores O row by row, measured
6% slower on prefill (docs/RESULTS.md v0.5:
626.9 -> 588.8 TFLOP/s). v0.26: with any share below 1 (the old rule), a varlen GQA batch whose
longest sequence was no multiple of the tile packed (118 tiles of the longest instead of 120) and
ran at 468 TFLOP/s against flash-attn-4's 534 (``python -m fa4.bench --offgrid``, varlen-gqa-d128-causal);
v0.27: 508 against 537."""


PACK_WHOLE_ROWS_MAX_GROUP = 8
"""A family that loads packed tiles of whole positions as fast as unpacked ones (the sm90 forward's
TMA boxes, Note [Packed rows by TMA] in fa4/pack_gqa.py) packs by default when ``g``, the q heads per
kv head, is at most this and divides ``tile_m`` (or the family takes boxes of ``tile_m // g``
positions: ``partial_boxes``), for queries longer than 64 positions (shorter ones keep the decode
tile's rule). v0.42 (H100, d128, g = 4, TFLOP/s, packed / unpacked, four rounds): varlen GQA causal
538 / 512, 542 / 497, 548 / 545, 536 / 499 (its ragged sequences' last tiles: 5% fewer K-block
steps); varlen d64 / d256 +3-7%; the dense GQA rows (s4k, s4k causal, a prefill against a cache, d64
/ d256 s4k causal) -3% to +7%, within the rounds' noise. v0.43 (H200, d128 causal): g = 8 varlen
545 / 514 and 533 / 494, dense s4k 618 / 621 and 614 / 621 (noise); g = 7 varlen by boxes of 18
positions (126 of 128 rows) 536 / 523, 532 / 516, 529 / 496, and 536 / 523 on an H100, whose one
round of the dense s4k row read 586 / 612: the sm90 forward takes partial boxes by default for a
ragged Q only. MQA (g = 16) read 648 / 705 and 646 / 644 (v0.42, H100): not taken."""


def fold_first_rule(enabled: bool, windowed: bool, one_step: bool, user_mods: bool, block_skip) -> bool:
    """A family's ``fold_first`` default (Note [The first block in the masked loop] in
    fa4/fwd/sm90.py): its switch ``enabled``, for tiles with a window the family folds
    (``windowed``: causal, or a local window where measured so) with separate loops and neither
    user functions nor block skipping (whose first block keeps its own code: :func:`folds_first`)."""
    return enabled and windowed and not one_step and not user_mods and not block_skip


def folds_first(cfg, mask, umod) -> bool:
    """Whether a forward kernel runs the tile's first block in the masked loop: ``cfg.fold_first``
    with a window (``mask``, trace time) and separate loops, without block skipping or user
    functions (``umod``, the tile's, or None)."""
    return cfg.fold_first and mask.has_window and not cfg.one_step_loop and not cfg.block_skip and umod is None


def pack_gqa(problem: AttnProblem, tile_m: int, whole_rows_max_group: int = 0, partial_boxes: bool = False) -> int:
    """The packing factor of a forward: ``qhead_per_kvhead`` when rows are packed, else 1. The
    user's ``pack_gqa`` is honoured. By default rows are packed where the family packs whole
    positions cheaply (``g <= whole_rows_max_group`` and ``tile_m % g == 0``, or any ``g <= tile_m``
    with ``partial_boxes``, the family's boxes of ``tile_m // g`` positions; not with user
    functions or a block table, whose packed rows were not measured and block skipping needs
    unpacked rows: :data:`PACK_WHOLE_ROWS_MAX_GROUP`), or where that needs clearly fewer tiles
    (``ceil(s_q * g / tile_m) <= PACK_GQA_MAX_TILE_SHARE * g * ceil(s_q / tile_m)``: short query
    sequences, decode; ``s_q`` the longest with varlen)."""
    g = problem.qhead_per_kvhead
    if g == 1 or problem.pack_gqa is False:
        return 1
    if problem.pack_gqa:
        return g
    plain = not (problem.score_mod or problem.mask_mod or problem.block_table)
    if plain and g <= whole_rows_max_group and (tile_m % g == 0 or (partial_boxes and g <= tile_m)):
        return g
    sq = max(problem.seqlen_q, 1)
    return g if -(-sq * g // tile_m) <= PACK_GQA_MAX_TILE_SHARE * g * -(-sq // tile_m) else 1


def rows_plan(problem: AttnProblem, table_tile_m: int, user_tile_m: Optional[int], decode_tile: bool = True,
              whole_rows_max_group: int = 0, partial_boxes: bool = False):
    """``(g, tile_m, decode)`` of a forward: the packing factor (:func:`pack_gqa`, judged on the
    tile the call will use), the tile's rows (the user's, else 64 for decode-like shapes whose
    (packed) rows fit 64, else the tuning table's), and whether the 64-row decode tile was chosen
    (``decode_tile``: the family may pick it, i.e. no user option pins the tile)."""
    free = user_tile_m is None and decode_tile
    # Short queries keep the tile-share rule (the whole-rows rule would pack s_q 17-64 out of the
    # decode tile into a larger one: not measured).
    short = problem.seqlen_q <= 64 and free
    g = pack_gqa(problem, user_tile_m or (64 if short else table_tile_m), 0 if short else whole_rows_max_group,
                 partial_boxes)
    if user_tile_m is not None:
        return g, user_tile_m, False
    if free and problem.seqlen_q * g <= 64:
        return g, 64, True
    return g, table_tile_m, False


def num_splits(problem: AttnProblem, num_tiles: int, tile_n: int, num_sms: int) -> int:
    """K splits per tile: the user's ``num_splits`` when given (> 0, at most :data:`MAX_SPLITS`),
    else a wave-efficiency rule: no split when the tiles alone fill 80% of the SMs or a tile has at
    most 4 K blocks; otherwise the smallest split count whose CTAs fill the last wave to within 10%
    of the best count (a split must keep >= 2 K blocks)."""
    if problem.num_splits > 0:
        return min(problem.num_splits, MAX_SPLITS)
    n_blocks = -(-max(problem.seqlen_k, 1) // tile_n)
    if num_tiles <= 0 or num_tiles >= 0.8 * num_sms or n_blocks <= 4:
        return 1

    def efficiency(s):
        ctas = num_tiles * s
        return ctas / (-(-ctas // num_sms) * num_sms)

    candidates = range(1, min(MAX_SPLITS, n_blocks // 2) + 1)
    best = max(efficiency(s) for s in candidates)
    return next(s for s in candidates if efficiency(s) >= 0.9 * best)


def split_count(problem: AttnProblem, tile_m: int, tile_n: int, qhead_per_kvhead: int,
                num_sms: Optional[int] = None, compact: bool = False) -> int:
    """K splits per tile of a forward config's tiles (:func:`num_splits`; one CTA per SM counted as
    a wave slot). Every forward family's ``make_config`` and ``run`` use it. ``compact``: the tiles
    of the compact varlen grid (Note [Compact varlen grid]), which do not depend on ``seqlen_q``."""
    tiles = tile_count(problem.heads, problem.batch, problem.seqlen_q, problem.total_q, tile_m, qhead_per_kvhead,
                       compact and problem.varlen_q)
    return num_splits(problem, tiles, tile_n, num_sms or default_num_sms())


_split_memo: dict = {}
_MEMO_LIMIT = 4096


def compact_splits(cfg, problem: AttnProblem, num_sms: Optional[int] = None) -> int:
    """:func:`split_count` for ``cfg``'s own tiles, judged as every family's ``make_config`` judges
    it: on the average length of each varlen side the call gave no max_seqlen for
    (:func:`loose_plan`), on the compact grid's tiles where ``cfg`` takes it."""
    compact = getattr(cfg, "compact_grid", False)
    return split_count(loose_plan(problem), cfg.tile_m, split_tile_n(cfg), cfg.qhead_per_kvhead, num_sms, compact)


def launch_splits(cfg, problem: AttnProblem, num_sms: int) -> int:
    """The split count a launch of ``cfg`` uses (1 without split-KV), memoized per (problem, config,
    SM count); the memo is cleared when it grows past a few thousand signatures (varlen decode
    changes the problem every step)."""
    if not cfg.split_kv:
        return 1
    key = (problem, cfg, num_sms)
    splits = _split_memo.get(key)
    if splits is None:
        if len(_split_memo) >= _MEMO_LIMIT:
            _split_memo.clear()
        splits = _split_memo[key] = compact_splits(cfg, problem, num_sms)
    return splits


def split_tile_n(cfg) -> int:
    """The K-block size :func:`split_count` counts in for ``cfg``: its ``tile_n``, or the family's
    ``split_tile_n`` where its tile differs from the one the split rule was measured with (the sm90
    decode tiles' 64-row blocks count in the table's)."""
    return getattr(cfg, "split_tile_n", cfg.tile_n)


def default_num_sms(device=None) -> int:
    """The SM count of ``device`` (default the current GPU): :func:`fa4.arch.num_sms`."""
    from fa4.arch import num_sms as _arch_num_sms

    return _arch_num_sms(getattr(device, "index", device))


def run_split(cfg, problem: AttnProblem, fn_args_launch, q, out, lse, splits: int, cu_seqlens_q=None,
              seqused_q=None, sink=None) -> None:
    """Split-KV launch: the kernel writes float32 partials (Note [Split-KV partials]), then the
    combine kernel merges them into ``out`` / ``lse`` (``lse`` may be None). ``fn_args_launch(o, l)``
    launches the kernel on the partial tensors. Rows the kernel does not write (past ``seqused_q``)
    are not combined either. ``sink``: the partials are over the keys alone and the combine adds
    the sink term."""
    import torch

    from fa4.combine import combine_into
    from fa4.ops import _empty  # NaN-filled under the tests: a slot the kernel skips fails

    b, sq, h, _ = q.shape
    dv = cfg.head_dim_v
    o_part = _empty((splits, b, sq, h, dv), torch.float32, q.device)
    lse_part = _empty((splits, b, h, sq), torch.float32, q.device)
    fn_args_launch(o_part.view(splits * b, sq, h, dv), lse_part.view(splits * b, h, sq))
    # (the combine's early launch pays where no kernel comes between the two)
    pdl = bool(getattr(cfg, "pdl", False))  # Note [Combine launched early] in fa4/combine.py
    if cfg.varlen_q:  # packed rows: the combine's (splits, total_q, h, dv) form, bounded by cu_seqlens_q
        combine_into(o_part[:, 0], lse_part[:, 0].transpose(-1, -2), out[0],
                     lse[0].transpose(-1, -2) if lse is not None else None, cu_seqlens=cu_seqlens_q,
                     seqused=seqused_q, sink=sink, pdl=pdl)
    else:
        combine_into(o_part, lse_part.transpose(-1, -2), out, lse.transpose(-1, -2) if lse is not None else None,
                     seqused=seqused_q, sink=sink, pdl=pdl)
