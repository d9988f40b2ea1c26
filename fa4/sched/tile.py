"""Tile order for non-persistent grids: ``blockIdx.x -> (m_block, head, batch)``.

Kernels ask a scheduler for their tile and never know the order (:class:`TileScheduler`).

:class:`SectionTileScheduler` launches a 1-D grid of ``num_m_blocks * heads * batch`` CTAs. The
(head, batch) pairs are cut into *sections* of ``section`` pairs whose K/V fit in about half the L2
(:func:`l2_section_size`); inside a section CTAs walk m-blocks slowest and pairs fastest, so the
CTAs resident at once share the K/V of a few heads. With ``reverse`` (LPT: causal, local, varlen)
the m-blocks are walked from the last to the first: the longest tiles start first and the short
ones fill the tail of the grid. Heads are the fastest index of a pair, so the q heads of one kv head
(GQA) are neighbours.

Note [Section sizes]
    With LPT inside sections, each section's tiles run from long to short, and the kernel ends
    when the last section's longest tiles do. A section of fewer tiles than about a wave of CTAs
    (d256 s8k causal with 8 MB sections: one (head, batch) pair, 64 tiles for 132 SMs) leaves its
    long tiles to the last half-wave: a greedy model of the dynamic scheduler (tile time = K blocks
    + 2) puts the SMs' useful share at 0.90 there, against 0.995 with 2, 4 or 8 pairs, and ncu
    measured 89% of the cycles active. A pair count that does not divide the pairs leaves a small
    last section with the same tail (3 pairs of 16: 0.865), hence the power of two.

For varlen, ``num_m_blocks`` is ``ceil(max_seqlen_q / tile_m)``; tiles past a sequence's own
length are empty and the kernel skips them.

Note [Compact varlen grid]
    A varlen grid of ``ceil(max_len / tile) * batch`` blocks per head launches, on a batch of mixed
    lengths, many CTAs past their sequence's end (the off-grid mixed batch: 107 of 240 per kv head
    in the sm90 backward), each paying a launch and a prologue on an SM that one CTA fills. The
    compact grid gives sequence ``b`` the slots ``[S_b, S_{b+1})`` with ``S_b = (cu[b] - cu[0]) * g
    // tile + b`` (``g``: rows per token, a packed forward's q heads per kv head, else 1):
    ``S_{b+1} - S_b >= ceil(len_b * g / tile)``, so every block has a slot, at most one slot per
    sequence is empty, and ``rows * g // tile + batch`` slots per head cover the batch for any packed
    tensor of ``rows >= cu[-1] - cu[0]`` rows: known on the host without reading ``cu``. Grid index
    ``i`` lies in batch ``b``, the last with ``heads * S_b <= i`` (a warp's ballot over ``cu``, 32
    sequences per load: :func:`compact_batch`); inside a batch's ``heads * slots`` indices, sections
    of heads walk the slots slowest and the heads fastest, as :func:`section_tile` does
    (:func:`compact_slot`); a section is the lowest power of two of the given section and of the head
    count, so it divides the heads and never spans two batches. With LPT (``reverse``) a sequence's
    blocks run from its last (longest) one down. Indices past the last sequence's slots (a packed
    tensor longer than the batch) map to an empty slot of it. :func:`compact_tile` is the mapping,
    for the sm90 backward's K blocks and :class:`CompactVarlenTileScheduler`'s forward tiles;
    :func:`host_compact_tiles` its Python twin.

    A caller that omits ``max_seqlen_q`` / ``max_seqlen_k`` (flash_attn.cute makes them optional)
    leaves fa4 the packed token count as the longest sequence, an upper bound: the plain grid then
    has ``ceil(total / tile) * batch`` blocks per head, most of them past their sequence, while the
    compact grid's size does not depend on it. :func:`loose_bound` says when the longest length is
    more than ``LOOSE_BOUND_RATIO`` times the average (a call without the lengths, or a batch with
    one long sequence among short ones). The sm90 forward takes the compact grid where the call gave
    no ``max_seqlen_q`` (``COMPACT_WITHOUT_LENGTHS``, on); the families' wider ``COMPACT_LOOSE_BOUND``
    rules (any loose bound) are off. Where a side's longest length is the shapes' bound itself
    (:func:`shape_bound`: the call did not give it), the sm90 forward on the compact grid judges its
    tile, packing and split count on the average length, and the backward its launch sections
    (:func:`loose_plan`); a given length, however skewed the batch (a chunked prefill among decode
    rows), is the one they are judged on. Measured (v0.38, H100, ``tools/device_run.sh next30e``):
    calls without the lengths ran the forward 8-13% slower than with them on the default grids
    (decode with GQA: 1.9x, its rows unpacked) and the causal GQA backward 1.45x slower (its
    sections: one pair each, judged on the bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Tuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr
from cutlass._mlir.dialects import nvvm as _nvvm  # (the scope enum of cute.arch.mbarrier_arrive)

L2_BUDGET_BYTES = 24 * 1024 * 1024
"""K/V bytes a section may touch: about half an A100 / H100 / H200 L2 (40-50 MB)."""


class TileScheduler(Protocol):
    def tile(self) -> Tuple[Int32, Int32, Int32]:
        """(m_block, head, batch) of this CTA."""
        ...


def floor_pow2(n):
    """The largest power of two ``<= min(n, 2**20)`` (1 for ``n < 2``); Python ints or DSL Int32
    (min / max / shifts only, no branch; 20 steps, each traced op costs compile time)."""
    p = 1
    for k in range(1, 21):
        p = cutlass.max(p, cutlass.min(1 << k, (n >> k) << k))
    return p


def l2_section_size(seqlen_k, kv_row_bytes: int, qhead_per_kvhead, num_pairs, budget: int = L2_BUDGET_BYTES,
                    pow2: bool = False):
    """Pairs per section: as many (head, batch) pairs as share ``budget`` bytes of K/V
    (``seqlen_k * kv_row_bytes`` per kv head, shared by ``qhead_per_kvhead`` q heads), at least
    one, at most ``num_pairs``; with ``pow2`` rounded down to a power of two first (Note [Section
    sizes]; the sm90 forward). Works on Python ints and on DSL Int32 (host side of a jit)."""
    # budget // (row_bytes * seqlen_k), dividing twice to stay in 32 bits.
    per_section = cutlass.max(((budget // kv_row_bytes) // cutlass.max(seqlen_k, 1)) * qhead_per_kvhead, 1)
    if pow2:
        per_section = floor_pow2(per_section)
    return cutlass.min(per_section, num_pairs)


def section_tile(tile_idx, num_m_blocks, num_heads, num_batch, section, reverse: bool):
    """``tile_idx -> (m_block, head, batch)`` (see the module docstring). Plain arithmetic: runs
    traced on Int32 and on Python ints (the CPU tests check it is a bijection)."""
    num_pairs = num_heads * num_batch
    section_tiles = num_m_blocks * section
    sec = tile_idx // section_tiles
    rest = tile_idx - sec * section_tiles
    first_pair = sec * section
    # The last section may hold fewer pairs.
    pairs_here = cutlass.min(section, num_pairs - first_pair)
    m_idx = rest // pairs_here
    pair = first_pair + (rest - m_idx * pairs_here)
    m_block = num_m_blocks - 1 - m_idx if reverse else m_idx
    batch = pair // num_heads
    head = pair - batch * num_heads
    return m_block, head, batch


LOOSE_BOUND_RATIO = 2


def average_len(total: int, batch: int) -> int:
    """The average sequence length of a varlen batch, rounded up (at least 1)."""
    return max(1, -(-total // max(batch, 1)))


def shape_bound(max_len: int, total: int, batch: int) -> bool:
    """Whether a varlen batch's longest length is the packed token count, the bound fa4 takes when
    the call gives none (more than one sequence)."""
    return batch > 1 and max_len >= total


def loose_bound(max_len: int, total: int, batch: int) -> bool:
    """Whether a varlen batch's longest length (``max_seqlen``, or the packed token count standing
    in for it) is more than :data:`LOOSE_BOUND_RATIO` times the average (Note [Compact varlen
    grid]); host arithmetic."""
    return max_len > LOOSE_BOUND_RATIO * average_len(total, batch)


def loose_plan(problem):
    """``problem`` (a :class:`fa4.config.AttnProblem`) with each varlen side's length the batch's
    average where the given length is the shapes' bound (:func:`shape_bound`: the call did not give
    it), for the host decisions taken on lengths: a compact-grid forward's tile, packing and split
    count, and the backward's launch sections (Note [Compact varlen grid]). The grids keep the
    given bound; the kernels read each sequence's own length."""
    from dataclasses import replace

    kw = {}
    if problem.varlen_q and shape_bound(problem.seqlen_q, problem.total_q, problem.batch):
        kw["seqlen_q"] = average_len(problem.total_q, problem.batch)
    if problem.varlen_k and shape_bound(problem.seqlen_k, problem.total_k, problem.batch):
        kw["seqlen_k"] = average_len(problem.total_k, problem.batch)
    return replace(problem, **kw) if kw else problem


def compact_slot(block, first, slots, num_heads, section):
    """``(x, head)`` of grid index ``block`` of the compact grid in its batch, whose slots start at
    ``first`` and number ``slots``; ``section`` divides ``num_heads`` (Note [Compact varlen grid]).
    Plain arithmetic (traced or not)."""
    rest = block - first * num_heads
    sec_tiles = slots * section
    si = rest // sec_tiles
    r = rest - si * sec_tiles
    x = r // section
    return x, si * section + (r - x * section)


def lowest_pow2(n):
    """The lowest set bit of ``n > 0``: the largest power of two dividing it (Python or DSL Int32)."""
    return n & (0 - n)


@cute.jit
def compact_batch(j: Int32, mCuSeqlens: cute.Tensor, base_row: Int32, num_batch: Int32,
                  tile: cutlass.Constexpr[int], mult: cutlass.Constexpr[int] = 1) -> Int32:
    """The last sequence ``b`` with ``(cu[b] - base_row) * mult // tile + b <= j`` (``base_row =
    cu[0]``; Note [Compact varlen grid]; ``j >= 0``): a warp's ballot over 32 sequences per load.
    Whole warps call it, with the same ``j``."""
    lane = cute.arch.lane_idx()
    count = Int32(0)
    base = Int32(0)
    more = True
    while more:
        idx = base + lane
        start = Int32(2147483647)
        if idx < num_batch:
            start = (mCuSeqlens[idx] - base_row) * mult // tile + idx
        n = cute.arch.popc(cute.arch.vote_ballot_sync(start <= j))
        count = count + n
        base = base + 32
        more = (n == 32) & (base < num_batch)
    return count - 1


@cute.jit
def compact_tile(idx: Int32, mCuSeqlens: cute.Tensor, num_batch: Int32, num_heads: Int32, section: Int32,
                 tile: cutlass.Constexpr[int], mult: cutlass.Constexpr[int], reverse: cutlass.Constexpr[bool]):
    """``(block, head, batch)`` of grid index ``idx`` on the compact grid (Note [Compact varlen
    grid]); whole warps call it. Twin: :func:`host_compact_tiles`."""
    base_row = mCuSeqlens[0]
    batch = compact_batch(idx // num_heads, mCuSeqlens, base_row, num_batch, tile, mult)
    lo, hi = mCuSeqlens[batch] - base_row, mCuSeqlens[batch + 1] - base_row
    first = lo * mult // tile + batch
    slots = hi * mult // tile + batch + 1 - first
    sec = cutlass.min(lowest_pow2(cutlass.max(section, 1)), lowest_pow2(num_heads))
    x, head = compact_slot(idx, first, slots, num_heads, sec)
    if head >= num_heads:  # past the last sequence's slots: an empty slot of it
        x, head = slots, Int32(0)
    block = x
    if const_expr(reverse):
        blocks = ((hi - lo) * mult + tile - 1) // tile
        if x < blocks:
            block = blocks - 1 - x
    return block, head, batch


def host_compact_tiles(cu_seqlens: list, tile: int, num_heads: int, section: int, mult: int = 1,
                       reverse: bool = False, rows: Optional[int] = None) -> list:
    """Python twin of :func:`compact_tile`: ``(block, head, batch)`` of every index of the grid for
    a packed tensor of ``rows`` rows (default ``cu[-1] - cu[0]``), ``rows * mult // tile + batch``
    slots per head (the CPU tests check that every block of every sequence and head has exactly one)."""
    batch = len(cu_seqlens) - 1
    cu = [c - cu_seqlens[0] for c in cu_seqlens]
    rows = cu[-1] if rows is None else rows
    starts = [cu[b] * mult // tile + b for b in range(batch + 1)]
    sec = min(lowest_pow2(max(section, 1)), lowest_pow2(num_heads))
    out = []
    for i in range(num_heads * (rows * mult // tile + batch)):
        b = max(b for b in range(batch) if starts[b] <= i // num_heads)
        slots = starts[b + 1] - starts[b]
        x, h = compact_slot(i, starts[b], slots, num_heads, sec)
        if h >= num_heads:
            x, h = slots, 0
        blocks = -(-(cu[b + 1] - cu[b]) * mult // tile)
        out.append((blocks - 1 - x if reverse and x < blocks else x, h, b))
    return out


@dataclass(frozen=True)
class SectionTileScheduler:
    """See the module docstring. Sizes are runtime ``Int32``; ``reverse`` is compile-time."""

    num_m_blocks: Int32
    num_heads: Int32
    num_batch: Int32
    section: Int32
    reverse: cutlass.Constexpr[bool] = False

    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch):
        return (num_m_blocks * num_heads * num_batch, 1, 1)

    def tile(self) -> Tuple[Int32, Int32, Int32]:
        return section_tile(cute.arch.block_idx()[0], self.num_m_blocks, self.num_heads, self.num_batch,
                            self.section, self.reverse)


@dataclass(frozen=True)
class PersistentTileScheduler(SectionTileScheduler):
    """Static persistent order over the same tiles as :class:`SectionTileScheduler`: a grid of
    ``G = min(tiles, max_ctas)`` CTAs; in round ``r`` CTA ``c`` takes tile ``r * G + c`` of the
    section order when ``r`` is even and ``r * G + G - 1 - c`` when it is odd (a snake). With
    ``reverse`` (LPT) tiles come longest first, so a plain round robin would hand CTA 0 the longest
    tile of every round; the snake evens the per-CTA sums out. With ``max_ctas >= tiles`` it is one
    tile per CTA: the plain grid, kept for comparison. Kernels loop::

        idx = sched.first()
        while sched.valid(idx):
            m_block, head, batch = sched.tile(idx)
            ...
            idx = sched.next(idx)
    """

    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch, max_ctas):
        return (cutlass.min(num_m_blocks * num_heads * num_batch, max_ctas), 1, 1)

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0])

    def valid(self, idx: Int32):
        return idx < self.num_m_blocks * self.num_heads * self.num_batch

    def next(self, idx: Int32) -> Int32:
        return snake_next(idx, Int32(cute.arch.block_idx()[0]), Int32(cute.arch.grid_dim()[0]))

    def tile(self, idx: Int32) -> Tuple[Int32, Int32, Int32]:
        return section_tile(idx, self.num_m_blocks, self.num_heads, self.num_batch, self.section, self.reverse)

    # Warp-specialized kernels ask per role (the same sequence here; the dynamic scheduler hands
    # the producer's claims to the consumers). ``state``: the role's tile-pipeline state, unused.
    def next_producer(self, idx: Int32, state):
        return self.next(idx), state

    def next_consumer(self, idx: Int32, state):
        return self.next(idx), state


@dataclass(frozen=True)
class CompactVarlenTileScheduler(PersistentTileScheduler):
    """One tile per CTA over the compact varlen grid (Note [Compact varlen grid]): ``num_m_blocks``
    is the slots per head (``total_rows * mult // tile + batch``), ``mCuSeqlens`` the sequences'
    offsets, ``tile_rows`` / ``mult`` the tile's rows and the rows per query (packed GQA). Whole
    warps ask for tiles (the batch is found by a ballot). Slots past the last sequence (a packed
    tensor longer than ``cu[-1]``) map to an empty block of it."""

    mCuSeqlens: Any = None
    tile_rows: cutlass.Constexpr[int] = 128
    mult: cutlass.Constexpr[int] = 1

    @staticmethod
    def grid(num_slots, num_heads):
        return (num_slots * num_heads, 1, 1)

    def valid(self, idx: Int32):
        return idx < self.num_m_blocks * self.num_heads

    def tile(self, idx: Int32) -> Tuple[Int32, Int32, Int32]:
        return compact_tile(idx, self.mCuSeqlens, self.num_batch, self.num_heads, self.section, self.tile_rows,
                            self.mult, self.reverse)


@dataclass(frozen=True)
class DynamicTileScheduler(PersistentTileScheduler):
    """Dynamic persistent order over the same tiles: a grid of ``G`` CTAs; CTA ``c`` starts with
    tile ``c``, and each further tile is *claimed* in order from a global counter (``tile =
    G + atomicAdd(counter, 1)``), so a CTA that finishes early takes the next tile of the LPT
    order instead of one fixed in advance: no static imbalance, and the tile's loads start under
    the previous tile's epilogue. The counter (int32 in global memory) must be zero at launch.

    Warp-specialized protocol (Note [Tile claims]): the producer warp claims the next tile once it
    has issued the current tile's loads (:meth:`next_producer`, every lane of the warp) and passes
    the index to the consumer threads through a 2-stage smem ring (``next_idx``) guarded by an
    mbarrier pipeline ``pipe`` (:class:`cutlass.pipeline.PipelineAsync`: producer arrive count 32,
    the warp's lanes; consumer arrive count = the consumer threads); the consumers read it after
    their tile (:meth:`next_consumer`). The last claim of every CTA is past the end: it ends both
    loops.

    Note [Tile claims]
        Claims are ``atom.add.relaxed.gpu`` by lane 0, broadcast by a shuffle. Every claimed
        index is distinct and the claims of all CTAs together are exactly ``G, G + 1, ...``, so
        every tile below the total is run by exactly one CTA. Lane 0 stores the index into the
        ring slot before its arrive (release, CTA scope); the consumers' wait on the same phase
        acquires it. A slot is reused only after every consumer thread has read it (the empty
        barrier). The claim precedes the wait for a free slot, so a CTA holds up to three claimed
        tiles beyond the one its consumers run (claiming after the wait would make it two, a
        better tail balance for short tiles; not measured yet).

    Note [Skipped claims]
        A varlen grid enumerates ``ceil(max_seqlen_q / tile_m)`` m_blocks for every sequence; the
        tiles past a shorter sequence's end are empty (the mixed batch of ``python -m fa4.bench
        --offgrid``, 8 sequences of 293-3774 tokens: 108 of every 240 slots). Handed to the
        consumers, each costs a turn of the ring and, in a run of them, the claims' round trips
        while the consumers wait. With ``skip`` the producer claims past them before it takes a
        ring slot, under the consumers' current tile: the consumers see only tiles with rows
        (the CTA's first tile, not claimed, may still be empty: both sides check it). Every tile is
        still claimed exactly once, so the set of tiles run is the same.
    """

    counter: Optional[cute.Pointer] = None
    next_idx: Optional[cute.Tensor] = None
    pipe: Any = None

    @cute.jit
    def claim(self) -> Int32:
        """The next tile of the order (every lane of the calling warp: lane 0 claims, a shuffle
        broadcasts)."""
        lane = cute.arch.lane_idx()
        claim = Int32(0)
        if lane == 0:
            claim = cute.arch.atomic_add(self.counter, Int32(1), sem="relaxed", scope="gpu")
        return cute.arch.shuffle_sync(claim, 0) + self.first_claim()

    def first_claim(self) -> Int32:
        """The index the counter's first claim stands for: the grid's (its first tiles are not claimed)."""
        return Int32(cute.arch.grid_dim()[0])

    @cute.jit
    def next_producer(self, idx: Int32, state, skip=None):
        """Claim the next tile and hand it to the consumers; with ``skip`` (a warp-uniform predicate
        on a valid tile index, Note [Skipped claims]) claim again past the tiles it names."""
        nxt = self.claim()
        if const_expr(skip is not None):
            empty = self.skippable(nxt, skip)
            while empty:
                nxt = self.claim()
                empty = self.skippable(nxt, skip)
        return self.hand_over(nxt, state)

    @cute.jit
    def hand_over(self, nxt: Int32, state):
        """Put tile ``nxt`` in the ring's next slot for the consumers; ``(nxt, state)`` advanced."""
        self.pipe.producer_acquire(state)
        if cute.arch.lane_idx() == 0:
            self.next_idx[state.index] = nxt
        self.pipe.producer_commit(state)
        state.advance()
        return nxt, state

    @cute.jit
    def skippable(self, idx: Int32, skip):
        """Whether ``idx`` is a tile (not past the end) that ``skip`` names; ``skip`` sees a valid
        index only (a past-the-end one is clamped to the last tile and its answer ignored)."""
        last = self.num_m_blocks * self.num_heads * self.num_batch - 1
        named = skip(cutlass.min(idx, last))
        return self.valid(idx) and named

    @cute.jit
    def next_consumer(self, idx: Int32, state):
        self.pipe.consumer_wait(state)
        nxt = self.next_idx[state.index]
        self.pipe.consumer_release(state)
        state.advance()
        return nxt, state


class ClusterPairScheduler(PersistentTileScheduler):
    """:class:`PersistentTileScheduler`'s order over *pairs* of m-blocks, for clusters of two CTAs
    that share K / V (Note [K/V multicast] in fa4/fwd/sm90.py): cluster ``k`` of the ``G / 2``
    clusters walks pair indices as CTA ``k`` of a ``G / 2`` grid walks tiles (the snake, sections and
    LPT over ``num_m_blocks / 2`` m-pairs), and CTA ``r`` of the cluster takes m-block ``2 m + r`` of
    the pair ``(m, head, batch)`` (:func:`pair_tile`), so both tiles of a cluster are of one (head,
    batch) pair at every step. ``num_m_blocks`` is even (the caller rounds it up). With ``max_ctas``
    at least twice the pairs it is one pair per cluster: the plain grid."""

    @staticmethod
    def grid(num_m_blocks, num_heads, num_batch, max_ctas):
        return (cutlass.min(num_m_blocks // 2 * num_heads * num_batch, max_ctas // 2) * 2, 1, 1)

    def first(self) -> Int32:
        return Int32(cute.arch.block_idx()[0]) // 2

    def valid(self, idx: Int32):
        return idx < self.num_m_blocks // 2 * self.num_heads * self.num_batch

    def next(self, idx: Int32) -> Int32:
        return snake_next(idx, Int32(cute.arch.block_idx()[0]) // 2, Int32(cute.arch.grid_dim()[0]) // 2)

    def tile(self, idx: Int32) -> Tuple[Int32, Int32, Int32]:
        return pair_tile(idx, Int32(cute.arch.block_idx()[0]) % 2, self.num_m_blocks, self.num_heads, self.num_batch,
                         self.section, self.reverse)


@dataclass(frozen=True)
class ClusterPairDynamicScheduler(DynamicTileScheduler):
    """:class:`DynamicTileScheduler`'s claims over :class:`ClusterPairScheduler`'s pairs, for clusters
    of two CTAs that share K / V on the dynamic grid (Note [Pair claims]): cluster ``k`` of the ``G / 2``
    starts with pair ``k``; each further pair is claimed from the global counter (``G / 2 +
    atomicAdd``) by CTA 0's producer warp, which hands it to CTA 1's producer through a two-slot
    mailbox in CTA 1's shared memory; each producer then hands it to its own consumers through the
    smem ring, as :class:`DynamicTileScheduler` does. CTA ``r`` of the cluster takes m-block
    ``2 m + r`` of the pair (:func:`pair_tile`).

    Note [Pair claims]
        ``mailbox`` (two Int32) is read in CTA 1 only; ``mail_bar`` holds four mbarriers of one
        arrive each: ``full[s]`` (``mail_bar + s``, waited on in CTA 1) and ``empty[s]`` (``mail_bar
        + 2 + s``, waited on in CTA 0). Claim ``j`` uses slot ``j % 2`` with the parity of the tile
        ring's producer state, which advances once per claim on both CTAs (they walk the same pairs).
        - CTA 0, lane 0: waits for ``empty[s]`` (CTA 1 has read claim ``j - 2``), then stores the
          claim into CTA 1's ``mailbox[s]`` by ``st.async``, completing 4 bytes on CTA 1's
          ``full[s]``.
        - CTA 1, lane 0: arrives on its ``full[s]`` expecting those 4 bytes (before or after they
          land: the transaction count may go below zero in between, and the phase completes only
          with the arrive); the warp waits for the phase, lane 0 reads the slot (a shuffle gives it
          to the warp) and arrives on CTA 0's ``empty[s]`` (release, cluster scope: its read is
          done before the slot is written again).
        The barriers are initialized before the cluster barrier that precedes every remote access
        (as K / V multicast's), and the last claim of both CTAs is past the end: it ends both loops.
        No CTA exits while its peer may still arrive on its barriers (the kernel's closing cluster
        barrier)."""

    mailbox: Optional[cute.Tensor] = None
    mail_bar: Optional[cute.Pointer] = None

    grid = staticmethod(ClusterPairScheduler.grid)
    first = ClusterPairScheduler.first
    valid = ClusterPairScheduler.valid
    tile = ClusterPairScheduler.tile

    @staticmethod
    def init_mailbox(mail_bar: cute.Pointer) -> None:
        """The four mailbox mbarriers, one arrive each (one elected thread of warp 0 calls this before
        the cluster barrier)."""
        for i in range(4):
            cute.arch.mbarrier_init(mail_bar + i, 1)

    def first_claim(self) -> Int32:
        """The clusters' first pairs are not claimed: ``G / 2`` of them."""
        return Int32(cute.arch.grid_dim()[0]) // 2

    @cute.jit
    def next_producer(self, idx: Int32, state, skip=None):
        """CTA 0: claim the next pair and send it to CTA 1; CTA 1: receive it (Note [Pair claims]).
        Then hand it to this CTA's consumers."""
        assert skip is None, "pair claims do not skip"
        lane = cute.arch.lane_idx()
        slot, phase = state.index, state.phase
        nxt = Int32(0)
        if cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster()) == 0:
            nxt = self.claim()
            if lane == 0:
                cute.arch.mbarrier_wait(self.mail_bar + 2 + slot, phase)
                cute.arch.store_async_dsmem(self.mailbox.iterator + slot, nxt, self.mail_bar + slot, 1)
        else:
            if lane == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(self.mail_bar + slot, 4)
            cute.arch.mbarrier_wait(self.mail_bar + slot, phase ^ 1)
            got = Int32(0)
            if lane == 0:
                got = self.mailbox[slot]
                cute.arch.mbarrier_arrive(self.mail_bar + 2 + slot, 0, scope=_nvvm.MemScopeKind.CLUSTER)
            nxt = cute.arch.shuffle_sync(got, 0)
        return self.hand_over(nxt, state)


def pair_tile(idx, rank, num_m_blocks, num_heads, num_batch, section, reverse: bool):
    """``(m_block, head, batch)`` of CTA ``rank`` (0 or 1) of a cluster at pair index ``idx``
    (:class:`ClusterPairScheduler`): m-block ``2 m + rank`` of the section order's pair ``idx`` over
    ``num_m_blocks / 2`` m-pairs. Plain arithmetic (traced on Int32, run on Python ints by the CPU
    tests)."""
    m_pair, head, batch = section_tile(idx, num_m_blocks // 2, num_heads, num_batch, section, reverse)
    return 2 * m_pair + rank, head, batch


def snake_next(idx, cta, grid):
    """The tile after ``idx`` for CTA ``cta`` of ``grid`` in the snake order (plain arithmetic:
    traced on Int32 and run on Python ints by the CPU tests)."""
    rnd = idx // grid + 1
    odd = rnd % 2
    return rnd * grid + cta + odd * (grid - 1 - 2 * cta)


def split_range(n_min, n_max, split, num_splits):
    """``[lo, hi)``: the K blocks of split ``split`` of ``num_splits`` over a tile's range ``[n_min,
    n_max)`` (split-KV, Note [Split-KV partials] in fa4/pack_gqa.py): contiguous, in order, sizes
    differing by at most one; empty when the tile has fewer blocks than splits. Plain arithmetic
    (traced on Int32, run on Python ints by the CPU tests)."""
    n = cutlass.max(n_max - n_min, 0)
    return n_min + n * split // num_splits, n_min + n * (split + 1) // num_splits


def split_head(sched_head, num_splits):
    """``(head, split)`` of a split-KV scheduler head ``head * num_splits + split`` (the scheduler's
    head mode walks the splits of one head together, so they share its K/V rows in L2)."""
    head = sched_head // num_splits
    return head, sched_head - head * num_splits
