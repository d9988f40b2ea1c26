"""Causal / sliding-window / sequence-length masks and the block ranges they imply (device).

Convention (DESIGN.md, FlashAttention's): query row ``i`` may see key ``j`` iff

    i + s_k - s_q - window_left  <=  j  <=  i + s_k - s_q + window_right

(bottom-right aligned when ``s_q != s_k``) and ``j < s_k``. Causal is ``window_right = 0`` with no
left bound. ``causal`` / ``local`` are compile-time; the window sizes are runtime ``Int32`` (an
unbounded side of a local window is passed as ``max(s_q, s_k)``). If both flags are set, ``local``
wins and the caller passes ``window_right = 0``.

:class:`AttentionMask` gives:

* ``n_block_range(m_block)`` -> ``[n_min, n_max)``: the K blocks a Q block visits (may be empty);
* ``m_block_range(n_block)`` -> ``[m_min, m_max)``: the Q blocks that see a K block (backward);
* ``n_block_min_no_right_mask(m_block)`` / ``n_block_max_left_mask(m_block)``: the boundaries that
  split a forward loop (walking n from high to low) into masked / unmasked / masked iterations:
  blocks ``>= n_block_min_no_right_mask`` may hold keys right of the window (or the causal
  diagonal), blocks ``< n_block_max_left_mask`` keys left of the window, the rest need no
  window mask (the ``s_k`` bound only matters for the last block, ``ceil(s_k / tile_n) - 1``);
* ``apply(acc_S, thr_mma, m_block, n_block, ...)``: sets masked elements of an ``mma.sync``
  accumulator of the (tile_m x tile_n) S tile to -inf (or of the (tile_n x tile_m) S^T tile with
  ``transpose=True``), for the forward's and the backward's S alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4.cute_utils import make_acc_mn_view, static_coords


# Note [Masks by select]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The element masks set a score to -inf under a runtime condition, once per accumulator element of
# every masked block body (128 at d128, more in the kernels with several masked bodies). Written as
# ``x = -inf if cond else x`` the DSL traces each into an if-region (``scf.if`` with two yields),
# which the pipeline then lowers and folds back into a select; ``cutlass.select_`` emits the select
# itself. The SASS is identical (sm90 forward d64 / d128 causal, d128 without a mask and with a
# window, sm90 backward d128 causal, sm80 forward d128 causal: the same listings), and the cold
# compile of the masked forwards takes 1-18% less on this CPU (two alternating rounds: d64 / d128
# causal -5 to -12%, d128 window -6 to -18%, d256 causal -1 to -6%; the backward, whose masks are
# fewer, within +-2%; RESULTS v0.57).


def _neg_inf_where(cond, x: Float32) -> Float32:
    """``-inf`` where ``cond``, else ``x``: one select, where a runtime ``a if cond else b`` traces an
    if-region (Note [Masks by select])."""
    return Float32(cutlass.select_(cond, Float32(-Float32.inf), x))


@dataclass(frozen=True)
class AttentionMask:
    tile_m: cutlass.Constexpr[int]
    tile_n: cutlass.Constexpr[int]
    causal: cutlass.Constexpr[bool]
    local: cutlass.Constexpr[bool]
    seqlen_q: Int32
    seqlen_k: Int32
    window_left: Int32 = 0
    window_right: Int32 = 0
    qhead_per_kvhead: cutlass.Constexpr[int] = 1
    row_block: cutlass.Constexpr[int] = 0

    @property
    def rows(self) -> int:
        """Packed rows per forward Q block: ``row_block``, or ``tile_m`` (0). A packed tile whose
        rows are ``tile_m // g`` whole positions (Note [Packed rows by TMA] in fa4/pack_gqa.py)
        holds ``(tile_m // g) * g`` of them; its last ``tile_m % g`` MMA rows are padding."""
        return self.row_block or self.tile_m

    @property
    def has_window(self) -> bool:
        return self.causal or self.local

    def _wr(self):
        # Right window: 0 for causal, runtime for local.
        return self.window_right if const_expr(self.local) else 0

    # Rows of a forward Q tile. With pack GQA (``qhead_per_kvhead = g > 1``, Note [Pack GQA] in
    # fa4/pack_gqa.py) tile row ``r`` of block ``m`` is packed row ``m * rows + r``, whose query
    # position is ``(m * rows + r) // g``; ``seqlen_q`` stays the number of query positions.
    # (``rows``: :attr:`rows`, ``tile_m`` unless a packed block holds fewer rows than the tile.)

    def _q_first(self, m_block):
        """Query position of the first row of ``m_block``."""
        if self.qhead_per_kvhead == 1:
            return m_block * self.rows
        return m_block * self.rows // self.qhead_per_kvhead

    def _q_last(self, m_block):
        """Query position of the last row of ``m_block`` (rows clipped to ``seqlen_q``)."""
        g = self.qhead_per_kvhead
        if g == 1:
            return cutlass.min((m_block + 1) * self.rows, self.seqlen_q) - 1
        return (cutlass.min((m_block + 1) * self.rows, self.seqlen_q * g) - 1) // g

    def _q_last_unclipped(self, m_block):
        g = self.qhead_per_kvhead
        return ((m_block + 1) * self.rows - 1) // g if g > 1 else (m_block + 1) * self.rows - 1

    # ----------------------------------------------------------------------------------------
    # Block ranges
    # ----------------------------------------------------------------------------------------

    # Plain Python (no dynamic control flow): the same code runs traced with Int32 sizes and on
    # Python ints (the CPU tests check it against brute force).

    def n_block_range(self, m_block):
        """``(n_min, n_max)``: K blocks with at least one key visible to some row of ``m_block``
        (rows clipped to ``seqlen_q``). Empty (``n_min >= n_max``) when no row sees any key."""
        n_max = cute.ceil_div(self.seqlen_k, self.tile_n)
        n_min = 0
        if self.has_window:
            row_last = self._q_last(m_block)
            # Exclusive bound of the keys the last row sees.
            col_end = row_last + self.seqlen_k - self.seqlen_q + self._wr() + 1
            n_max = cutlass.min(n_max, cute.ceil_div(cutlass.max(col_end, 0), self.tile_n))
        if self.local:
            col_start = self._q_first(m_block) + self.seqlen_k - self.seqlen_q - self.window_left
            n_min = cutlass.max(col_start, 0) // self.tile_n
        return n_min, n_max

    def m_block_range(self, n_block):
        """``(m_min, m_max)``: Q blocks with at least one row that sees a key of ``n_block``
        (keys clipped to ``seqlen_k``). May be empty."""
        m_max = cute.ceil_div(self.seqlen_q, self.tile_m)
        m_min = 0
        if self.has_window:
            # First row that sees the block's first key: i >= j - s_k + s_q - wr.
            row_start = n_block * self.tile_n - self.seqlen_k + self.seqlen_q - self._wr()
            m_min = cutlass.max(row_start, 0) // self.tile_m
        if self.local:
            col_last = cutlass.min((n_block + 1) * self.tile_n, self.seqlen_k) - 1
            # Last row that sees the block's last key: i <= j - s_k + s_q + wl.
            row_end = col_last - self.seqlen_k + self.seqlen_q + self.window_left + 1
            m_max = cutlass.min(m_max, cute.ceil_div(cutlass.max(row_end, 0), self.tile_m))
        return m_min, m_max

    def n_block_min_no_right_mask(self, m_block):
        """Blocks ``n < this`` have no key right of the window for any row of ``m_block`` (the
        causal/local diagonal). Without causal/local: a large value (no block needs it)."""
        if not self.has_window:
            return 2**30
        # Block n is free iff (n + 1) * tile_n - 1 <= first_row + s_k - s_q + wr.
        col_end = self._q_first(m_block) + self.seqlen_k - self.seqlen_q + self._wr() + 1
        return cutlass.max(col_end, 0) // self.tile_n

    def n_block_max_left_mask(self, m_block):
        """Blocks ``n < this`` may hold keys left of the local window for some row of ``m_block``
        (0 without ``local``)."""
        if not self.local:
            return 0
        # Block n is free iff n * tile_n >= last_row + s_k - s_q - wl.
        col_start = self._q_last_unclipped(m_block) + self.seqlen_k - self.seqlen_q - self.window_left
        return cute.ceil_div(cutlass.max(col_start, 0), self.tile_n)

    def m_block_max_no_window_mask(self, n_block):
        """Backward helper: Q blocks ``m >= this`` see every key of ``n_block`` that the window
        allows from the right (no causal/right masking needed); without causal/local: 0."""
        if not self.has_window:
            return 0
        # Row block m is free iff its first row i0 = m * tile_m satisfies
        # (n + 1) * tile_n - 1 <= i0 + s_k - s_q + wr.
        row = (n_block + 1) * self.tile_n - 1 - self.seqlen_k + self.seqlen_q - self._wr()
        return cute.ceil_div(cutlass.max(row, 0), self.tile_m)

    # ----------------------------------------------------------------------------------------
    # Element mask
    # ----------------------------------------------------------------------------------------

    @cute.jit
    def apply_block(self, acc_S: cute.Tensor, thr_mma, m_block: Int32, n_block: Int32,
                    mask_seqlen: cutlass.Constexpr[bool], mask_window: cutlass.Constexpr[bool],
                    window_if=None) -> None:
        """The mask of one forward K block as :func:`walk_blocks` asks for it: :meth:`apply` with
        the compile-time ``mask_seqlen`` / ``mask_window``, or, given the runtime Boolean
        ``window_if`` (``one_step_loop``), the window mask only where it is true."""
        if const_expr(window_if is not None):
            if window_if:
                self.apply(acc_S, thr_mma, m_block, n_block, mask_seqlen=False, mask_window=True)
        elif const_expr(mask_seqlen or mask_window):
            self.apply(acc_S, thr_mma, m_block, n_block, mask_seqlen=mask_seqlen, mask_window=mask_window)

    @cute.jit
    def apply(
        self,
        acc_S: cute.Tensor,
        thr_mma,
        m_block: Int32,
        n_block: Int32,
        mask_seqlen: cutlass.Constexpr[bool] = True,
        mask_window: cutlass.Constexpr[bool] = True,
        transpose: cutlass.Constexpr[bool] = False,
    ) -> None:
        """Set masked elements of the accumulator ``acc_S`` (partitioned by ``thr_mma``) to -inf.

        ``mask_seqlen``: keys ``>= seqlen_k``; ``mask_window``: the causal/local bounds (ignored
        without causal/local). ``transpose``: ``acc_S`` holds S^T, a ``(tile_n, tile_m)`` tile of
        keys x queries. Rows past ``seqlen_q`` are left alone (their outputs are never stored).
        With ``qhead_per_kvhead > 1`` (pack GQA, forward only) rows are packed rows.

        Column bounds are compared against the compile-time coordinates of thread 0
        (``t0ScS``), the thread's own offset being folded into the runtime limit.
        """
        mask_window_ = mask_window and self.has_window
        if const_expr(mask_seqlen or mask_window_):
            shape = (self.tile_m, self.tile_n) if const_expr(not transpose) else (self.tile_n, self.tile_m)
            cS = cute.make_identity_tensor(shape)
            acc_mn = make_acc_mn_view(acc_S)
            tScS = make_acc_mn_view(thr_mma.partition_C(cS))
            t0ScS = make_acc_mn_view(thr_mma.get_slice(0).partition_C(cS))
            # q (row of S) and k (column of S) coordinate of a view element.
            Q, K = (0, 1) if const_expr(not transpose) else (1, 0)
            # Thread 0's coordinates of each view row / column, as Python ints (Note [Static
            # coordinates] in fa4/cute_utils.py).
            coord0 = static_coords(t0ScS)
            row0 = [coord0((r, 0)) for r in range(cute.size(acc_mn.shape[0]))]
            col0 = [coord0((0, c)) for c in range(cute.size(acc_mn.shape[1]))]
            # Offsets of this thread's first element (runtime) in the S tile.
            thr_q = tScS[0][Q]
            thr_k = tScS[0][K]
            # Key j is out of bounds iff its local index (thread 0 coordinates) >= k_limit.
            k_limit = self.seqlen_k - n_block * self.tile_n - thr_k
            if const_expr(not mask_window_):
                if const_expr(not transpose):
                    for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                        oob = col0[c][K] >= k_limit
                        for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                            acc_mn[r, c] = _neg_inf_where(oob, acc_mn[r, c])
                else:
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        oob = row0[r][K] >= k_limit
                        for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                            acc_mn[r, c] = _neg_inf_where(oob, acc_mn[r, c])
            else:
                # Visible iff  q_loc + diag - wl <= k_loc <= q_loc + diag + wr, in thread-0-local
                # units: q_loc is the row's local index and k_loc the column's thread-0 index.
                diag = m_block * self.tile_m + thr_q + self.seqlen_k - self.seqlen_q - n_block * self.tile_n - thr_k
                if const_expr(not transpose):
                    g = self.qhead_per_kvhead
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        # row_diag: the row's diagonal key in thread-0-local key units.
                        if const_expr(g == 1):
                            row_diag = row0[r][Q] + diag
                        else:  # packed rows: the query position is (packed row) // g
                            q_pos = (m_block * self.rows + thr_q + row0[r][Q]) // g
                            row_diag = q_pos + self.seqlen_k - self.seqlen_q - n_block * self.tile_n - thr_k
                        right = row_diag + self._wr() + 1  # exclusive
                        if const_expr(mask_seqlen):
                            right = cutlass.min(right, k_limit)
                        if const_expr(self.local):
                            left = row_diag - self.window_left
                            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                                k_loc = col0[c][K]
                                masked = k_loc >= right or k_loc < left
                                acc_mn[r, c] = _neg_inf_where(masked, acc_mn[r, c])
                        else:
                            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                                acc_mn[r, c] = _neg_inf_where(col0[c][K] >= right, acc_mn[r, c])
                else:
                    # Rows are keys: key k_loc sees queries q_loc with
                    # k_loc - diag - wr <= q_loc <= k_loc - diag + wl.
                    for r in cutlass.range_constexpr(cute.size(acc_mn.shape[0])):
                        k_loc = row0[r][K]
                        q_first = k_loc - diag - self._wr()
                        if const_expr(mask_seqlen):
                            # A key past seqlen_k: every query is masked.
                            q_first = Int32(cutlass.select_(k_loc < k_limit, q_first, Int32(2**30)))
                        if const_expr(self.local):
                            q_last = k_loc - diag + self.window_left
                            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                                q_loc = col0[c][Q]
                                masked = q_loc < q_first or q_loc > q_last
                                acc_mn[r, c] = _neg_inf_where(masked, acc_mn[r, c])
                        else:
                            for c in cutlass.range_constexpr(cute.size(acc_mn.shape[1])):
                                acc_mn[r, c] = _neg_inf_where(col0[c][Q] < q_first, acc_mn[r, c])


@cute.jit
def window_bounds(mask: AttentionMask, m_block: Int32, n_min: Int32, n_max: Int32,
                  uniform: cutlass.Constexpr[bool] = False):
    """``(n_a, n_b)``, the walk's split of a tile's K blocks ``[n_min, n_max)`` by the window: blocks
    ``n >= n_a`` touch its right edge (``n_a <= n_max - 1``: the first block is among them),
    blocks ``n < n_b`` its left one (``n_min <= n_b <= n_a``; ``n_b = n_min`` without ``local``),
    and the blocks between are free. ``uniform``: tell ptxas both are warp-uniform (Note [A
    uniform window branch])."""
    n_a = cutlass.max(cutlass.min(mask.n_block_min_no_right_mask(m_block), n_max - 1), n_min)
    if const_expr(uniform):
        n_a = cute.arch.make_warp_uniform(n_a)
    n_b = cutlass.max(cutlass.min(mask.n_block_max_left_mask(m_block), n_a), n_min)
    if const_expr(uniform):
        n_b = cute.arch.make_warp_uniform(n_b)
    return n_a, n_b


@cute.jit
def edges_first_block(i: Int32, n_max: Int32, n_min: Int32, n_a: Int32, n_b: Int32) -> Int32:
    """The ``i``-th K block of a local tile in the edges-first order (Note [Edges first]): the
    right edge's ``n_max - 1`` down to ``n_a``, the left edge's ``n_b - 1`` down to ``n_min``, then
    the free blocks ``n_a - 1`` down to ``n_b``."""
    right = n_max - n_a
    edges = right + n_b - n_min
    n = n_max - 1 - i
    n = n_b - 1 - (i - right) if i >= right else n
    n = n_a - 1 - (i - edges) if i >= edges else n
    return n


# Note [Edges first]
# ~~~~~~~~~~~~~~~~~~
# A local tile's K blocks fall in three runs: the right edge of the window (from the tile's first
# block, ``n_max - 1``, down to ``n_a``), the free blocks, and the left edge (``n_b - 1`` down to
# ``n_min``). Walked in that order (``n`` descending), the two masked runs sit on either side of
# the free one, so the kernel inlines the masked step twice (or, with ``fold_first``, the folded
# first step and a masked step). With ``edges_first`` the walk visits the right edge, then the
# left edge, then the free blocks: one masked run, so with ``fold_first`` one copy of the masked
# step for both edges (the left edge's blocks take the seqlen mask too, a min per row, and never
# the first block's branch), as a causal tile has. The online softmax does not care in which
# order it sees the blocks; the bits differ from the descending order's (the sums are taken in
# another order), the math does not. The producer must load the blocks in the same order: it
# walks ``edges_first_block``. Only the sm90 forward takes it (its producer is a separate warp);
# sm80's step prefetches block ``n - 1`` itself.


@cute.jit
def walk_blocks(mask: AttentionMask, m_block: Int32, n_min: Int32, n_max: Int32, step, carry,
                one_body: cutlass.Constexpr[bool] = False, uniform_bounds: cutlass.Constexpr[bool] = False,
                first_step=None, edges_first: cutlass.Constexpr[bool] = False):
    """The K blocks of a forward tile after its first (the last block, ``n_max - 1``, which the
    caller runs with the seqlen and window masks, unless ``first_step`` is given: below):
    ``n_max - 2`` down to ``n_min``, each through
    ``carry = step(n, carry, mask_window, window_if)``. Without causal/local every block is free
    (``mask_window=False``). With a window, blocks ``n >= n_a`` touch its right edge and (local)
    ``n < n_b`` its left one: by default three loops, a masked, a free and (local) a masked one, so
    each inlines its own copy of the step; with ``one_body`` one loop and one step body, the window
    mask under the runtime (warp-uniform) ``window_if`` (a smaller kernel to compile). Both visit
    the same blocks and mask the same ones (the clamps of ``n_a``, ``n_b`` only matter where the
    other bound already holds), in the same order unless ``edges_first`` (below) reorders a local
    tile's. ``carry``: the step's loop state (e.g. pipeline
    states). ``uniform_bounds`` (``one_body`` or ``first_step``): tell ptxas the window's bounds
    are warp-uniform (they are: a warp works on one tile), Note [A uniform window branch].

    ``first_step`` (with a window and separate loops): the tile's first block joins the loop over
    the blocks at the window's right edge, ``carry = first_step(n, carry, is_first)`` from
    ``n_max - 1`` with the runtime ``is_first`` true for that block only, so the kernel holds
    one copy of the masked step instead of two (Note [The first block in the masked loop]).
    Only with a window and separate loops: elsewhere the first block would go unrun.

    ``edges_first`` (local windows, separate loops): the left edge's masked blocks right after the
    right edge's, before the free ones (Note [Edges first]); with ``first_step`` both edges run
    through it, in one loop."""
    assert first_step is None or (mask.has_window and not one_body), "first_step needs a window and separate loops"
    assert not (edges_first and one_body), "edges_first needs separate loops"
    if const_expr(mask.has_window and one_body):
        n_a = mask.n_block_min_no_right_mask(m_block)
        n_b = mask.n_block_max_left_mask(m_block)
        if const_expr(uniform_bounds):
            n_a, n_b = cute.arch.make_warp_uniform(n_a), cute.arch.make_warp_uniform(n_b)
        for i in cutlass.range(n_max - 1 - n_min, unroll=1):
            n = n_max - 2 - i
            carry = step(n, carry, True, (n >= n_a) | (n < n_b))
    elif const_expr(mask.has_window and mask.local and edges_first):
        n_a, n_b = window_bounds(mask, m_block, n_min, n_max, uniform_bounds)
        if const_expr(first_step is not None):
            for i in cutlass.range(n_max - n_a + n_b - n_min, unroll=1):
                carry = first_step(edges_first_block(i, n_max, n_min, n_a, n_b), carry, i == 0)
        else:
            for i in cutlass.range(n_max - 1 - n_a, unroll=1):
                carry = step(n_max - 2 - i, carry, True, None)
            for i in cutlass.range(n_b - n_min, unroll=1):
                carry = step(n_b - 1 - i, carry, True, None)
        for i in cutlass.range(n_a - n_b, unroll=1):
            carry = step(n_a - 1 - i, carry, False, None)
    elif const_expr(mask.has_window):
        n_a = cutlass.max(cutlass.min(mask.n_block_min_no_right_mask(m_block), n_max - 1), n_min)
        if const_expr(first_step is not None):
            if const_expr(uniform_bounds):
                n_a = cute.arch.make_warp_uniform(n_a)
            for i in cutlass.range(n_max - n_a, unroll=1):
                carry = first_step(n_max - 1 - i, carry, i == 0)
        else:
            for i in cutlass.range(n_max - 1 - n_a, unroll=1):
                carry = step(n_max - 2 - i, carry, True, None)
        n_b = cutlass.max(cutlass.min(mask.n_block_max_left_mask(m_block), n_a), n_min)
        for i in cutlass.range(n_a - n_b, unroll=1):
            carry = step(n_a - 1 - i, carry, False, None)
        if const_expr(mask.local):
            for i in cutlass.range(n_b - n_min, unroll=1):
                carry = step(n_b - 1 - i, carry, True, None)
    else:
        for i in cutlass.range(n_max - 1 - n_min, unroll=1):
            carry = step(n_max - 2 - i, carry, False, None)
    return carry


# Note [A uniform window branch]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With ``one_body`` every K block runs through one step body and the window mask sits under a
# runtime branch on ``(n >= n_a) | (n < n_b)``. The bounds come from ``m_block``, which reaches
# the consumers through the tile scheduler, so ptxas cannot prove the branch warp-uniform: on
# sm_90a it wraps the mask in convergence barriers (BSSY / BSYNC) and moves the loop's wgmma
# descriptor arithmetic off the uniform datapath (d128 causal: a free block ran 533 SASS
# instructions against the separate loops' 447). Every thread of a warp works on the same tile,
# so the bounds are warp-uniform in fact; ``make_warp_uniform`` on ``n_a`` and ``n_b`` says so,
# and the free block drops to 454 (d64 429 / 422, d192 487 / 481, d256 460 / 453, local within
# +4 to +7 of the separate loops; the masked block equals the masked loop's). On sm_80 the same
# hint adds 38 instructions and spills a little more, so that family does not ask for it
# (``uniform_bounds``). The hint on the predicate itself did not help; a local d96 kernel compiles
# to the same SASS with or without it. tests/test_compile.py checks the d128 causal kernel's
# convergence barriers (18 BSSY without the hint, 2 with it, as with separate loops).
