"""Query rows of a forward tile, plain or packed (pack GQA), and the row-by-row copies they need.

Note [Pack GQA]
    With ``g = heads // heads_k > 1`` query heads per kv head, a packed tile holds the rows of the
    ``g`` q heads that share one kv head: packed row ``p`` (``0 <= p < seqlen_q * g``) is query
    position ``p // g`` of q head ``head_kv * g + p % g``. The scheduler then walks kv heads, so
    K and V of a kv head are read once for its ``g`` q heads, and a decode step (``seqlen_q = 1``)
    fills ``g`` rows of one tile instead of one row of each of ``g`` tiles. Packed rows are not
    evenly spaced in memory: in the sm80 family, and in sm90 with user functions or ``pack_tma``
    off (or ``pack_tma_partial`` off where the tile's rows are no multiple of ``g``), Q is loaded
    and O is stored row by row in 16-byte vectors by the consumers (:func:`load_q_rows`,
    :func:`store_rows`); else Q is loaded by TMA boxes of whole positions, and O stored by TMA where
    unpacked rows' O would be (Note [Packed rows by TMA]). LSE is always stored per
    row (:func:`store_lse_rows`). The mask compares query positions
    (:class:`fa4.mask.AttentionMask` ``qhead_per_kvhead``). ``g`` is compile-time (one division by
    a constant per row).

Note [Packed rows by TMA]
    Where ``tile_m % g == 0`` a packed tile is ``tile_m / g`` whole query positions of the ``g``
    heads, and in a ``(b, s, h, d)`` tensor the ``g`` heads of a kv head are adjacent (head stride),
    so the tile is a 3-D box: ``d`` columns, ``g`` heads, ``tile_m / g`` positions. The sm90 forward
    then loads Q (and, without varlen Q / ``seqused_q`` / split-KV, stores O) by TMA over the view
    :func:`packed_rows_view` ``((g, s), d, h_k, b)``, whose first mode is colexicographic in the
    packed row order (``p = position * g + head % g``), and :func:`packed_tile` picks a tile's box.
    Boxes past the tensor read zeros and drop their stores; a varlen sequence is a coordinate
    offset on the positions, and its rows past the sequence's end read the next sequence (never
    stored), as for unpacked rows (Note [TMA and varlen / padding] in fa4/fwd/sm90.py). So the
    producer warp loads a packed tile's Q under the last tile's work, as for unpacked rows, where
    the row copies stop every consumer at each tile. Measured (v0.42, H100, d128 GQA 32 / 8): packed
    by TMA / by rows 538 / 469 and 542 / 436 TFLOP/s on a varlen causal batch, 698 / 565 and 626 /
    546 on s4k without a mask; the default packs by TMA (:data:`fa4.fwd.common.PACK_WHOLE_ROWS_MAX_GROUP`).
    The two paths give the same bits (tests/test_fwd_sm90_gpu.py::test_packed_rows_by_tma).

    Where ``g`` does not divide the tile (5 or 7 q heads per kv head, as in Qwen2.5's models, or 6),
    ``FwdSm90Config.pack_tma_partial`` takes boxes of ``tile_m // g`` positions: a block holds
    ``(tile_m // g) * g`` packed rows (``row_block`` of :class:`fa4.mask.AttentionMask`,
    ``block_rows`` of :class:`TileRows`, the grid's and the compact scheduler's rows per tile), the
    box lands in the first rows of sQ (the smem layout composed with those rows), and the tile's
    last ``tile_m % g`` MMA rows are padding: whatever sQ held, never stored. The Q stage expects
    the box's bytes (its elements; the span of the first rows of a tile of several 64-column blocks
    is larger: v0.43's first GPU run hung on it). v0.43 (H200, Qwen2.5-7B's 28 / 4 heads, d128,
    varlen causal, TFLOP/s): boxes 536 / 532 / 529, row copies 470 / 457 / 463, unpacked 523 / 516 /
    496; the default takes them for a ragged Q (:func:`fa4.fwd.common.pack_gqa`).

Note [Split-KV partials]
    With split-KV the K blocks of a tile are cut into ``num_splits`` contiguous ranges
    (:func:`fa4.sched.tile.split_range`); split ``s`` writes its normalized float32 output and its
    LSE into slot ``s`` of ``O_partial (num_splits * b, s_q, h, dv)`` and ``LSE_partial
    (num_splits * b, h, s_q)`` (varlen: ``b = 1``, ``s_q = total_q``), and the combine kernel
    (:mod:`fa4.combine`) merges the slots. A split with no K block writes ``O = 0, LSE = -inf``.
    :func:`partial_slot` gives the slot's batch index.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.cute_utils import make_acc_mn_view
from fa4.seqlen import SeqlenInfo
from fa4.softmax import LOG2_E


@dataclass(frozen=True)
class TileRows:
    """The rows of one forward tile: ``head`` is the q head (``qhead_per_kvhead == 1``) or the kv
    head (packed); ``num_rows`` the rows of the sequence (``seqlen_q * g``), rows at or past it are
    padding (never stored). ``block_rows`` (0: ``tile_m``): the rows of the sequence one block
    holds, fewer than the MMA tile's ``tile_m`` when a packed block is ``tile_m // g`` whole
    positions (Note [Packed rows by TMA]); the tile's rows past it are padding too."""

    qhead_per_kvhead: cutlass.Constexpr[int]
    tile_m: cutlass.Constexpr[int]
    m_block: Int32
    head: Int32
    num_rows: Int32
    block_rows: cutlass.Constexpr[int] = 0

    @staticmethod
    def create(qhead_per_kvhead: int, tile_m: int, m_block: Int32, head: Int32, seqlen_q: Int32,
               block_rows: int = 0) -> "TileRows":
        return TileRows(qhead_per_kvhead, tile_m, m_block, head, seqlen_q * qhead_per_kvhead, block_rows)

    @property
    def rows(self) -> int:
        """Rows of the sequence per block (``block_rows`` or ``tile_m``)."""
        return self.block_rows or self.tile_m

    def rows_left(self) -> Int32:
        return self.num_rows - self.m_block * self.rows

    def row_limit(self) -> Int32:
        """Tile row ``r`` holds a row of the sequence iff ``r <`` this."""
        if const_expr(self.rows == self.tile_m):
            return self.rows_left()
        return cutlass.min(self.rows_left(), self.rows)

    def coord(self, r: Int32):
        """``(query position, q head)`` of tile row ``r``."""
        p = self.m_block * self.rows + r
        g = self.qhead_per_kvhead
        if const_expr(g == 1):
            return p, self.head
        q_pos = p // g
        return q_pos, self.head * g + (p - q_pos * g)


def packed_rows_view(mT: cute.Tensor, g: int) -> cute.Tensor:
    """The kernel-boundary ``(b, s, h, d)`` tensor as ``((g, s), d, h // g, b)`` (same memory): mode 0
    is the packed rows of one kv head, head within the group fastest (Note [Packed rows by TMA])."""
    b, s, h, d = mT.shape
    sb, ss, sh, sd = mT.stride
    return cute.make_tensor(mT.iterator,
                            cute.make_layout(((g, s), d, h // g, b), stride=((sh, ss), sd, sh * g, sb)))


def packed_tile(mT: cute.Tensor, g: int, tile_m: int, tile_cols: int, m_block: Int32, head_kv: Int32,
                slot: Int32, offset: Int32, varlen: bool) -> cute.Tensor:
    """Packed tile ``m_block`` of kv head ``head_kv`` in a :func:`packed_rows_view` (or the TMA
    coordinate tensor made over one): ``((g, tile_m / g), tile_cols)``; ``slot`` is the batch index
    (:func:`batch_slot`), ``offset`` a varlen sequence's first position."""
    rows = mT[None, None, head_kv, slot]
    if const_expr(varlen):
        rows = cute.domain_offset(((0, offset), 0), rows)
    return cute.local_tile(rows, ((g, tile_m // g), tile_cols), ((0, m_block), 0))


def partial_slot(split: Int32, batch: Int32, num_batch: Int32, varlen_q: bool) -> Int32:
    """Batch index of split ``split``'s slot in a ``(num_splits * b, ...)`` partial tensor
    (Note [Split-KV partials]; packed Q: ``b = 1``, the slot is the split)."""
    return split if varlen_q else split * num_batch + batch


def batch_slot(batch: Int32, varlen_q: bool) -> Int32:
    """Batch index of a Q-side tensor (Q, O, LSE): the batch, or 0 for a packed ``(1, total, ...)``."""
    return 0 if varlen_q else batch


def _row(mT: cute.Tensor, seqlen: SeqlenInfo, slot: Int32, q_pos: Int32, head: Int32) -> cute.Tensor:
    """The ``(d,)`` row of query position ``q_pos`` of a ``(b, s, h, d)`` tensor (varlen: packed
    ``(1, total, h, d)`` or a partial's slot)."""
    if const_expr(seqlen.varlen_q):
        return mT[slot, seqlen.offset_q + q_pos, head, None]
    return mT[slot, q_pos, head, None]


@cute.jit
def load_q_rows(mQ: cute.Tensor, sQ: cute.Tensor, rows: TileRows, seqlen: SeqlenInfo, slot: Int32, cols: Int32,
                tidx: Int32, num_threads: cutlass.Constexpr[int]) -> None:
    """Q rows of the tile -> the 16-bit ``(tile_m, tile_cols)`` smem tile (any swizzle) with 16-byte
    loads; rows past the sequence and 16-byte chunks at or past ``cols`` are zero. ``slot``: the
    batch index of ``mQ`` (:func:`batch_slot`). The caller fences (``fence_proxy async.shared``)
    and synchronizes before wgmma reads it."""
    tile_rows, tile_cols = cute.size(sQ, mode=[0]), cute.size(sQ, mode=[1])
    per_row = tile_cols // 8
    buf = cute.make_rmem_tensor(cute.make_layout((1, 8)), sQ.element_type)
    rows_left = rows.row_limit()
    for j in cutlass.range(tidx, tile_rows * per_row, num_threads, unroll=1):
        r = j // per_row
        k = j - r * per_row
        buf.fill(0.0)
        if r < rows_left and k * 8 < cols:
            q_pos, head = rows.coord(r)
            src = cute.local_tile(_row(mQ, seqlen, slot, q_pos, head), (8,), (k,))
            cute.autovec_copy(src, buf[0, None])
        cute.autovec_copy(buf, cute.local_tile(sQ, (1, 8), (r, k)))


@cute.jit
def store_rows(sO: cute.Tensor, mO: cute.Tensor, rows: TileRows, seqlen: SeqlenInfo, slot: Int32, cols: Int32,
               tidx: Int32, num_threads: cutlass.Constexpr[int]) -> None:
    """The 16-bit ``(tile_m, tile_cols)`` smem tile of O -> its rows in gmem with 16-byte stores
    (rows of the sequence and chunks ``< cols`` only). The caller synchronizes the writers of sO."""
    tile_rows, tile_cols = cute.size(sO, mode=[0]), cute.size(sO, mode=[1])
    per_row = tile_cols // 8
    buf = cute.make_rmem_tensor(cute.make_layout((1, 8)), sO.element_type)
    rows_left = rows.row_limit()
    for j in cutlass.range(tidx, cutlass.min(rows_left, tile_rows) * per_row, num_threads, unroll=1):
        r = j // per_row
        k = j - r * per_row
        if k * 8 < cols:
            q_pos, head = rows.coord(r)
            cute.autovec_copy(cute.local_tile(sO, (1, 8), (r, k)), buf)
            cute.autovec_copy(buf[0, None], cute.local_tile(_row(mO, seqlen, slot, q_pos, head), (8,), (k,)))


@cute.jit
def store_acc_rows(acc_O: cute.Tensor, thr_mma, mO: cute.Tensor, rows: TileRows, seqlen: SeqlenInfo, slot: Int32,
                   cols: Int32, tile_cols: cutlass.Constexpr[int]) -> None:
    """A float32 accumulator (``thr_mma``'s C partition of the ``(tile_m, tile_cols)`` tile) ->
    the rows of a float32 ``mO`` straight from registers (split-KV partials): rows of the sequence
    and columns ``< cols`` only."""
    acc_mn = make_acc_mn_view(acc_O)
    tOcO = make_acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((rows.tile_m, tile_cols))))
    rows_left = rows.row_limit()
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row = tOcO[r, 0][0]
        if row < rows_left:
            q_pos, head = rows.coord(row)
            g_row = _row(mO, seqlen, slot, q_pos, head)
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                col = tOcO[r, c][1]
                if col < cols:
                    g_row[col] = acc_mn[r, c]


@cute.jit
def row_sinks(mSink: cute.Tensor, thr_mma, rows: TileRows, tile_cols: cutlass.Constexpr[int],
              num_rows: cutlass.Constexpr[int]) -> cute.Tensor:
    """The sink logit of each accumulator row of ``thr_mma``'s C partition of the ``(tile_m,
    tile_cols)`` tile, times ``log2(e)`` (Note [Attention sinks in the softmax] in fa4/softmax.py):
    ``mSink (h,)`` float32 read at the row's q head (packed rows: each row's own head)."""
    cO = cute.make_identity_tensor((rows.tile_m, tile_cols))
    tOcO = make_acc_mn_view(thr_mma.partition_C(cO))
    sinks = cute.make_rmem_tensor(num_rows, Float32)
    for r in cutlass.range_constexpr(num_rows):
        _, head = rows.coord(tOcO[r, 0][0])
        sinks[r] = mSink[head] * Float32(LOG2_E)
    return sinks


@cute.jit
def store_lse_rows(lse: cute.Tensor, thr_mma, mLSE: cute.Tensor, rows: TileRows, seqlen: SeqlenInfo, slot: Int32,
                   tile_cols: cutlass.Constexpr[int]) -> None:
    """The per-row LSE (registers, one value per accumulator row of ``thr_mma``'s C partition of
    the ``(tile_m, tile_cols)`` tile) -> ``mLSE (b, h, s_q)`` (varlen ``(1, h, total_q)``, or a
    partial's slot), by the lane holding column 0 of the row's quad."""
    cO = cute.make_identity_tensor((rows.tile_m, tile_cols))
    tOcO = make_acc_mn_view(thr_mma.partition_C(cO))
    rows_left = rows.row_limit()
    if tOcO[0][1] == 0:
        for r in cutlass.range_constexpr(cute.size(lse)):
            row = tOcO[r, 0][0]
            if row < rows_left:
                q_pos, head = rows.coord(row)
                if const_expr(seqlen.varlen_q):
                    mLSE[slot, head, seqlen.offset_q + q_pos] = lse[r]
                else:
                    mLSE[slot, head, q_pos] = lse[r]
