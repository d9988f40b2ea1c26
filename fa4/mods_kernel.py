"""The device side of user score / mask functions: :class:`UserMods` applies a tile's ``score_mod`` and
``mask_mod`` to an ``S`` accumulator (both families' forward and backward: the sm90 backward's is
``S^T``, and its dQ pass's ``S``; conventions and keys: :mod:`fa4.mods`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Float32, Int32, const_expr

from fa4.cute_utils import static_coords
from fa4.mods import vec_size


# The kernel dtypes of aux tensors (fa4.mods.AUX_DTYPES).
AUX_DTYPES = {"float32": Float32, "float16": cutlass.Float16, "bfloat16": cutlass.BFloat16, "int32": Int32,
              "int64": cutlass.Int64, "int8": cutlass.Int8, "uint8": cutlass.Uint8}


def fake_aux(aux: tuple):
    """Fake tensors of a config's ``aux`` signature (``((dtype, ndim), ...)``; None when empty): any
    shape, any strides but the last (1), element-aligned; scalars (ndim 0) as runtime ``Int32`` /
    ``Float32`` arguments; a kernel's ``mAux`` argument at compile time."""
    if not aux:
        return None
    out = []
    for dtype, ndim in aux:
        dt = AUX_DTYPES[dtype]
        if ndim == 0:
            out.append(dt(0))
            continue
        # The last stride a constant 1 (Note [Aux tensors' unit stride] in fa4/mods.py).
        out.append(cute.runtime.make_fake_tensor(dt, tuple(cute.sym_int() for _ in range(ndim)),
                                                 tuple(cute.sym_int64() for _ in range(ndim - 1)) + (1,),
                                                 assumed_align=dt.width // 8))
    return tuple(out)


def _ssa(values: list, dtype) -> cute.TensorSSA:
    t = cute.make_rmem_tensor(len(values), dtype)
    for j, x in enumerate(values):
        t[j] = x
    return t.load()


def add_nsw(a, b) -> Int32:
    """``a + b`` (Int32) marked as never wrapping (``nsw``): a position plus a constant offset, whose
    64-bit index may then fold into an address as an immediate (Note [Score positions]; the
    compilers folded it without the flag too, in the measured build)."""
    from cutlass._mlir.dialects import arith

    a, b = Int32(a), Int32(b)
    return Int32(arith.addi(a.ir_value(), b.ir_value(), overflow_flags=arith.IntegerOverflowFlags.nsw))


@dataclass(frozen=True)
class _Positions:
    """The positions of a thread's accumulator elements (:meth:`UserMods._positions`): ``row`` and
    ``col``, the tile-level query row and key of its first element; ``coord0``, thread 0's
    coordinate of element ``i`` (its offset from the first, the same for every thread; Python ints:
    Note [Static coordinates] in fa4/cute_utils.py); ``r`` / ``c``, which coordinate is the row /
    the key; ``clamp_keys``, whether keys are clamped below ``seqlen_k``; ``folds``, whether the loop
    over the scores is unrolled at trace time (Note [Score positions])."""

    row: Any
    col: Any
    coord0: Any
    r: int
    c: int
    clamp_keys: bool
    folds: bool

    def offset(self, i):
        """Element ``i``'s (row, key) offset from the first: Python ints for an int ``i``."""
        e = self.coord0(i)
        return e[self.r], e[self.c]


# Note [Score positions]
# ~~~~~~~~~~~~~~~~~~~~~~
# A user function receives each score's query and key position as Int32 and indexes its aux
# tensors with them: the document mask reads ``ids[b, kv_idx]`` for each of the thread's 32 key
# columns per step. The positions are computed as the thread's first row / key (runtime, once per
# block) plus element ``i``'s offset from it, the same for every thread: thread 0's coordinate,
# a Python int (Note [Static coordinates] in fa4/cute_utils.py). That needs the loop over the
# scores unrolled at trace time (``range_constexpr``): a loop unrolled by the compiler, as before,
# made the offsets runtime values in the IR, and the unrolled 64-bit address of each column stayed
# its own computation (sign extension, LEA / LEA.HI.X, IMAD: two to five instructions a column, and
# the largest source of ncu's dispatch stalls in that step). With the offsets constants (added
# ``nsw``) and the aux tensor's last stride the constant 1 (Note [Aux tensors' unit stride] in
# fa4/mods.py), the 32 loads of a step share one address with immediate offsets.
#
# Keys are clamped below seqlen_k only where the caller says a block can reach past it
# (``clamp_keys``: the forward's and dQ pass's first, length-masked block); a ``min`` per column
# would give each its own address again. Query rows are still clamped (two rows per thread in the
# forward; the sm90 backward's S^T has queries as columns and clamps them: no fold there). The
# trace-time unroll costs compile time (the user functions traced once per score), so it is kept to
# where a fold can happen (``_Positions.folds``: aux tensors, the forward's S, keys unclamped);
# elsewhere the compiler unrolls a runtime loop over the same positions (thread 0's coordinates
# then read from its partition in the IR). v0.37, this CPU: relative-bias backward 1.8-2.1 s with
# the unroll everywhere, 1.0-1.3 s without (main before it 1.2 s).
# The positions' assumption (every thread's coordinates are its first element's plus thread 0's)
# is checked for the MMAs in use by tests/test_static_coords.py.
#
# Measured (H200, document mask b2 s8k h16 d128, ``--offgrid``, two interleaved runs of two rounds
# each against main): the step 892 -> 642 SASS instructions; forward 2.86 -> 1.77-1.90 ms
# (flash-attn-4 2.19). The sm80 forward's loop (this CPU, SASS only): 1,626 -> 1,274 instructions.

@dataclass(frozen=True)
class UserMods:
    """The user functions of one tile (a forward tile, or a backward step): ``head`` is the q
    head, or the kv head when the tile packs ``qhead_per_kvhead`` q heads (Note [Pack GQA] in
    fa4/pack_gqa.py)."""

    score_mod: cutlass.Constexpr
    mask_mod: cutlass.Constexpr
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    qhead_per_kvhead: cutlass.Constexpr[int]
    batch: Int32
    head: Int32
    seqlen: Any  # fa4.seqlen.SeqlenInfo
    aux: Any = None  # tuple of the call's aux tensors (gmem cute.Tensor), then its aux scalars, or None
    transpose: cutlass.Constexpr[bool] = False  # the tile is S^T (keys x queries: the backward's)
    score_mod_bwd: cutlass.Constexpr = None  # the score_mod's derivative (the backward's apply_bwd)
    backward: cutlass.Constexpr[bool] = False  # query rows / columns past the sequence feed dK / dV sums
    # Block skipping (fa4/block_sparse.py): the user's own mask_mod inside the call's table mask
    # (None: none), how many of ``aux``'s tensors are the user's (the table follows them), and
    # whether a kernel block can touch table entries of several states.
    inner_mask: cutlass.Constexpr = None
    inner_slot: cutlass.Constexpr[int] = 0
    mixed: cutlass.Constexpr[bool] = True

    @property
    def tensors(self):
        """The aux tensors (a tuple), or None without them (``aux`` holds the tensors, then the scalars)."""
        found = tuple(a for a in (self.aux or ()) if not isinstance(a, cutlass.Numeric))
        return found if found else None

    @property
    def scalars(self):
        """The aux scalars (a tuple of ``Int32`` / ``Float32``), or None without them."""
        found = tuple(a for a in (self.aux or ()) if isinstance(a, cutlass.Numeric))
        return found if found else None

    def _positions(self, thr_mma, m_block: Int32, n_block: Int32, clamp_keys: bool = True) -> "_Positions":
        """Where the thread's accumulator elements lie (Note [Score positions]): the tile-level query
        row and key of this thread's first element (runtime) and thread 0's coordinates (each
        element's offset from the first, Python ints). ``clamp_keys``: with aux tensors, keys are
        clamped below ``seqlen_k`` (:meth:`_coords`); only a block that can reach past the sequence
        needs it."""
        shape = (self.tile_n, self.tile_m) if const_expr(self.transpose) else (self.tile_m, self.tile_n)
        ident = cute.make_identity_tensor(shape)
        first = thr_mma.partition_C(ident)[0]
        coord0 = static_coords(thr_mma.get_slice(0).partition_C(ident))
        r, c = (1, 0) if const_expr(self.transpose) else (0, 1)
        # Unrolled at trace time only where a table read at the keys can fold (forward S, keys unclamped).
        folds = self.tensors is not None and not self.transpose and not clamp_keys
        return _Positions(m_block * self.tile_m + first[r], n_block * self.tile_n + first[c], coord0, r, c,
                          clamp_keys, folds)

    def _coords(self, pos: "_Positions", i: int):
        """(q head, query position, key position) of accumulator element ``i``; with aux tensors the
        positions are clamped into the sequence (fa4/mods.py: a table indexed by them is never read
        out of bounds; the rows and keys past the sequence are dropped or masked). The key is the
        thread's first key plus a constant, added without signed wrap (Note [Score positions])."""
        g = self.qhead_per_kvhead
        dr, dc = pos.offset(i)
        prow = add_nsw(pos.row, dr)
        k = add_nsw(pos.col, dc)
        if const_expr(g == 1):
            h, q = self.head, prow
        else:
            q = prow // g
            h = self.head * g + (prow - q * g)
        if const_expr(self.tensors is not None):
            q = cutlass.min(q, self.seqlen.seqlen_q - 1)
            if const_expr(pos.clamp_keys):
                k = cutlass.min(k, self.seqlen.seqlen_k - 1)
        return h, q, k

    def _row_inside(self, pos: "_Positions", i: int):
        """Whether accumulator element ``i``'s query lies inside the sequence (its packed row below
        ``seqlen_q * qhead_per_kvhead``)."""
        return pos.row + pos.offset(i)[0] < self.seqlen.seqlen_q * self.qhead_per_kvhead

    def _vec(self, fn, n: int) -> int:
        """Scores per call of ``fn`` (:func:`fa4.mods.vec_size`), 1 where it does not divide ``n``."""
        vec = vec_size(fn, self.tensors is not None)
        return vec if n % vec == 0 else 1

    def _vector(self, pos: "_Positions", i, vec: int):
        """(q heads, query positions, key positions) of accumulator elements ``i .. i + vec - 1``."""
        heads, qs, ks = [], [], []
        for j in range(vec):
            h, q, k = self._coords(pos, i + j)
            heads.append(h)
            qs.append(q)
            ks.append(k)
        return heads, qs, ks

    def _call(self, fn, leading: list, vec: int, heads, qs, ks) -> cute.Tensor:
        """``fn(*leading, batch, head, q_idx=, kv_idx=, seqlen_info=, aux_tensors=)`` on ``vec`` scores
        (flash_attn.cute's calling convention; ``aux_scalars=`` too where the call has them); its
        result in a float32 register tensor."""
        extra = {"aux_scalars": self.scalars} if const_expr(self.scalars is not None) else {}
        tensors = self.tensors
        out = fn(*leading, _ssa([self.batch] * vec, Int32), _ssa(heads, Int32), q_idx=_ssa(qs, Int32),
                 kv_idx=_ssa(ks, Int32), seqlen_info=self.seqlen,
                 aux_tensors=tensors if const_expr(tensors is not None) else (), **extra)
        res = cute.make_rmem_tensor(vec, Float32)
        res.store(out)
        return res

    @cute.jit
    def apply_bwd(self, acc_dS: cute.Tensor, raw_S: cute.Tensor, thr_mma, m_block: Int32, n_block: Int32,
                  softmax_scale) -> None:
        """The backward through the score_mod, in place: ``dS <- score_mod_bwd(dS, raw_S * softmax_scale)``,
        ``dS`` the gradient with respect to the score_mod's output, ``raw_S`` the ``Q K^T`` it read
        (the same pairs and indices as :meth:`apply`); the result is the gradient with respect to
        ``Q K^T * softmax_scale`` (the caller's dQ / dK carry the last ``softmax_scale``)."""
        pos = self._positions(thr_mma, m_block, n_block)
        n = cute.size(acc_dS)
        # The derivative's own __vec_size__, else the score_mod's (flash-attn-4 reads none of it).
        vec = self._vec(self.score_mod_bwd if hasattr(self.score_mod_bwd, "__vec_size__") else self.score_mod, n)
        for i in cutlass.range(0, n, vec, unroll_full=True):  # (no fold: Note [Score positions])
            heads, qs, ks = self._vector(pos, i, vec)
            grads = [acc_dS[i + j] for j in range(vec)]
            scores = [raw_S[i + j] * softmax_scale for j in range(vec)]
            res = self._call(self.score_mod_bwd, [_ssa(grads, Float32), _ssa(scores, Float32)], vec, heads, qs, ks)
            for j in cutlass.range_constexpr(vec):
                # A score P = 0 has no gradient (masked, hidden, or a padded row), whatever the
                # derivative says there (0 * inf would be NaN).
                acc_dS[i + j] = res[j] if grads[j] != 0.0 else Float32(0.0)

    @cute.jit
    def apply(self, acc_S: cute.Tensor, thr_mma, m_block: Int32, n_block: Int32, softmax_scale,
              mask_mode=None, clamp_keys: cutlass.Constexpr[bool] = True) -> None:
        """``score_mod`` on every score of the tile (times ``softmax_scale`` first), then
        ``mask_mod`` (-inf where it is False), in place on an ``S`` accumulator (``transpose``: the
        sm90 backward's ``S^T``, whose adjacent pairs are two queries of one key; ``backward``: a
        score_mod's output for queries past the sequence becomes -inf). One pass over the thread's
        scores, ``vec`` adjacent ones at a time: their coordinates are computed once for both
        functions. ``mask_mode`` (block skipping: a runtime, warp-uniform :class:`BlockSkip` mode):
        WHOLE calls no mask function, INNER the user's own (``inner_mask``), MIXED the table's; the
        mask then takes a pass of its own. ``clamp_keys``: whether this block's keys can reach past
        ``seqlen_k`` (a table read at them is then clamped; Note [Score positions])."""
        pos = self._positions(thr_mma, m_block, n_block, clamp_keys)
        n = cute.size(acc_S)
        vec = 1
        if const_expr(self.score_mod is not None):
            vec = self._vec(self.score_mod, n)
        if const_expr(mask_mode is None):
            self._pass(acc_S, pos, n, vec, softmax_scale, True, True)
        else:
            self._pass(acc_S, pos, n, vec, softmax_scale, True, False)
            if const_expr(self.mixed):
                if mask_mode == BlockSkip.MIXED:
                    self._pass(acc_S, pos, n, vec, softmax_scale, False, True)
            if const_expr(self.inner_mask is not None):
                if mask_mode == BlockSkip.INNER:
                    self._pass(acc_S, pos, n, vec, softmax_scale, False, True, True)

    @cute.jit
    def _pass(self, acc_S, pos, n: cutlass.Constexpr[int], vec: cutlass.Constexpr[int], softmax_scale,
              do_score: cutlass.Constexpr[bool], do_mask: cutlass.Constexpr[bool],
              inner: cutlass.Constexpr[bool] = False) -> None:
        """One pass of :meth:`apply` over the scores: the score_mod (``do_score``), the mask_mod
        (``do_mask``; ``inner``: the user's own inside a block-sparse call's table mask, with its
        own aux tensors), or both."""
        do_score = do_score and self.score_mod is not None
        mask_fn, mask_aux = self.mask_mod, self.tensors
        if const_expr(inner):
            mask_fn = self.inner_mask
            mask_aux = self.tensors[:self.inner_slot] if const_expr(self.inner_slot > 0) else None
        do_mask = do_mask and mask_fn is not None
        if const_expr(do_score or do_mask):
            if const_expr(pos.folds):
                for i in cutlass.range_constexpr(0, n, vec):
                    self._pass_at(acc_S, pos, i, vec, softmax_scale, do_score, do_mask, mask_fn, mask_aux)
            else:
                for i in cutlass.range(0, n, vec, unroll_full=True):
                    self._pass_at(acc_S, pos, i, vec, softmax_scale, do_score, do_mask, mask_fn, mask_aux)

    @cute.jit
    def _pass_at(self, acc_S, pos, i, vec: cutlass.Constexpr[int], softmax_scale,
                 do_score: cutlass.Constexpr[bool], do_mask: cutlass.Constexpr[bool], mask_fn, mask_aux) -> None:
        """:meth:`_pass` on scores ``i .. i + vec - 1`` (``i`` a Python int where ``pos.folds``)."""
        heads, qs, ks = self._vector(pos, i, vec)
        if const_expr(do_score):
            scores = [acc_S[i + j] * softmax_scale for j in range(vec)]
            res = self._call(self.score_mod, [_ssa(scores, Float32)], vec, heads, qs, ks)
            for j in cutlass.range_constexpr(vec):
                if const_expr(self.backward):
                    # Queries past the sequence: P must be 0 there (their lse_log2 is +inf),
                    # whatever the score_mod made of the scores (+inf or NaN would reach dV / dK).
                    inside = self._row_inside(pos, i + j)
                    acc_S[i + j] = res[j] if inside else -Float32.inf
                else:
                    acc_S[i + j] = res[j]  # (forward, dQ pass: rows past the sequence are not stored)
        if const_expr(do_mask):
            extra = (self.scalars,) if const_expr(self.scalars is not None) else ()
            for j in cutlass.range_constexpr(vec):
                keep = mask_fn(_ssa([self.batch], Int32), _ssa([heads[j]], Int32),
                               _ssa([qs[j]], Int32), _ssa([ks[j]], Int32), self.seqlen, mask_aux, *extra)
                if const_expr(isinstance(keep, cute.TensorSSA)):
                    keep = keep[0]
                acc_S[i + j] = acc_S[i + j] if keep else -Float32.inf

# Note [Narrowing by ballot]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~
# Every thread of a block-skipping forward (the producer warp and each consumer) narrows its tile's
# K range to the visible blocks at the tile's start (``BlockSkip.narrow``). Read one block at a
# time (four loads in flight), a row of 64 blocks (s8k) takes 16 dependent trips to L1 / L2 before
# the tile can start: by latency alone (300-600 cycles a trip from L2) up to two block steps of
# d128 (v0.37's hypothesis for the block-sparse forward at 0.90-0.95x flash-attn-4; not measured).
# A warp now reads 32 blocks' entries in one trip, a block per lane, and one ``vote.ballot`` gives
# every lane the same 32-bit mask of visible blocks: the lowest set bit (``clz(brev)``) and the
# highest (``clz``) give the range. Two trips for 64 blocks. The per-block reads of the walk itself
# (the producer's ``visible``, the consumers' ``state``) are unchanged. Measured (v0.38, H100, the
# block-sparse document lists forward, b2 s8k h16 d128, three runs of two rounds beside the scan):
# 0.503-0.522 -> 0.488-0.509 ms, -2 to -3% (flash-attn-4 0.455-0.473): the scan was part of the
# gap, not most of it.

@dataclass(frozen=True)
class BlockSkip:
    """Which K blocks of one forward tile a block-sparse call hides (Note [Block sparsity as a block
    table] in fa4/block_sparse.py): ``table`` is the call's int8 ``(B, H, Mb, Nb)`` block table
    (0 hidden, 1 through the mask_mod, 2 whole) in sparse blocks of ``block_q`` x ``block_k``
    tokens; kernel block ``n`` of tile ``m_block`` is hidden when every table entry its rows and
    keys touch is 0 (then skipping it changes nothing: the table's mask function would hide all its
    scores). The backward asks the transposed question of a K block (:meth:`narrow_rows`)."""

    table: Any  # cute.Tensor, int8 (B, H, Mb, Nb)
    block_q: cutlass.Constexpr[int]
    block_k: cutlass.Constexpr[int]
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    batch: Int32
    head: Int32
    m_block: Int32

    # How a visible block's scores are masked (:meth:`state`; UserMods.apply's ``mask_mode``).
    MIXED, WHOLE, INNER = 0, 1, 2

    @staticmethod
    def spans(tile: int, block: int) -> int:
        """The most sparse blocks ``tile`` consecutive positions, starting at a multiple of ``tile``,
        can touch (exact where one size divides the other)."""
        if block % tile == 0:
            return 1
        if tile % block == 0:
            return tile // block
        return (tile + block - 2) // block + 1

    # Table entries a kernel block may read to decide whether it is hidden (:meth:`visible`); over
    # this (sparse blocks much smaller than the tile) the blocks are all computed.
    MAX_READS: ClassVar[int] = 16

    @staticmethod
    def table_fits(block_table: tuple, tile_m: int, tile_n: int) -> tuple:
        """A kernel config's ``block_skip`` (host): ``block_table`` (``AttnProblem.block_table``:
        ``(aux slot, block_q, block_k)``, or ``()``) where a ``tile_m`` x ``tile_n`` kernel block
        reads at most :attr:`MAX_READS` table entries, else ``()``."""
        if not block_table:
            return ()
        _, bq, bk = block_table
        if BlockSkip.spans(tile_m, bq) * BlockSkip.spans(tile_n, bk) > BlockSkip.MAX_READS:
            return ()
        return tuple(block_table)

    @staticmethod
    def uniform(tile_m: int, tile_n: int, block_q: int, block_k: int) -> bool:
        """Whether every kernel block lies in one sparse block (so its state is never mixed)."""
        return BlockSkip.spans(tile_m, block_q) == 1 and BlockSkip.spans(tile_n, block_k) == 1

    def _entries(self, n: Int32, m_block=None, head=None) -> list:
        """The table entries kernel block ``(m_block, n)`` of q head ``head`` touches (by default the
        tile's ``m_block`` and ``head``), clamped at the table's edges: an entry read twice changes
        nothing."""
        m_block = self.m_block if m_block is None else m_block
        head = self.head if head is None else head
        last_row = self.table.shape[2] - 1
        last_col = self.table.shape[3] - 1
        r0 = m_block * self.tile_m // self.block_q
        c0 = n * self.tile_n // self.block_k
        rows, cols = BlockSkip.spans(self.tile_m, self.block_q), BlockSkip.spans(self.tile_n, self.block_k)
        r1 = r0 if rows == 1 else cutlass.min((m_block * self.tile_m + self.tile_m - 1) // self.block_q, last_row)
        c1 = c0 if cols == 1 else cutlass.min((n * self.tile_n + self.tile_n - 1) // self.block_k, last_col)
        out = []
        for dr in range(rows):
            for dc in range(cols):
                r = r0 if dr == 0 else cutlass.min(r0 + dr, r1)
                c = c0 if dc == 0 else cutlass.min(c0 + dc, c1)
                out.append(Int32(self.table[self.batch, head, r, c]))
        return out

    @cute.jit
    def visible(self, n: Int32):
        """Whether kernel block ``n`` has any table entry that is not 0 (a warp-uniform Boolean)."""
        seen = Int32(0)
        for e in self._entries(n):
            seen = seen | e
        return seen != 0

    @cute.jit
    def state(self, n: Int32, m_block=None, head=None):
        """``(visible, mode)`` of kernel block ``n`` (of ``m_block`` and q head ``head``, by default
        the tile's) from one read of its entries: ``mode`` WHOLE when every entry is 2, INNER when
        every entry is 1 (the user's mask_mod alone decides), else MIXED (the table's mask function,
        element by element; a hidden block is MIXED, so the table hides all its scores)."""
        seen, all2, all1 = Int32(0), Int32(1), Int32(1)
        for e in self._entries(n, m_block, head):
            seen = seen | e
            all2 = all2 & Int32(e == 2)
            all1 = all1 & Int32(e == 1)
        mode = Int32(BlockSkip.MIXED)
        if all2 != 0:
            mode = Int32(BlockSkip.WHOLE)
        if all1 != 0:
            mode = Int32(BlockSkip.INNER)
        return seen != 0, mode

    @cute.jit
    def narrow(self, n_min: Int32, n_max: Int32):
        """``[lo, hi)``: the range from the lowest visible block of ``[n_min, n_max)`` to the highest
        (``lo >= hi`` when none is visible), so the tile's first block (``hi - 1``) is one it computes.
        A warp reads 32 blocks' entries at once, a block a lane, and takes their visibility by one
        ballot (Note [Narrowing by ballot]); every lane of the calling warp must take part."""
        return ballot_range(n_min, n_max, self.visible)

    @cute.jit
    def visible_rows(self, m_block: Int32, n: Int32, head0: Int32, num_heads: Int32):
        """Whether kernel block ``(m_block, n)`` has a table entry that is not 0 for any of the q
        heads ``[head0, head0 + num_heads)``."""
        seen = Int32(0)
        for i in cutlass.range(num_heads, unroll=1):
            for e in self._entries(n, m_block, head0 + i):
                seen = seen | e
        return seen != 0

    @cute.jit
    def narrow_rows(self, n: Int32, m_min: Int32, m_max: Int32, head0: Int32, num_heads: Int32):
        """The backward's :meth:`narrow`: ``[lo, hi)`` from the lowest m_block of ``[m_min, m_max)``
        that K block ``n`` is visible to, for any of the q heads ``[head0, head0 + num_heads)`` (a
        GQA group), to the highest (Note [Block skip in the backward] in fa4/bwd/sm90.py). The tile's
        own ``m_block`` and ``head`` are not read. A table broadcast over the heads (stride 0) is read
        for one head. Every lane of the calling warp must take part."""
        heads = num_heads
        if self.table.stride[1] == 0:
            heads = Int32(1)
        return ballot_range(m_min, m_max, lambda m: self.visible_rows(m, n, head0, heads))


def check_block_skip(cfg, name: str, **refused) -> None:
    """A kernel config's ``block_skip`` (host, ``can_implement``): ``aux[slot]`` must be the call's
    int8 4-D block table, and each ``refused`` flag (a field name: its value) false; ValueError
    naming them."""
    if not cfg.block_skip:
        return
    slot = cfg.block_skip[0]
    bad = [k for k, v in refused.items() if v]
    if not (0 <= slot < len(cfg.aux) and cfg.aux[slot] == ("int8", 4)) or bad:
        raise ValueError(f"{name}.block_skip {cfg.block_skip} needs aux[{slot}] an int8 4-D block table"
                         + (f" and not {', '.join(bad)}" if bad else "") + " (Note [Block sparsity as a block "
                         "table] in fa4/block_sparse.py)")


def block_mods(mask_mod, block_skip: tuple, tile_m: int, tile_n: int) -> dict:
    """:class:`UserMods`' block-skipping fields of a kernel with ``block_skip`` (``(aux slot, block_q,
    block_k)``; ``{}`` without): the user's own mask_mod inside the table's (``_fa4_inner``,
    fa4/block_sparse.py), its aux tensors' count, whether a ``tile_m`` x ``tile_n`` kernel block can
    mix states."""
    if not block_skip:
        return {}
    slot, bq, bk = block_skip
    return dict(inner_mask=getattr(mask_mod, "_fa4_inner", None), inner_slot=slot,
                mixed=not BlockSkip.uniform(tile_m, tile_n, bq, bk))


@cute.jit
def ballot_range(lo_in: Int32, hi_in: Int32, visible):
    """``[lo, hi)``: the lowest and (one past) the highest ``i`` in ``[lo_in, hi_in)`` with
    ``visible(i)`` (``lo >= hi`` when none is), 32 at a time: a lane an index, one ``vote.ballot``
    per 32 (Note [Narrowing by ballot]). Every lane of the calling warp must take part."""
    lo, hi = hi_in, cutlass.min(lo_in, hi_in)
    lane = cute.arch.lane_idx()
    for base in cutlass.range(lo_in, hi_in, 32, unroll=1):
        i = base + lane
        seen = Boolean(False)
        if i < hi_in:
            seen = visible(i)
        bits = cute.arch.vote_ballot_sync(seen)
        if bits != 0:
            lo = cutlass.min(lo, base + Int32(cute.arch.clz(cute.arch.brev(bits))))
            hi = cutlass.max(hi, base + 32 - Int32(cute.arch.clz(bits)))
    return lo, hi
