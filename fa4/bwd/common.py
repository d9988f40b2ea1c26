"""The family-independent backward driver: workspaces, preprocess -> main kernel -> postprocess,
the launch order of the main kernel, and its host model (pure Python, for the CPU tests).

A backward family (``fa4/bwd/sm80.py``, ``fa4/bwd/sm90.py``) adds its main kernel, its tuning table
and a :class:`LaunchOrder`; everything else a backward call does is here. Every family's main
kernel takes the same arguments::

    (q, k, v, dout, lse_log2, dpsum, dq_accum, dk, dv, cu_seqlens_q, cu_seqlens_k, seqused_k,
     semaphore, softmax_scale, softcap, window_left, window_right, max_seqlen_k, section_pairs)

and its config (a :class:`fa4.config.AttnKernelConfig`) has ``head_dim`` (padded to 32),
``tile_m``, ``tile_n``, ``deterministic`` and ``dq_fragment`` (the order of its dQ tiles, Note [dQ
accumulator layout] in fa4/bwd/workspace.py), which is all the driver reads.

Note [Launch order]
    The main grid is 1-D: CTA ``i`` -> (x, kv head, batch) by :func:`fa4.sched.tile.section_tile`.
    The (batch, kv head) pairs are cut into sections of ``section`` pairs, launched one after the
    other; inside a section ``x`` is slowest and the pairs fastest. K block ``n = x``. With a causal
    mask block ``n`` walks the m_blocks from its diagonal on, so its work decreases with ``n``:
    sections of several pairs launch their longest blocks first (LPT) and the short ones fill in
    after them, instead of every pair's long blocks starting behind the previous pair's short ones
    (one pair per section), which leaves a tail of long blocks at the end of the grid. Without a
    causal mask the blocks of a pair are equal, and sections of one pair (x fastest) let the
    blocks running together share the pair's Q and dO in L2. The section sizes are each family's
    measured :class:`LaunchOrder`; with a causal mask they are bounded by L2 bytes as well (Note
    [Causal sections]).

Note [Causal sections]
    In a causal section the resident CTAs come from every pair of the section (``x`` is slowest),
    so the Q, dO and dQ accumulator rows of all its pairs are in flight in L2 at once: sm90 d128
    s16k, one section of all 16 pairs, 16 MB each, read at an L2 hit rate of 84.9% (ncu), where
    flash-attn-4, one head at a time, reads at 97.1%. A family's ``causal_l2_bytes`` bounds a
    section by bytes as well: about ``causal_l2_bytes / pair_bytes`` pairs, rounded to the nearest
    power of two (a section count that divides the pairs), at most ``causal`` (the count measured
    at short sequences, where the bound is not reached). But a section also holds about one wave of
    CTAs or more (``num_sms / n_blocks`` pairs, to the nearest power of two): a GQA pair holds its
    group's rows, so one pair of d128 s8k with four q heads per kv head is 34 MB, but only 64 CTAs,
    and a section of it leaves half the GPU to the next section's long blocks (-13%). Measured on
    sm90 on the H200 (RESULTS v0.17: 32 MB of its 60 MB); other GPUs scale the budget by their L2
    size (not measured). The sm80 family measured no gain from the bound on the H200 (v0.17) and
    keeps its sections. The deterministic up order (Note [Up order]) walks up as well and takes the
    same sections (measured, v0.19); the down order keeps its own (its blocks share each tile).
    Under the dQ pass (Note [dQ pass] in fa4/bwd/dq_sm90.py) the main kernel has no dQ accumulator,
    so a pair's bytes leave it out (d256 s8k: 4 pairs per section where the accumulator's bytes made
    2; measured +1-4%, v0.23).

Note [Deterministic dQ]
    With ``deterministic``, the additions into the dQ accumulator of each (batch, q head, m_block)
    slot happen in a fixed order, serialized by an int32 counter per slot (:mod:`fa4.sched.semaphore`).

    Ranks. In a slot, the contributors are the K blocks ``[n_min, n_max)`` of
    ``mask.n_block_range(m_block)``; K block ``n`` has rank ``n - n_min`` (the first block adds
    first). K block ``n`` is grid index ``x = n`` of its (batch, kv head), as without determinism,
    and Note [Launch order] launches a pair's blocks in increasing ``x``: a CTA only waits for
    CTAs launched before it, whatever the section size, and the schedule cannot deadlock with any
    number of CTAs resident (Note [No deadlock] in fa4/sched/semaphore.py;
    :func:`deterministic_schedule` models it, the CPU tests simulate it with 1 to 7 resident CTAs).

    Order of the m_blocks. A CTA walks its m_blocks downwards, from the last one. Every K block of
    a pair then starts at the same (last) m_block -- with a causal mask too, where block ``n``
    ends at its diagonal instead of starting there -- and block ``n + 1``, launched after block
    ``n``, trails it by at least one step in every slot: it only ever waits when the two start
    at the same moment, and then for one step. (Walking upwards, a causal block would start at
    its diagonal, where every block before it still has to add, and wait for all of them.) The q
    heads of a GQA group are the fastest index of the steps (:func:`step_slot`), so a block that
    covers fewer m_blocks cannot overtake a longer one at a head boundary either. The launch order
    is thus free to serve the load balance: with a causal mask the longest blocks go first (LPT),
    as without determinism. With one section of many pairs, the blocks in flight at once are few
    per pair and far apart in launch order, so they rarely wait; with sections of one pair (x
    fastest) all blocks of a pair start together and chain, each one step behind the previous.
    How a family waits and publishes is its own (sm80: Note [Split-phase] in
    fa4/sched/semaphore.py; sm90: the dQ writer warp, or its sequencer of the direct adds).

Note [Rotated order]
    Without a mask every K block of a pair visits every m_block, and in the order above all of them
    start at the same slot: block ``n`` waits for ``n - 1`` there, which waits for ``n - 2``, ... so
    with sections of one pair (the order that shares Q and dO in L2: measured 640 against 541
    TFLOP/s with 32 pairs, sm90 d128) the blocks of a pair chain, each a publish behind the previous.
    The rotated order staggers them instead. With ``M`` m_blocks, ``N`` K blocks with keys and the
    stagger ``k = M // N >= 1``, block ``n`` starts at m_block ``s_n = M - 1 - n k`` and walks
    down, wrapping: its step ``i`` visits ``(s_n - i) mod M``. Slot ``m`` (``u = M - 1 - m``) is
    then visited first by block ``n0 = min(u // k, N - 1)``, ``k`` steps later by ``n0 - 1``, ...,
    block 0, then ``N - 1``, ..., ``n0 + 1``: the rank of block ``n`` there is ``(n0 - n) mod N``,
    the order in which the blocks reach the slot when they run at the same pace, so a block's
    first slot has rank 0 and no block waits in the steady state. Still a fixed order per slot, so
    still bit-exact. But a block may now wait for a block launched *after* it (of its own pair):
    no deadlock only if a pair's blocks can all be resident at once. Each step waits only for
    blocks that reach the slot at an earlier step index (its rank order), so among the resident
    CTAs the one blocked at the smallest step can always go on; with sections of one pair and
    in-order dispatch the earliest unfinished pair is wholly resident when ``num_x`` CTAs fit on the
    GPU. The host uses the rotated order only then (sm90: ``num_x <= SMs``, one CTA per SM), and
    only without a causal or local mask; ``k = 0`` (fewer m_blocks than K blocks) falls back to
    the plain order inside the kernel, per sequence. :func:`rotated_slot` (the kernel's too) and
    :func:`host_rotated_rank` (a Python twin) are the formulas (the CPU model of the schedule). A
    writer that holds a slot's publish back until its next slot's wait is over (sm90, Note [Publish
    lag] in fa4/bwd/sm90.py) must not do so at stagger ``k = 1`` with ``M == N`` and one q head per
    kv head: block ``n`` then waits for block ``n + 1`` one step back, around the pair to itself.

Note [Rotation rounds]
    With ``M == N`` (``s_q == s_k`` with ``tile_m == tile_n``: 64 x 64 at head dims 192 / 256, 128 x
    128 at 64) the stagger is 1: every
    slot takes an add at every step, so each contributor has one step from the previous one's
    adds to its own turn, and that chain (the adds complete, the fence, the count seen) is about a
    step at d256 and longer at d192 (docs/RESULTS.md v0.20: 0.94x and 0.85x of the non-deterministic
    speed). No rotation of all ``N`` blocks gives more. With ``rounds = R`` the blocks of a pair run
    in rounds of ``ceil(N / R)`` (contiguous ``n``): round ``r`` is rotated among itself with the
    stagger ``M // (its blocks)`` (2 at ``R = 2`` and even ``N``; 1 in the first round of an odd
    ``N``), and its ranks follow every rank of the earlier
    rounds (:func:`rotation_round`). The launch sections hold ``R`` pairs (``x`` slowest), so the
    first rounds of ``R`` pairs, about the blocks of one pair, run together, then their second
    rounds. Still a fixed order per slot (bit-exact, batch-invariant); deadlock-free as the rotated
    order is: a round waits only on its own blocks (all resident once the earlier rounds have
    finished) and on earlier rounds (launched before it). The cost: CTAs of a second round that
    start while the first still runs wait for it (4 of 132 SMs at ``N = 128``).

Note [Up order]
    The sm90 family's deterministic order for causal masks (``det_up``, :data:`fa4.bwd.sm90.DET_UP`;
    an option for local windows), flash-attn-4's order. A
    block walks its m_blocks *upwards*, from its diagonal; in every slot the block with the largest
    ``n`` adds first (rank ``n_max - 1 - n``), and K block ``n`` is grid index ``x = num_x - 1 -
    n``, so a pair's shortest blocks launch first (SPT instead of LPT). A block still waits only for
    blocks launched before it, so any residency runs through, and a writer's publish lag cannot
    close a cycle (block ``n`` waits only on larger ``n``; the last K block never waits). In the down
    order, every block of a pair starts at the same (last) m_block, so block ``n + 1`` trails block
    ``n`` by one publish and a slow step delays every block behind it. In the up order block ``n``
    reaches a slot two steps (at ``tile_n = 2 tile_m``) after block ``n + 1``, which is slack. The
    cost is the load balance of SPT: tools/det_model.py puts it at about 6% at s8k, and the waits of
    the down order at 2-9% once step times vary. On the H200 it first measured 15-29% slower than
    the down order (d128 causal, s4k / s8k, v0.12), with the deterministic sections (16 or more
    pairs). What the model missed is the L2: the down order's blocks in flight read the same Q / dO
    tile at the same step, while the up order's read tiles two steps apart, so a section's Q, dO and
    dQ accumulator must stay in L2 between them, as in the non-deterministic kernel, which walks up
    too. With that kernel's sections (bounded by L2 bytes, Note [Causal sections]:
    :meth:`LaunchOrder.causal_sections`) the up order beats the down order on every causal row
    measured (+1-8%, docs/RESULTS.md v0.19), and it is the causal default. What it still costs is
    the SPT tail: each pair's longest block launches last, about 5% of the grid at d128 s8k-s16k
    (the model's 6%), and with GQA, where a block walks its m_blocks once per q head of the group,
    30%: GQA keeps the down order (:data:`fa4.bwd.sm90.DET_UP_GQA`).

Note [Down tail]
    The up order's SPT tail (Note [Up order]) comes from its launch: the last CTAs of the grid are
    the last pairs' longest blocks. Only a pair's own blocks wait for each other, so a pair may take
    either order, as long as the choice does not depend on the batch: the last ``T`` kv heads of
    every batch walk the down order (LPT: block ``n = x``, m_blocks down, rank ``n - n_min``), and
    their pairs launch after every up-order pair, in sections of their own (:func:`host_tail_tile`),
    so the grid ends with short blocks again. ``T`` (:func:`tail_heads`) depends on ``heads_k``
    only: at most ``det_tail`` (2), at most one kv head in ``det_tail_share`` (8). Which order a slot's adds
    take depends on the kv head and ``heads_k`` only: the bits of a sample do not depend on its
    batch, the section size or the SM count. Deadlock-free as both orders are: a block waits only
    on blocks of its own pair with a smaller ``x``, which launch before it (a section holds whole
    pairs, ``x`` slowest). tools/det_model.py (equal step times, no memory system): the up order at
    0.940-0.951 of the LPT grid at d128 s4k-s16k, 0.986-0.998 with one or two kv heads of 16 in the
    down order; the tail is filled by about ``2 * num_sms / n_blocks`` pairs (a triangle's worth of
    work over the longest block's time), about 4 pairs at s8k. On the H200 (docs/RESULTS.md v0.20,
    sweep v40, medians of three) two kv heads took +2-4% at d128 s4k-s16k and d64, one +2.5% at d256
    (8 kv heads), while four (d64) and two (d256), a larger share in the down order, gained less or
    lost: hence the cap and the share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from fa4 import arch
from fa4.bwd import postprocess, preprocess
from fa4.bwd.workspace import dq_accum_placeholder, dq_accum_shape, rows_shape
from fa4.config import AttnProblem
from fa4.cute_utils import make_acc_mn_view
from fa4.sched.tile import loose_plan, section_tile
from fa4.validate import kernel_ready

MAX_GRID_X = 2**31 - 1


# --------------------------------------------------------------------------------------------
# Launch order
# --------------------------------------------------------------------------------------------


@dataclass
class LaunchOrder:
    """(batch, kv head) pairs per launch section (Note [Launch order]), per family, measured.
    ``causal`` / ``det_no_mask`` / ``det_causal``: the defaults of the non-deterministic kernel with
    a causal mask (it uses 1 without one) and of the deterministic kernel. ``section`` /
    ``det_section``: overrides (None: the defaults); a runtime argument of the kernels, so a tuning
    sweep (or a test) sets them without recompiling."""

    causal: int
    det_no_mask: int
    det_causal: int
    section: Optional[int] = None
    det_section: Optional[int] = None
    det_causal_direct: Optional[int] = None  # deterministic + causal with ordered direct dQ adds (None: det_causal)
    det_causal_waves: int = 0  # deterministic + causal (not direct): waves of head-dim-64 work per section
    causal_l2_bytes: int = 0  # non-deterministic causal: the L2 budget of a section's pairs on the H200's L2 (Note [Causal sections])

    def section_pairs(self, num_pairs: int, causal: bool, deterministic: bool, rotated: bool = False,
                      direct: bool = False, n_blocks: int = 0, num_sms: int = 0, head_dim: int = 64,
                      pair_bytes: int = 0, l2_bytes: int = arch.H200_L2_BYTES, up: bool = False,
                      rounds: int = 1) -> int:
        """Pairs per launch section, in [1, num_pairs]; the rotated deterministic order needs sections
        of one pair (Note [Rotated order]), or ``rounds`` pairs (Note [Rotation rounds]). ``direct``: the kernel adds dQ from registers.
        ``n_blocks`` (CTAs per pair), ``num_sms`` and ``head_dim`` (the kernel's, padded): with
        ``det_causal_waves``, a deterministic causal section holds about that many waves of head-dim-64
        CTAs' work or more (waves * num_sms / n_blocks * 64 / head_dim pairs from head dim 64 on,
        rounded to the nearest power of two). ``pair_bytes``: what one pair's steps read and add
        (:func:`pair_bytes`); with ``causal_l2_bytes``, a non-deterministic causal section holds at
        most ``causal`` pairs and about ``causal_l2_bytes`` of them, scaled by the GPU's ``l2_bytes``
        over the H200's 60 MB, and at least about one wave of CTAs (``num_sms / n_blocks`` pairs,
        rounded to the nearest power of two) (Note [Causal sections]). ``up``: the deterministic up
        order (Note [Up order]), whose causal sections follow that same rule: its blocks walk up from
        their diagonals as the non-deterministic ones do."""
        if rotated:  # one pair, or one per round (Note [Rotation rounds])
            return max(1, min(rounds, num_pairs))
        if deterministic and up and causal and self.det_section is None:
            return self.causal_sections(num_pairs, n_blocks, num_sms, pair_bytes, l2_bytes)
        if deterministic:
            det_causal = self.det_causal_direct if direct and self.det_causal_direct is not None else self.det_causal
            if causal and not direct and self.det_causal_waves and n_blocks > 0 and num_sms > 0:
                # The nearest power of two: sections that split the pairs evenly (17 pairs measured
                # 5-8% slower than 16 at d128 s4k, v0.12).
                pairs = self.det_causal_waves * num_sms / n_blocks * 64 / max(head_dim, 64)
                det_causal = max(det_causal, nearest_pow2(pairs))
            want = self.det_section if self.det_section is not None else (
                det_causal if causal else self.det_no_mask)
        elif causal and self.section is None:
            return self.causal_sections(num_pairs, n_blocks, num_sms, pair_bytes, l2_bytes)
        else:
            want = self.section if self.section is not None else 1
        return max(1, min(want, num_pairs))

    def causal_sections(self, num_pairs: int, n_blocks: int, num_sms: int, pair_bytes: int, l2_bytes: int) -> int:
        """Pairs per section of a causal walk up from the diagonal (Note [Causal sections]): at most
        ``causal``; with ``causal_l2_bytes``, about that budget of ``pair_bytes`` (scaled by ``l2_bytes``)
        and at least about a wave of CTAs."""
        want = self.causal
        if self.causal_l2_bytes and pair_bytes > 0:
            fit = nearest_pow2(self.causal_l2_bytes * l2_bytes / arch.H200_L2_BYTES / pair_bytes)
            wave = nearest_pow2(num_sms / n_blocks) if num_sms > 0 and n_blocks > 0 else 1
            want = min(want, max(fit, wave))
        return max(1, min(want, num_pairs))


def nearest_pow2(x: float) -> int:
    """The power of two nearest to ``x`` in log scale, at least 1 (section counts that split the
    pairs evenly)."""
    return 2 ** max(0, round(math.log2(x)))


def launch_sections(cfg, order: LaunchOrder, num_pairs: int, max_seqlen_k: int, seqlen_q: int, group: int,
                    head_dim: int, head_dim_v: int, elem_bytes: int = 2, device_index: Optional[int] = None) -> int:
    """Pairs per launch section of the main kernel with config ``cfg`` (its ``causal``,
    ``deterministic``, ``tile_n``, padded ``head_dim``): :meth:`LaunchOrder.section_pairs` on this
    GPU's SM count and L2 size. The launch and ``fa4.explain()`` both call it."""
    return order.section_pairs(
        num_pairs, cfg.causal, cfg.deterministic, cfg.det_rotate, getattr(cfg, "dq_direct", False),
        n_blocks=-(-max_seqlen_k // cfg.tile_n), num_sms=arch.num_sms(device_index), head_dim=cfg.head_dim,
        pair_bytes=pair_bytes(seqlen_q, group, head_dim, head_dim_v, elem_bytes,
                              dq_accum=not getattr(cfg, "dq_pass", False)),
        l2_bytes=arch.l2_bytes(device_index), up=getattr(cfg, "det_up", False),
        rounds=getattr(cfg, "det_rounds", 1))


def section_lengths(problem: AttnProblem, max_seqlen_k: int) -> tuple[int, int]:
    """``(max_seqlen_k, seqlen_q)`` that :func:`launch_sections` judges a call's sections on: the
    given lengths, or a varlen side's average where the call gave none (:func:`fa4.sched.tile.loose_plan`).
    Judged on the packed token count instead, a causal varlen call took sections of one pair (its
    ``n_blocks`` a wave, its pair's bytes past the L2 budget), which left every pair's long blocks
    behind the previous pair's short ones: 1.45x the time of the call with the lengths (v0.38, H100,
    GQA 32 / 8 d128 causal, 8 sequences of 293-3774)."""
    plan = loose_plan(problem)
    return (plan.seqlen_k if problem.varlen_k else max_seqlen_k), plan.seqlen_q


def pair_bytes(seqlen_q: int, group: int, head_dim: int, head_dim_v: int, elem_bytes: int = 2,
               dq_accum: bool = True) -> int:
    """Bytes of Q, dO, the float32 dQ accumulator (``dq_accum``: none under the dQ pass, Note [dQ pass]
    in fa4/bwd/dq_sm90.py) and the row statistics that the steps of one (batch, kv head) pair read or
    add: ``group`` q heads of ``seqlen_q`` rows (Note [Causal sections]). Without the accumulator's
    bytes the d256 deterministic causal sections at s8k hold 4 pairs, not 2: sweep v50 (docs/RESULTS.md
    v0.23), three rounds, 373.7 -> 387.2 TFLOP/s (median; d160 8 pairs and d192 4 flat)."""
    return seqlen_q * group * (elem_bytes * (head_dim + head_dim_v) + (4 * head_dim if dq_accum else 0) + 8)


def launch_grid(cfg, num_batch: int, heads_k: int, max_seqlen_k: int,
                packed_k: Optional[int] = None) -> tuple[int, int, int]:
    """The main kernel's grid: 1-D, ``n_blocks * kv heads * batch`` CTAs (Note [Launch order]), or
    on the compact varlen grid (``packed_k``: the packed K rows) ``(packed_k // tile_n + batch) * kv
    heads`` (Note [Compact varlen grid] in fa4/sched/tile.py). ValueError when CUDA cannot launch it
    (x < 2^31)."""
    if packed_k is not None:
        grid = ((packed_k // cfg.tile_n + num_batch) * heads_k, 1, 1)
        what = f"(packed K rows {packed_k} // tile_n + batch) * kv heads"
    else:
        num_x = _cdiv(_cdiv(max_seqlen_k, cfg.tile_n), cfg.cluster_n) * cfg.cluster_n  # (sm90 two_cta: pairs)
        grid = (num_x * heads_k * num_batch, 1, 1)
        what = "n_blocks * kv heads * batch"
    if grid[0] > MAX_GRID_X:
        raise ValueError(
            f"the backward grid {grid} exceeds CUDA's limit ({what} < 2^31): "
            f"batch {num_batch}, kv heads {heads_k}, seqlen_k {max_seqlen_k}, tile_n {cfg.tile_n}"
        )
    return grid


def rotation_round(n_block, num_n, rounds: int):
    """``(first rank, index, K blocks)`` of K block ``n_block``'s round in the rotated order with
    ``rounds`` rounds (Note [Rotation rounds]): blocks ``[r * per, (r + 1) * per)`` form round ``r``
    (``per = ceil(num_n / rounds)``). Only for blocks with keys (``n_block < num_n``): past the
    sequence the round is empty or negative, so callers stay under the CTA's ``num_steps > 0``
    (a division by that count would be by zero). Plain arithmetic (traced or not)."""
    if rounds == 1:
        return 0, n_block, num_n
    per = (num_n + rounds - 1) // rounds
    r = n_block // per
    return r * per, n_block - r * per, cutlass.min(per, num_n - r * per)


def rotated_slot(t, head_kv, group, n_block, num_m, num_n, rounds: int = 1):
    """(q head, m_block) of step ``t`` in the rotated order (Note [Rotated order]; ``m_min = 0``), of
    its round (Note [Rotation rounds]): ``FlashBwdSm90.step_slot`` with ``det_rotate``. Plain
    arithmetic: traced inline on the device, and the same on Python ints (the CPU model)."""
    m_idx = t // group
    head = head_kv * group + (t - m_idx * group)
    _, n_r, num_r = rotation_round(n_block, num_n, rounds)
    start = num_m - 1 - n_r * (num_m // num_r)
    return head, (start - m_idx + num_m) % num_m


def host_rotated_rank(n_block: int, m_block: int, num_m: int, num_n: int, rounds: int = 1) -> int:
    """Rank of K block ``n_block`` in slot ``m_block`` (Note [Rotated order]; Note [Rotation
    rounds]: after every block of the earlier rounds). Python twin of ``FlashBwdSm90.dq_rank`` with
    ``det_rotate``."""
    base, n_r, num_r = rotation_round(n_block, num_n, rounds)
    stagger = num_m // num_r
    if stagger == 0:
        return n_block
    n0 = min((num_m - 1 - m_block) // stagger, num_r - 1)
    return base + (n0 - n_r + num_r) % num_r


def rotation_lags(num_m, num_n):
    """Whether the sm90 writer may hold a slot's publish back (Note [Publish lag] in
    fa4/bwd/sm90.py) in the rotated order of a sequence with ``num_m`` m_blocks and ``num_n`` K
    blocks (of its round, Note [Rotation rounds]): not at stagger 1, where it can close a cycle (Note
    [Rotated order]). Plain arithmetic: traced inline on the device, and the same on Python ints (the
    CPU model)."""
    return num_m // num_n != 1


KV_SPLIT_MIN_WAVES = 4
"""Note [Split GQA group] in fa4/bwd/sm90.py: with a causal or local mask the GQA group is split (in
halves, quarters, ...) until the main kernel has at least this many CTAs per SM, or one q head per
CTA; without a mask, whose CTAs all take as long, only while the doubled grid still fits one wave.
Sweep v58 (docs/RESULTS.md v0.26, sm90, two rounds, TFLOP/s): MQA d128 s8k causal, b2 (128 CTAs),
split 1 / 2 / 4 / 8 / 16: 287 / 489 / 525 / 537 / 514 and 283 / 474 / 516 / 543 / 517; d64 (g32) 1 / 4 /
8 / 16: 253 / 460 / 487 / 472; d128 s2k causal 1 / 4 / 8: 250 / 402 / 396; without a mask (128 CTAs) 1 /
2 / 4 / 8: 595 / 569 / 561 / 579 and 578 / 547 / 580 / 574; GQA 4 s4k causal (1024 CTAs) 1 / 2 / 4: 493 /
466 / 396."""

KV_SPLIT_MIN_STEPS = 8
"""... and while a CTA keeps at least this many steps (q heads x m_blocks): a short walk does not pay
for the partials' float32 traffic and the sum."""


def kv_split_for(problem: AttnProblem, tile_m: int, tile_n: int, num_sms: int) -> int:
    """The GQA group's split (Note [Split GQA group] in fa4/bwd/sm90.py): 1, or the smallest power of
    two dividing the group that gives a masked grid :data:`KV_SPLIT_MIN_WAVES` waves of CTAs (an
    unmasked one: the largest that fits one wave), each with at least :data:`KV_SPLIT_MIN_STEPS`
    steps (``problem.seqlen_q`` / ``seqlen_k``: the longest sequences)."""
    group = problem.heads // problem.heads_k
    ctas = -(-problem.seqlen_k // tile_n) * problem.heads_k * problem.batch
    m_blocks = -(-problem.seqlen_q // tile_m)
    masked = problem.causal or problem.local

    def more(split):  # whether to double the split
        fill = ctas * split < KV_SPLIT_MIN_WAVES * num_sms if masked else ctas * split * 2 <= num_sms
        return group % (2 * split) == 0 and fill and group // (2 * split) * m_blocks >= KV_SPLIT_MIN_STEPS
    split = 1
    while more(split):
        split *= 2
    return split


def sum_partials(t: torch.Tensor) -> torch.Tensor:
    """``t`` of shape (..., kv heads, split, d), split a power of two -> the sum over the split, in
    float32, as a fixed tree of elementwise adds (halves added, then quarters, ...): the same order for
    every element whatever the tensor's size, so a sample's dK / dV bits do not depend on its batch
    (a reduction kernel may choose its order by the sizes)."""
    while t.shape[-2] > 1:
        half = t.shape[-2] // 2
        t = t[..., :half, :] + t[..., half:, :]
    return t.squeeze(-2)


def asked_kv_split(opts, problem: AttnProblem, two_cta: bool = False) -> int:
    """``KernelOptions.bwd_kv_split``, checked against the problem by the family's make_config (which
    the interface asks before the forward runs): it must divide the GQA group, and a split cannot run
    with the 2-CTA kernel. Both families take it with determinism (v0.28: the sm80 family's split
    under its semaphore-ordered dQ passed test_bwd_kv_split_deterministic on the H200)."""
    split = opts.bwd_kv_split
    group = problem.heads // problem.heads_k
    if group % split:
        raise ValueError(f"KernelOptions.bwd_kv_split={split} must divide the GQA group ({problem.heads} q heads "
                         f"per {problem.heads_k} kv heads: {group})")
    if split > 1 and two_cta:
        raise ValueError(f"KernelOptions.bwd_kv_split={split}: the 2-CTA backward (bwd_two_cta) keeps one CTA "
                         "pair per kv head; ask for bwd_two_cta=False")
    return split


def choose_kv_split(opts, problem: AttnProblem, rule, *, two_cta: bool = False, deterministic: bool = False) -> int:
    """A family's ``kv_split``: ``KernelOptions.bwd_kv_split`` when set (checked by
    :func:`asked_kv_split`), else the rule's split (``rule()``: the family's call of
    :func:`kv_split_for`; None where the family does not take it), never with the 2-CTA kernel or
    asked determinism (the rule reads the batch), else 1."""
    if opts.bwd_kv_split is not None:
        return asked_kv_split(opts, problem, two_cta)
    return 1 if rule is None or two_cta or deterministic else rule()


def check_main_kernel_types(cfg, dtype, mQ, mK, mV, mdO, mdK, mdV) -> None:
    """Trace time, a family's main kernel: q, k, v, dout (and dk, dv) of the configured 16-bit
    ``dtype``; with ``kv_split`` dk, dv are the float32 partials (Note [Split GQA group])."""
    split = getattr(cfg, "kv_split", 1) > 1
    for t in (mQ, mK, mV, mdO) + (() if split else (mdK, mdV)):
        if t.element_type != dtype:
            raise TypeError("q, k, v, dout, dk, dv must have the configured dtype")
    if split and (mdK.element_type != Float32 or mdV.element_type != Float32):
        raise TypeError("with kv_split the dk, dv arguments are the float32 partials (Note [Split GQA group])")


@cute.jit
def store_dkv_partial(acc: cute.Tensor, thr_mma, mT: cute.Tensor, seq, batch: Int32, head_kv: Int32,
                      n_block: Int32, rows: Int32, tile_n: cutlass.Constexpr[int], d: cutlass.Constexpr[int]) -> None:
    """A float32 dK / dV accumulator (``thr_mma``'s C partition of the ``(tile_n, d)`` tile of K block
    ``n_block``) -> the float32 partials ``mT (b, s_k, h_k * kv_split, d)`` at virtual kv head
    ``head_kv`` (Note [Split GQA group] in fa4/bwd/sm90.py), straight from registers: the ``rows``
    rows the sequence owns and the columns of the real head dim (``mT.shape[3]``)."""
    acc_mn = make_acc_mn_view(acc)
    coord = make_acc_mn_view(thr_mma.partition_C(cute.make_identity_tensor((tile_n, d))))
    gT = seq.k_view(mT, batch, head_kv)
    cols = mT.shape[3]
    for r in cutlass.range_constexpr(cute.size(acc_mn, mode=[0])):
        row = coord[r, 0][0]
        if row < rows:
            for c in cutlass.range_constexpr(cute.size(acc_mn, mode=[1])):
                col = coord[r, c][1]
                if col < cols:
                    gT[n_block * tile_n + row, col] = acc_mn[r, c]


def step_slot(t, head_kv, group, m_min, num_m, deterministic: bool, up: bool = False, down=None):
    """(q head, m_block) of step ``t`` of a main-kernel CTA: m_blocks slowest, the ``group`` q heads
    of its kv head fastest; the m_blocks go up from ``m_min``, or down from the last one when
    deterministic (Note [Deterministic dQ]) except in the up order (``up``, Note [Up order]).
    ``down`` (0 or 1, a runtime value; Note [Down tail]): the direction of this CTA's pair, which
    then overrides the other two. Plain arithmetic: traced inline on the device, and the same on
    Python ints."""
    m_idx = t // group
    head = head_kv * group + (t - m_idx * group)
    if const_expr(down is not None):
        return head, m_min + m_idx + down * (num_m - 1 - 2 * m_idx)
    if const_expr(deterministic and not up):
        return head, m_min + num_m - 1 - m_idx
    return head, m_min + m_idx


def tail_heads(heads_k, det_tail: int, det_tail_share: int):
    """kv heads of every batch that walk the down order (Note [Down tail]): at most ``det_tail`` and
    at most one in ``det_tail_share`` (none with ``det_tail == 0``). Plain arithmetic (traced or not)."""
    return cutlass.min(heads_k // det_tail_share, det_tail) if det_tail else 0


def host_tail_tile(i: int, num_x: int, heads_k: int, num_batch: int, section: int,
                   tail: int) -> tuple[int, int, int, int]:
    """``(x, kv head, batch, down)`` of grid index ``i`` with ``tail`` down-order kv heads per batch
    (Note [Down tail]): first the up-order pairs (kv heads ``< heads_k - tail``), then the down-order
    ones, each set cut into its own sections of ``section`` pairs (so no section holds both).
    Python twin of ``FlashBwdSm90.tail_tile``."""
    up_heads = heads_k - tail
    n_up_tiles = num_x * up_heads * num_batch
    if i < n_up_tiles:
        x, hk, b = section_tile(i, num_x, up_heads, num_batch, section, False)
        return x, hk, b, 0
    x, hk, b = section_tile(i - n_up_tiles, num_x, tail, num_batch, section, False)
    return x, up_heads + hk, b, 1


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def fake_bshd(dtype, batch, s, heads, dim):
    """A fake ``(b, s, h, d)`` tensor of a kernel boundary: 64-bit strides in multiples of 16 bytes,
    unit stride last."""
    strides = tuple(cute.sym_int64(divisibility=8) for _ in range(3)) + (1,)
    return cute.runtime.make_fake_tensor(dtype, (batch, s, heads, dim), strides, assumed_align=16)


def fake_compact(dt, shape, align=4):
    """A fake compact row-major tensor (workspaces, cu_seqlens, seqused)."""
    order = tuple(range(len(shape) - 1, -1, -1))
    return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=order, assumed_align=align)


def fake_args(cfg) -> tuple:
    """Fake arguments of every family's main kernel (the signature in the module docstring):
    symbolic sizes, 64-bit strides in multiples of 16 bytes, whole tiles of workspace rows."""
    from fa4.bwd.preprocess import _DTYPES

    dtype = _DTYPES[cfg.dtype]
    b, sq, sk, h, hk = (cute.sym_int() for _ in range(5))
    d = cute.sym_int(divisibility=8)
    # V, dO, dV: their own head dim where it differs (the sm90 family's head_dim_v).
    dv = cute.sym_int(divisibility=8) if getattr(cfg, "head_dim_v", 0) else d

    # Mixed layouts (one side packed as (1, total, ...), the other batched): separate batch modes.
    bk = cute.sym_int() if cfg.varlen_q != cfg.varlen_k else b

    def bshd(s, heads, batch=b, dim=d):
        return fake_bshd(dtype, batch, s, heads, dim)

    q, k, v, do = bshd(sq, h), bshd(sk, hk, bk), bshd(sk, hk, bk, dv), bshd(sq, h, dim=dv)
    rows = cute.sym_int(divisibility=16)  # whole tiles of rows (Note [Padded row tiles] in fa4/bwd/workspace.py)
    lse_log2, dpsum = fake_compact(Float32, (b, h, rows), 16), fake_compact(Float32, (b, h, rows), 16)
    # Under the dQ pass dq_accum is a 16-row stand-in (workspace.dq_accum_placeholder): its own rows.
    dq_rows = cute.sym_int(divisibility=16) if getattr(cfg, "dq_pass", False) else rows
    dq_accum = fake_compact(Float32, (b, h, dq_rows, cfg.head_dim), 16)
    if getattr(cfg, "kv_split", 1) > 1:  # float32 partials of virtual kv heads (Note [Split GQA group])
        hv = cute.sym_int()
        dk, dv = fake_bshd(Float32, bk, sk, hv, d), fake_bshd(Float32, bk, sk, hv, dv)
    else:
        dk, dv = bshd(sk, hk, bk), bshd(sk, hk, bk, dv)
    cu_q = fake_compact(Int32, (cute.sym_int(),)) if cfg.varlen_q else None
    cu_k = fake_compact(Int32, (cute.sym_int(),)) if cfg.varlen_k else None
    used_k = fake_compact(Int32, (cute.sym_int(),)) if cfg.has_seqused_k else None
    sem = fake_compact(Int32, (cute.sym_int(), h, cute.sym_int())) if counts_slots(cfg) else None
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=True)
    return (q, k, v, do, lse_log2, dpsum, dq_accum, dk, dv, cu_q, cu_k, used_k, sem,
            Float32(1.0), Float32(0.0), Int32(0), Int32(0), Int32(1), Int32(1), stream)


def workspace_shapes(problem: AttnProblem, cfg, q_shape) -> dict:
    """Shapes of the float32/int32 workspaces for a (b, s_q, h, d) (varlen (1, total_q, h, d)) q."""
    b, s, h, _ = q_shape
    varlen = cfg.varlen_q
    batch = problem.batch if varlen else b
    rows = rows_shape(batch, h, s, cfg.tile_m, varlen)
    shapes = {"lse_log2": rows, "dpsum": rows,
              "dq_accum": dq_accum_shape(batch, h, s, cfg.head_dim, cfg.tile_m, varlen)}
    if counts_slots(cfg):
        shapes["semaphore"] = (problem.batch, h, max(1, math.ceil(problem.seqlen_q / cfg.tile_m)))
    return shapes


def counts_slots(cfg) -> bool:
    """Whether the main kernel of ``cfg`` keeps a counter per dq_accum slot: deterministic (Note
    [Deterministic dQ]), or storing each slot's first tile instead of adding it into a zeroed
    accumulator (``dq_first_store``, Note [First store] in fa4/bwd/sm90.py)."""
    if getattr(cfg, "dq_pass", False):  # no dq_accum slots (Note [dQ pass] in fa4/bwd/dq_sm90.py)
        return False
    return bool(cfg.deterministic or getattr(cfg, "dq_first_store", False))


def run_backward(cfg, problem: AttnProblem, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                 dq, dk, dv, *, order: LaunchOrder, extra: tuple = ()) -> None:
    """dq, dk, dv of attention (written in place) with the main-kernel config ``cfg`` (its family's
    ``make_config`` of ``problem``): preprocess -> main kernel -> postprocess.

    Tensors are 4D ``(b, s, h, d)`` (varlen ``(1, total, h, d)``); ``lse``/``dlse`` float32
    ``(b, h, s_q)`` (varlen ``(1, h, total_q)``), ``dlse`` None when the LSE has no gradient.
    Workspaces (:func:`workspace_shapes`) come from torch's caching allocator; ``order`` is the
    family's launch order (Note [Launch order]); ``extra``: the family's further arguments of the
    main kernel and the dQ pass (the sm90 family's aux tensors).
    """
    import torch

    from fa4.jit import get_kernel
    from fa4.ops import _empty  # NaN-filled under the GPU tests: a tile that no kernel writes fails

    dout, q, k, v, out = (kernel_ready(t) for t in (dout, q, k, v, out))
    shapes = workspace_shapes(problem, cfg, q.shape)
    dev = q.device
    lse_log2 = _empty(shapes["lse_log2"], torch.float32, dev)
    dpsum = _empty(shapes["dpsum"], torch.float32, dev)
    dq_pass = getattr(cfg, "dq_pass", False)  # Note [dQ pass] in fa4/bwd/dq_sm90.py: no dq_accum
    # Under the dQ pass no kernel touches dq_accum: a 16-row stand-in for the kernels' argument.
    dq_accum = (dq_accum_placeholder(shapes["dq_accum"], dev) if dq_pass
                else _empty(shapes["dq_accum"], torch.float32, dev))
    sem = torch.empty(shapes["semaphore"], dtype=torch.int32, device=dev) if "semaphore" in shapes else None
    post_cfg = postprocess.config_for(cfg)  # ``counted``: the main kernel stores first (Note [First store])
    varlen_q = cu_seqlens_q is not None
    # Note [Split GQA group] in fa4/bwd/sm90.py: float32 partials of heads_k * split virtual kv heads,
    # allocated before the preprocess, so that no kernel (the GPU tests' NaN fill) comes between it and
    # the main kernel (Note [Programmatic dependent launch]).
    split = getattr(cfg, "kv_split", 1)
    if q.shape[2] % (k.shape[2] * split):
        raise ValueError(f"kv_split={split} (Note [Split GQA group]) must divide the GQA group of {q.shape[2]} q "
                         f"heads per {k.shape[2]} kv heads")
    if split > 1:
        # (NaN-filled under the GPU tests: every row a sequence owns and every column is written.)
        dk_k, dv_k = (_empty((*t.shape[:2], t.shape[2] * split, t.shape[3]), torch.float32, dev) for t in (dk, dv))
    else:
        dk_k, dv_k = kernel_ready(dk), kernel_ready(dv)
    preprocess.run_preprocess(
        out, dout, lse, lse_log2, dpsum, dq_accum, dlse=dlse, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=problem.seqlen_q if varlen_q else None, semaphore=sem, dq_tile_m=cfg.tile_m,
        dq_head_dim=q.shape[-1], arch=cfg.arch, zero_dq=not post_cfg.counted and not dq_pass,
        pdl=bool(getattr(cfg, "pdl", False)))
    heads_k = k.shape[2] * split
    max_seqlen_k = problem.seqlen_k if cu_seqlens_k is not None else k.shape[1]
    num_batch = cu_seqlens_k.shape[0] - 1 if cu_seqlens_k is not None else k.shape[0]
    launch_grid(cfg, num_batch, heads_k, max_seqlen_k, k.shape[1] if getattr(cfg, "compact_grid", False) else None)
    if max_seqlen_k > 0:
        get_kernel(cfg)(
            q, k, v, dout, lse_log2, dpsum, dq_accum, dk_k, dv_k, cu_seqlens_q, cu_seqlens_k, seqused_k, sem,
            float(problem.softmax_scale), float(problem.softcap), int(problem.window_left),
            int(problem.window_right), int(max_seqlen_k),
            launch_sections(cfg, order, num_batch * heads_k, *section_lengths(problem, max_seqlen_k),
                            q.shape[-2] // heads_k, q.shape[-1], v.shape[-1], q.element_size(), q.device.index),
            *extra,
        )
    else:
        dk_k.zero_()
        dv_k.zero_()
    if split > 1:  # the partials of each kv head summed in a fixed order, rounded once
        # A deterministic run (or one under the dQ pass, which deterministic runs from d160 take) sums
        # by a fixed tree of adds, whatever the sizes (the batch-invariance promise); the others by
        # one torch reduction (2.6x less traffic than the tree: about 60 us at MQA d128 s8k, split 8).
        fixed = getattr(cfg, "deterministic", False) or dq_pass
        dk_k, dv_k = ((sum_partials(t) if fixed else t.sum(3))
                      for t in (x.unflatten(2, (k.shape[2], split)) for x in (dk_k, dv_k)))
    if dk_k is not dk:
        dk.copy_(dk_k)
    if dv_k is not dv:
        dv.copy_(dv_k)
    dq_k = kernel_ready(dq)
    if dq_pass:
        from fa4.bwd import dq_sm90

        if q.shape[1] > 0:
            get_kernel(dq_sm90.config_for(cfg))(
                q, k, v, dout, lse_log2, dpsum, dq_k, cu_seqlens_q, cu_seqlens_k, seqused_k,
                float(problem.softmax_scale), float(problem.softcap), int(problem.window_left),
                int(problem.window_right), int(problem.seqlen_q if varlen_q else q.shape[1]), *extra)
    else:
        postprocess.run_postprocess(
            post_cfg, dq_accum, dq_k, problem.softmax_scale, cu_seqlens_q=cu_seqlens_q,
            max_seqlen_q=problem.seqlen_q if varlen_q else None, counters=sem if post_cfg.counted else None)
    if dq_k is not dq:
        dq.copy_(dq_k)


# --------------------------------------------------------------------------------------------
# Host model of the deterministic dQ schedule (pure Python; the CPU tests check it)
# --------------------------------------------------------------------------------------------


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def host_n_block_range(
    m_block: int, sq: int, sk: int, tile_m: int, tile_n: int, causal: bool, local: bool, wl: int, wr: int
) -> tuple[int, int]:
    """Python twin of ``AttentionMask.n_block_range`` (fa4/mask.py): same formulas."""
    wr = wr if local else 0
    n_min, n_max = 0, _cdiv(sk, tile_n)
    if causal or local:
        row_last = min((m_block + 1) * tile_m, sq) - 1
        n_max = min(n_max, _cdiv(max(row_last + sk - sq + wr + 1, 0), tile_n))
    if local:
        n_min = max(m_block * tile_m + sk - sq - wl, 0) // tile_n
    return n_min, n_max


def host_m_block_range(
    n_block: int, sq: int, sk: int, tile_m: int, tile_n: int, causal: bool, local: bool, wl: int, wr: int
) -> tuple[int, int]:
    """Python twin of ``AttentionMask.m_block_range`` (fa4/mask.py): same formulas."""
    wr = wr if local else 0
    m_min, m_max = 0, _cdiv(sq, tile_m)
    if causal or local:
        m_min = max(n_block * tile_n - sk + sq - wr, 0) // tile_m
    if local:
        col_last = min((n_block + 1) * tile_n, sk) - 1
        m_max = min(m_max, _cdiv(max(col_last - sk + sq + wl + 1, 0), tile_m))
    return m_min, m_max


def deterministic_schedule(
    seqlens_q: list[int],
    seqlens_k: list[int],
    heads_k: int,
    group: int,
    tile_m: int,
    tile_n: int,
    causal: bool = False,
    local: bool = False,
    wl: int = 0,
    wr: int = 0,
    section: Optional[int] = None,
    order: Optional[LaunchOrder] = None,
    rotated: bool = False,
    direct: bool = False,
    num_sms: int = 132,
    up: bool = False,
    head_dim: int = 64,
    tail: int = 0,
    rounds: int = 1,
):
    """The dQ accumulation schedule of a deterministic main kernel, as the device runs it.

    Returns ``(visits, rank, ctas)`` for :func:`fa4.sched.semaphore.check_schedule`: CTAs in launch
    order (the 1-D grid of Note [Launch order], sections of ``section`` (batch, kv head) pairs,
    None: ``order``'s default), each with its (batch, q head, m_block) slots in visiting order;
    ``rank(cta, slot)``, the count it waits for: ``n_block - n_min``; and ``ctas[c] = (x, kv head,
    batch, n_block)``. ``seqlens_k`` are the keys used (seqused_k when given). ``rotated``: the
    rotated order of Note [Rotated order] (no mask; sections of one pair, or of ``rounds`` pairs with
    ``rounds`` rounds per pair: Note [Rotation rounds]). ``direct``: the kernel
    adds dQ from registers (``order``'s sections for that case). ``num_sms``: the GPU's, for
    ``order``'s ``det_causal_waves`` (with ``head_dim``, the kernel's padded head dim). ``up``: the up
    order of Note [Up order] (masked only). ``tail``: with ``up``, the kv heads per batch that walk
    down (:func:`tail_heads` of the kernel's config; Note [Down tail]).
    """
    assert not (rotated and (causal or local)), "the rotated order is for unmasked attention"
    assert not (up and (rotated or not (causal or local))), "the up order is for masked attention"
    num_x = _cdiv(max(seqlens_k), tile_n)
    num_batch = len(seqlens_q)
    pairs = heads_k * num_batch
    if section is None:
        sec = (order or LaunchOrder(1, 1, 1)).section_pairs(pairs, causal, True, rotated, direct, n_blocks=num_x,
                                                            num_sms=num_sms, head_dim=head_dim, up=up,
                                                            rounds=rounds)
    else:
        sec = max(1, min(section, pairs))
    visits, n_of, ctas, down_of = [], [], [], []
    n_tail = tail if up else 0
    for i in range(num_x * pairs):
        if n_tail:
            x, hk, b, down = host_tail_tile(i, num_x, heads_k, num_batch, sec, n_tail)
        else:
            x, hk, b = section_tile(i, num_x, heads_k, num_batch, sec, False)
            down = 0 if up else 1
        sq, sk = seqlens_q[b], seqlens_k[b]
        n = x if down else num_x - 1 - x
        slots = []
        if n < _cdiv(sk, tile_n):
            m_min, m_max = host_m_block_range(n, sq, sk, tile_m, tile_n, causal, local, wl, wr)
            num_m = max(m_max - m_min, 0)
            if rotated:
                slots = [(b, *rotated_slot(t, hk, group, n, num_m, _cdiv(sk, tile_n), rounds))
                         for t in range(num_m * group)]
            else:
                slots = [(b, *step_slot(t, hk, group, m_min, num_m, True, not down)) for t in range(num_m * group)]
        visits.append(slots)
        n_of.append(n)
        down_of.append(down)
        ctas.append((x, hk, b, n))

    def rank(cta: int, slot) -> int:
        b, _, m = slot
        if rotated:
            return host_rotated_rank(n_of[cta], m, _cdiv(seqlens_q[b], tile_m), _cdiv(seqlens_k[b], tile_n), rounds)
        n_min, n_max = host_n_block_range(m, seqlens_q[b], seqlens_k[b], tile_m, tile_n, causal, local, wl, wr)
        return n_of[cta] - n_min if down_of[cta] else n_max - 1 - n_of[cta]

    return visits, rank, ctas


def representative_problem(head_dim: int, dtype: str = "bf16", *, causal=False, local=False, softcap=0.0,
                           varlen=False, seqused_k=False) -> AttnProblem:
    """A problem for the families' ``variants`` (sizes are irrelevant to the compile key)."""
    return AttnProblem(
        dtype, 2, 1024, 1024, 8, 2, head_dim, head_dim, head_dim**-0.5, causal=causal, local=local,
        window_left=128 if local else 1024, window_right=0 if local else 1024, softcap=softcap,
        varlen_q=varlen, varlen_k=varlen, has_seqused_k=seqused_k, total_q=2048 if varlen else 0,
        total_k=2048 if varlen else 0)
