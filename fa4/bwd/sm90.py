"""Hopper (sm90 family) attention backward: TMA + wgmma, warp-specialized.

One CTA per (K block ``n``, kv head, batch) keeps K and V of its ``tile_n`` keys in shared memory
and dK, dV in registers, and walks every (q head of its GQA group, m_block) that sees those keys, so
dK/dV are summed over the group inside the CTA (no atomics, deterministic). Per step
(:meth:`FlashBwdSm90.mma_step`), with S kept transposed (keys x queries, so that P^T and dS^T are
accumulators of the keys' rows):

    S^T  = K Q^T                             (wgmma, both operands from smem)
    dP^T = V dO^T
    P^T  = exp2(S^T * scale_log2 - lse_log2[query])      (masks; softcap first)
    dV  += P^T dO                            (A: P^T from registers, or from smem: ``dkv_rs``)
    dS^T = P^T * (dP^T - D[query])           (softcap: * (1 - tanh^2))
    dQ   = dS K                              (A: dS from smem, the tile stored as dS^T)
    dK  += dS^T Q

then ``dK *= softmax_scale``. dQ of the step goes to a float32 smem tile in the fragment order of
dq_accum (Note [dQ accumulator layout] in fa4/bwd/workspace.py) and a writer warp adds it into the
global accumulator with one bulk reduce-add per warpgroup (in a fixed order when deterministic:
Note [Deterministic dQ] in fa4/bwd/common.py). The preprocess and postprocess, workspaces and
launch order are the family-independent driver's (fa4/bwd/common.py).

Warp roles (``kernel`` dispatches; ``128 * (num_wg + 1)`` threads)
    * warpgroup 0 (``setmaxnreg`` down to ``producer_regs``):
        - warp 0, :meth:`load`: TMA of K and V once, then per step Q + the ``lse_log2`` rows and
          dO + the ``dpsum`` rows;
        - warp 1, :meth:`store_dq` (not with ``dq_direct``): per step and warpgroup, waits for the
          warpgroup's dQ tile in smem, bulk-reduce-adds it into ``dq_accum`` (deterministic: after
          the slot's earlier contributors, then publishes); with ``dq_direct`` and
          ``deterministic``, :meth:`sequence_dq` (Note [Ordered direct dQ]);
        - warps 2, 3 exit.
    * warpgroups 1..num_wg, the consumers (``setmaxnreg`` up to ``consumer_regs``): :meth:`mma`
      (the step loop, then :meth:`epilogue`: dK, dV through smem to gmem with 16-byte stores).

Tiling. ``dkv_rs`` (head dims <= 128): ``tile_n = 64 * num_wg``, warpgroup ``w`` owns keys
``[64 w, 64 w + 64)`` in S^T, dP^T, dK, dV, and its P^T / dS^T accumulators are the A operands of
its dV / dK wgmmas straight from registers. Otherwise (larger head dims, where a warpgroup cannot
hold 64 rows of both dK and dV): ``tile_n = 64``, the warpgroups split the queries of S^T and the
head dim of dK, dV, and P^T, dS^T go through smem (``sP``, ``sdS``) for every warpgroup's dV, dK.
dQ: warpgroups along the rows when ``tile_m`` has one 64-row block per warpgroup, else along the
head dim (:attr:`BwdSm90Config.dq_atoms`).

Clusters: with ``two_cta`` two CTAs on adjacent K blocks exchange halves of dS^T (Note [Two-CTA dQ]);
otherwise one CTA per cluster.

Pipelines (``cutlass.pipeline.PipelineTmaAsync``; producer = warp 0, one arrive with the expected
transaction bytes; a consumer arrive is one per consumer warp, from lane 0: ``4 * num_wg``)
    * ``pipeline_kv``: 1 stage, K + V (+ the partner's K with ``two_cta``), loaded once; never
      released (one tile per CTA).
    * ``two_cta``, per P/dS stage: ``ds_full`` (arrive count 1, consumer thread 0's, plus the bytes of
      the partner's bulk copy) and ``ds_empty`` (arrive count ``num_wg``, remote arrives of the
      partner's warpgroups): Note [Two-CTA dQ].
    * ``pipeline_q``: ``q_stages``, Q tile + ``tile_m`` floats of ``lse_log2``; released after the
      step's dK wgmma (the last reader of sQ).
    * ``pipeline_do``: ``q_stages``, dO tile + ``dpsum`` rows; released after the step's dV wgmma.

Named barriers (ids in ``_BAR``)
    * ``pds``: every consumer thread, after the step's dS^T (and P^T) smem stores (fenced for the
      async proxy), before the wgmmas that read them. With one P/dS stage (``pds_stages = 1``)
      also ``pds_free`` before the stores: the other warpgroups have finished the previous step's
      wgmmas on that stage. With two stages the previous ``pds`` barrier already guarantees it.
    * ``dq_empty`` / ``dq_full`` of warpgroup ``w`` and dQ buffer ``b`` (:meth:`FlashBwdSm90.dq_bar`;
      128 threads of the warpgroup + the writer warp; ``dq_stages`` buffers, step ``t`` uses
      ``t % dq_stages``): the writer arrives on ``dq_empty`` once the bulk reduce of the buffer's
      previous step has read warpgroup ``w``'s part (with two buffers, for step ``t + 1`` while it
      handles step ``t``); the warpgroup syncs on it, stores, fences, and arrives on ``dq_full``,
      which the writer syncs on before its bulk reduce. One barrier per buffer, so that an arrive
      for one step never lands in the generation of another. With ``dq_direct`` and
      ``deterministic`` the direction is reversed (Note [Ordered direct dQ]): warp 1 arrives on
      ``dq_full`` once the slot is this CTA's turn, the warpgroup syncs on it, adds, and arrives on
      ``dq_empty``, which warp 1 syncs on before it publishes; warp 1 arrives for step ``t + 1``
      only after that sync, so the generations never mix here either.
    * ``epi``: every consumer thread, around the dK/dV smem tiles (which reuse sK, sV) and the
      zeroing of K/V rows past ``seqused_k``.

Note [K/V rows past seqused_k]
    TMA loads the whole K and V tiles. With ``seqused_k`` the rows between the used length and the
    tile's end are KV-cache slots that may hold anything, NaN included: their scores are masked and
    P^T is 0 there, but ``dP^T = V dO^T`` and ``dQ = dS K`` multiply them, and ``0 * NaN`` is NaN.
    So the consumers zero those rows of sK and sV before the first step. Rows past a varlen
    sequence's end are the next sequence's (finite), or beyond the tensor (TMA reads zeros); query
    rows past ``seqlen_q`` read ``lse_log2 = +inf`` and ``dpsum = 0`` (Note [Padded row tiles]), so
    their P and dS are exactly 0 and nothing leaks into dK, dV.

Note [Direct dQ]
    The sdQ tile that the writer warp reduces from costs ``4 * tile_m * head_dim`` bytes of smem,
    64 KB at head dim 256, where it is what keeps the kernel at one Q/dO stage (every step then
    waits for its loads). With ``dq_direct`` each consumer thread adds its dQ fragment into
    dq_accum itself, ``red.global.add.v4.f32`` in the fragment order (16 per thread per step at
    d256, with immediate offsets), and the smem goes to a second Q/dO stage: measured +35% at d256.
    At head dims <= 128 the steps are short and the reductions' issue cost shows (-2% at d128), so
    the bulk reduce stays there. Unordered by itself; deterministic runs order the adds of each
    slot (Note [Ordered direct dQ]).

Note [Programmatic dependent launch]
    A backward call is the preprocess, this kernel, then the postprocess (or the dQ pass; torch's
    sums and copies of a split GQA group come between). With ``pdl`` this kernel and the
    postprocess are launched as programmatic dependents (Hopper's ``griddepcontrol``): each may
    start on the SMs its predecessor frees before that grid has finished, once every CTA of the
    predecessor has let it (``launch_dependents``: the preprocess at each CTA's start, this kernel
    once its barriers are set up) or exited; a kernel that never lets it (torch's, the dQ pass) is
    waited for as usual. The dependent waits (``griddepcontrol.wait``: the predecessor complete and
    its writes visible) before it touches anything the predecessor writes: here lse_log2, dpsum,
    dq_accum and the slot counters. Warp 0 issues K and V first and waits before the first step's
    Q / lse_log2 load; the writer (or sequencing) warp and the consumers wait before their first
    instruction; the postprocess waits before it reads anything. Two rules keep this safe:
    * The preprocess stays a plain launch. It then starts only after every earlier kernel has
      finished, so the K / V (and cu_seqlens, block table) reads before the wait see their final
      values.
    * Nothing is written to global memory before the wait. torch's caching allocator hands out
      memory freed on the stream as if the stream's kernels ran one after the other: a block the
      still-running preprocess reads (``_compact(lse)``'s temporary, freed when run_preprocess
      returns) may back anything allocated after it (run_backward allocates a split group's dK / dV
      partials before the preprocess, so that no kernel of the GPU tests' NaN fill comes between
      the two launches).
    What it saves: the launch gaps, and this kernel's barrier set-up, descriptor prefetch and K / V
    loads under the preprocess's last CTAs (a few microseconds a call, most of it at short
    sequences, where the two small kernels are 10-25% of the call: RESULTS v0.18). flash-attn-4
    (4.0.0b36) launches its sm90 main kernel as a programmatic dependent of its preprocess (which is
    one too), its loader waiting before the row statistics; its postprocess is a plain launch, which
    ``pdl_post`` off reproduces here. Measured (RESULTS v0.56): +0.7-0.8% at d128 s1k, -1.6% at d128
    s8k (with the postprocess a dependent too), hence ``PDL_MAX_SEQLEN_K``. One candidate for the
    loss: the postprocess's CTAs, let in once the last wave of this kernel has started, sit on the
    SMs beside it for that whole wave; ``pdl_post=False`` (a config field) tells them apart.

Note [Ordered direct dQ]
    With ``dq_direct`` and ``deterministic`` the consumers still add from registers, and warp 1
    orders the adds of each slot instead of reducing a tile (:meth:`FlashBwdSm90.sequence_dq`). Per
    step ``t``: its lane 0 spins until the slot's counter equals the CTA's rank (acquire), the warp
    arrives on each consumer warpgroup's ``dq_full`` barrier, which the warpgroup syncs on just
    before its adds; each warpgroup arrives on its ``dq_empty`` once its adds are issued, and the
    warp, synced on all of them, publishes (``fence.acq_rel.gpu``, then +1: the CTA-barrier +
    one-thread fence pattern of :func:`fa4.sched.semaphore.signal`). The counters, ranks and
    launch order are those of Note [Deterministic dQ], so the adds into each float32 element
    happen in the same order as with the writer warp, and the gradients are the same bits. The
    spin for step ``t + 1`` and the publish of step ``t`` run on warp 1 while the consumers compute
    step ``t + 1``; a consumer waits only when the slot's previous contributor is behind. The
    warpgroups' fragments are disjoint, so their adds need no order between them.

Note [Publish lag]
    Deterministic, the writer of each step waits for its slot's turn (spin), adds, waits for the adds
    to complete, and publishes. Serially that is two L2 round trips plus the reduce per step, about a
    step's compute at head dim 128, so the consumers waited on the writer. With ``publish_lag`` the
    writer spins for step ``t``'s slot first and only then waits for step ``t - 1``'s adds and
    publishes them: the spin and the completion overlap. Still no deadlock (Note [No deadlock] in
    fa4/sched/semaphore.py): while it holds back step ``t - 1``'s publish, the CTA of K block ``n``
    waits only for blocks ``< n`` of its (batch, kv head), launched before it, which never wait for
    it (with the rotated order: only for blocks that reach the slot at an earlier step, Note
    [Rotated order]). The successors of slot ``t - 1`` see it later by up to the spin, which cost
    more than it saved with the long steps of head dim 256 (measured; the tuning table turns it off
    there). One exception: the rotated order with a stagger of 1 (as many m_blocks as K blocks, a
    GQA group of 1), where block ``n``'s step ``t`` waits for block ``n + 1``'s step ``t - 1``, whose
    publish waits for its own step ``t``, ... around the pair back to block ``n``: a cycle, which hung
    the d64 sweep (v0.11) and would hang a d128 run with ``s_q`` near ``s_k / 2``. The writer
    publishes at once there (:func:`fa4.bwd.common.rotation_lags`: at every stagger of 1, any group,
    a margin around the cycle that :func:`fa4.sched.semaphore.simulate`, which models the lag, finds
    exactly at ``M == N`` with group 1 in the CPU tests). The lag has a cost in the causal down walk
    too: there block ``n + 1`` takes slot ``m`` after block ``n`` has published it, and with the lag
    that happens only once block ``n`` has taken slot ``m - 1``, so each rank trails the one before
    it by a whole step (the last of eight blocks of a pair in one wave idles about seven steps before
    its first add). From :data:`DET_LAG_MAX_BLOCKS` K blocks per sequence that costs more than the
    serial writer does, and causal runs publish at once (measured, v0.13). Since v0.14 this is the
    rule with :data:`PUBLISH_PEEK` off; the default is Note [Publish peek].

Note [Publish peek]
    ``publish_peek`` keeps the lag's overlap without its coupling, the split-phase pattern of
    Note [Split-phase] in fa4/sched/semaphore.py on the writer warp. Before step ``t``'s adds, lane 0
    reads slot ``t``'s counter with a relaxed load, not waited for. The warp then waits for step
    ``t - 1``'s adds to complete, and lane 0 publishes them: its ``fence.acq_rel.gpu`` is the release
    of those adds, and, after the relaxed read, the acquire of the value read. Only if that value was
    not yet the step's rank does lane 0 spin. The read is issued at the top of the step, as soon
    as the slot is known, before the wait for the reduces' smem reads (v0.13 issued it after that
    wait), so its round trip overlaps both waits and the fence. A publish never waits for the next
    slot's turn: block ``n + 1`` trails block ``n`` by a publish, not by a step, and no cycle can
    close in any order (Note [No deadlock] as without the lag). The costs: a second load when the
    slot is not ready, and the fence also waits for the read if the adds complete first. Step 0
    has no publish and fences on its own. The default (:data:`PUBLISH_PEEK`).

Note [Writer slots]
    The writer warp (and the sequencing warp of Note [Ordered direct dQ]) needs each step's slot:
    its (q head, m_block), the dq_accum tile and counter they address, and the rank it waits for.
    Those come from integer divisions by runtime values (the GQA group, the m_block count, the
    rotation's stagger), about 250 dependent instructions a step for one warp, and deterministic,
    that warp is what the consumers wait for (ncu, d128 s8k: they spent 20% of the kernel's stall
    samples at the dQ-buffer barrier while the writer never waited for a tile). So its 32 lanes
    compute the slots of 32 steps at once, lane ``l`` that of step ``32 c + l``
    (the same formulas, :meth:`FlashBwdSm90.slot_of`), and each step reads its own from lane
    ``t % 32`` with three shuffles (:meth:`FlashBwdSm90.next_slot`). Measured +1.5-6% in the rotated
    order at head dims 128 and 256, where it is the default (``lane_slots``); in the plain orders -5%
    to +2%, and at d64 in the rotated order -10% to +5% (noise, mean -1%), so those keep a slot per
    step (:data:`LANE_SLOTS_MIN_HD`).

Note [First store]
    The accumulator used to be zeroed by the preprocess before the main kernel added into it: at
    head dim 128 a 64 x 128 float32 tile per 64 query rows, 134 MB at 16k tokens x 16 heads, which
    took 40 of the preprocess's 68 us (the whole backward of d128 s1k causal is about 480 us). With
    ``dq_first_store`` the first contributor to each slot *stores* its tile (``cp.async.bulk``)
    and the others add on top of it, so ``dq_accum`` is never zeroed (preprocess ``zero_dq`` off);
    the slot counters that the preprocess zeroes instead (4 bytes a tile) tell the postprocess which
    tiles were written at all (a slot no key reaches is written as zeros, ``counted``).

    Deterministic: the slot's rank-0 contributor stores, the order already makes it the first (the
    default). Otherwise (an option, off: measured slower, :data:`DQ_FIRST_STORE`) the writer warp
    *claims* the slot at the top of the step, a relaxed ``atom.cas`` of the slot's counter from 0 to
    1, not waited for while its consumers still compute the step's dQ. The claimant stores and, once
    the store is complete, publishes it (``fence.acq_rel.gpu``, counter +1 to 2) at the top of its next
    step, before it claims again; a later contributor (its CAS read 1 or 2) spins with
    ``ld.acquire`` until 2 once its dQ is ready, and bulk-adds after a ``fence.proxy.async.global``.
    No deadlock: a writer spins only while it holds no unpublished claim, and a claimant publishes
    after its own consumers' dQ and its own store, which wait for no other CTA. The non-deterministic walks (m_blocks up from the diagonal) rarely bring two
    contributors to a slot at once with a causal mask; without a mask every K block of a pair
    starts at the same m_block, and the later ones wait about one store for the claimant.

Note [Block skip in the backward]
    A block-sparse call (Note [Block sparsity as a block table] in fa4/block_sparse.py) hides whole
    (q block, K block) pairs. With ``block_skip`` each CTA narrows its m_blocks in
    :meth:`FlashBwdSm90.block_range` to the range from the lowest m_block its K block is visible to
    (a table entry that is not 0, for any q head of the kv head's group) to the highest
    (:meth:`fa4.mods_kernel.BlockSkip.narrow_rows`: a warp reads 32 m_blocks' entries at once and
    takes the range from one ballot). Every role computes its work from :meth:`work_info`, with whole
    warps, so the producer, the consumers and the dQ writer walk the same narrowed steps. Hidden
    blocks inside the range are still computed, their scores masked by the table's mask function
    (P = dS = 0); for a document mask the range is the documents the K block's keys belong to. Each
    step reads its block's state (``BlockSkip.state``) as the forward's steps do: a whole block runs
    no mask function, a block marked 1 only the user's own mask_mod (INNER), a hidden or mixed one
    the table's (MIXED, compiled in always: :meth:`FlashBwdSm90.step_block_mods`). A K
    block no query sees gets no steps and writes dK = dV = 0, as a block past ``seqused_k`` does; a
    dQ slot no K block reaches keeps the zeros of the preprocess (or is written as zeros, ``counted``,
    after the first store). Not with the ordered dQ of determinism (Note [Deterministic dQ] in
    fa4/bwd/common.py): it counts on every K block of a slot's mask range taking its turn. So a
    deterministic block-sparse run takes the dQ pass (:data:`BLOCK_SPARSE_DET_DQ_PASS`): the main
    kernel is then not deterministic and narrows, and the pass narrows each Q block's K blocks as
    the forward does (:meth:`BlockSkip.narrow`); the sums of both skip terms that are exactly 0 and
    keep their order, so the run is still the same bits every time. Measured (v0.39, H100, the
    block-sparse document lists, b2 s8k h16 d128): 7.30-7.34 -> 1.28-1.31 ms, deterministic
    7.60-7.62 -> 1.87-1.88 ms (flash-attn-4: 14.5 / 15.9-16.0 ms).

Note [Two-CTA dQ]
    With ``two_cta`` a cluster of two CTAs takes two adjacent K blocks ``2x`` and ``2x + 1`` of a
    (batch, kv head), and both walk the union of the two blocks' (q head, m_block) steps in the same
    order (a block past its sequence, or a step outside its own block's mask range, computes with
    every key masked: P = dS = 0). dQ of a step is ``dS_0 K_0 + dS_1 K_1``: CTA ``r`` adds only the
    rows ``[r, r + 1) * tile_m / 2`` of it, over both K blocks, so the pair issues each dQ row's
    reduction once instead of twice. For that it keeps the partner's K tile (``sK_peer``, loaded once
    by TMA with its own K and V) and receives the partner's dS^T columns of its rows (``sdS_in``).
    The dS^T tile is stored in swizzle atoms of half its columns, halves outermost, so that each
    stage's half is one contiguous block: after the ``pds`` barrier, consumer thread 0 expects the
    partner's half on this CTA's ``ds_full`` barrier of the stage (arrive + transaction bytes) and
    sends the partner its half with one bulk copy into the partner's ``sdS_in`` stage, completing on
    the partner's ``ds_full``. The dQ wgmma then runs over the own half and K (at once) and, after
    ``ds_full``, over ``sdS_in`` and ``sK_peer``, accumulating; its tile is ``tile_m / 2`` rows
    (swapped, dQ^T = K^T dS^T, where that is no multiple of 64). Once a warpgroup's dQ wgmmas have
    completed, one thread per warpgroup arrives (remote, cluster scope) on the partner's
    ``ds_empty`` of the stage (arrive count: the warpgroups): the partner may send into that stage
    again, which it waits for (completion number ``use``, parity ``(use & 1) ^ 1``, the first use
    passing on the fresh barrier) before it stores that stage's dS^T, as the wait also covers the
    bulk copy's read of its own stage. The barriers are initialized before a cluster barrier, and a
    CTA leaves only after the partner's last arrives on its ``ds_empty`` (:meth:`drain_exchange`).
    dq_accum keeps its ``tile_m``-row tiles (row statistics, padding and a varlen sequence's first
    tile as without the cluster); a half is a contiguous ``tile_m / 2``-row part of one, in the
    fragment order of the half-tile wgmma, and the postprocess reads it as such (``ws_tile_m``).

Note [Split GQA group]
    A CTA sums dK / dV over the whole GQA group of its kv head. With few kv heads (MQA, or a
    tensor-parallel shard holding one kv head) that leaves ``n_blocks * heads_k * batch`` CTAs: d128
    s8k causal MQA at batch 2 is 128 CTAs for 132 SMs, whose longest (K block 0, every query of 16
    q heads) has twice the average's steps, so the kernel ran at 0.51x flash-attn-4's speed
    (docs/RESULTS.md v0.26, ``python -m fa4.bench --offgrid``). ``kv_split = S`` splits each group over S CTAs:
    the kernel sees ``heads_k * S`` virtual kv heads with ``group / S`` q heads each (virtual head
    ``hv`` holds q heads ``[hv * group / S, (hv + 1) * group / S)``, i.e. kv head ``hv // S``, whose
    K / V it loads). dK / dV go to float32 partials ``(b, s_k, heads_k * S, d)`` straight from
    registers (rows the sequence owns, columns of the real head dim), and the driver sums the S
    partials of each kv head in a fixed order (one ``torch.sum``, or in deterministic runs a fixed tree of
    adds, :func:`fa4.bwd.common.sum_partials`) into dk / dv (:func:`fa4.bwd.common.run_backward`):
    dK / dV are rounded to 16 bits once, as without the split. dQ is unchanged: its slot's contributors
    are still the K blocks of its one q head. Chosen by :func:`kv_split_for`; not with ``two_cta``.
    Runs that ask for determinism keep 1: the rule reads the batch (its size, its longest sequence),
    and a split changes the order of dK / dV's float32 sums, so a sample's bits would depend on the
    rest of its batch, which ``deterministic=True`` promises they do not. The kernel's ordered
    deterministic dQ modes see the virtual kv heads as kv heads (each dQ slot belongs to one virtual
    pair, whose K blocks add in the same rank order as without the split), so a forced split keeps
    them bit-exact over runs with dQ's bits unchanged (tests, sweep v59): a fixed split
    (``KernelOptions.bwd_kv_split``) is taken with determinism.

Note [no ``from __future__ import annotations``]
    ``cute.struct`` reads the field annotations of ``SharedStorage`` as objects.
"""

from dataclasses import dataclass, fields as dataclass_fields, replace
from functools import partial
from types import SimpleNamespace
from typing import ClassVar, Optional

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr, pipeline
from cutlass._mlir.dialects import nvvm
from cutlass.cute.nvgpu import cpasync, warpgroup

from fa4.arch import SM90_SMEM_PER_CTA
from fa4.bwd import common
from fa4.bwd.preprocess import _DTYPES
from fa4.bwd.workspace import (
    DqFragment,
    dq_accum_view,
    dq_tiled_mma,
    head_dim_padded,
    red_add_fragment,
    rows_tma_order,
    rows_view_tma,
    thread_fragment,
)
from fa4.config import AttnKernelConfig, AttnProblem, KernelOptions
from fa4.cute_utils import (
    bulk_copy_to_peer,
    bulk_reduce_add_f32,
    bulk_store,
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
from fa4.mask import AttentionMask
from fa4.mods import check_config, launch_aux, lookup
from fa4.mods_kernel import BlockSkip, UserMods, block_mods, check_block_skip, fake_aux
from fa4.sched import semaphore
from fa4.sched.tile import LOOSE_BOUND_RATIO, compact_tile, loose_bound, lowest_pow2, section_tile
from fa4.seqlen import SeqlenInfo, grid_extent, to_sdhb
from fa4.softmax import apply_softcap, emulated_elements, exp2_rows, exp2_select, score_scales, softcap_grad

SMEM_CAPACITY = SM90_SMEM_PER_CTA  # (fa4/arch.py)
# (consumer, producer) registers per thread after setmaxnreg. The CTA owns the registers it was
# launched with, 8 * floor(65536 / 384 / 8) = 168 per thread, so producer + 2 * consumer <= 3 * 168 =
# 504: a 240/240/32 split (512) made every setmaxnreg.inc wait forever for registers (measured: the
# GPU tests hung). :func:`register_budget_ok` checks it.
_REGS = {2: (240, 24)}


def register_budget_ok(num_wg: int) -> bool:
    """Whether the setmaxnreg split of ``num_wg`` consumer warpgroups fits the launch allocation."""
    consumer, producer = _REGS[num_wg]
    launch = 65536 // (128 * (num_wg + 1)) // 8 * 8
    return producer + num_wg * consumer <= launch * (num_wg + 1)


_BAR = SimpleNamespace(pds=1, pds_free=2, epi=3, dq_full=4, dq_empty=8)


@dataclass(frozen=True)
class CtaWork:
    """What one CTA does (:meth:`FlashBwdSm90.work_info`). Frozen, like :class:`SeqlenInfo` and
    :class:`AttentionMask`, so the tracer carries it through staged control flow as a value."""

    seq: SeqlenInfo
    mask: AttentionMask
    n_block: Int32
    head_kv: Int32
    batch: Int32
    group: Int32
    m_min: Int32
    num_m: Int32
    num_steps: Int32
    rows_k: Int32
    num_n: Int32  # K blocks with keys in this sequence (>= 1)
    rank: Int32  # in the cluster (two_cta), else 0
    down: Optional[Int32] = None  # det_tail: 1 if this pair walks the down order (Note [Down tail]), else 0


@dataclass(frozen=True)
class BwdSm90Config(AttnKernelConfig):
    """Compile key of :class:`FlashBwdSm90`.

    ``head_dim``: the head dim rounded up to 32 (:func:`fa4.bwd.workspace.head_dim_padded`); the
    real one is a runtime size. ``head_dim_v``: that of V, dO and dV when it differs (DeepSeek's
    (192, 128)), else 0 (:attr:`hd_v`). ``tile_m`` x ``tile_n``: Q rows per step x K rows per CTA.
    ``num_wg``: consumer warpgroups. ``dkv_rs``: P^T, dS^T stay in registers as the A operands of
    dV, dK (``tile_n = 64 * num_wg``), else they go through smem (``tile_n = 64``; module
    docstring). ``q_stages``: smem stages of Q/lse and dO/dpsum; ``pds_stages``: of dS^T (and P^T);
    ``dq_stages``: of the float32 dQ tile handed to the writer warp. ``publish_lag`` (deterministic):
    the writer publishes a step's slot after spinning for the next step's (Note [Publish lag]).
    ``publish_peek`` (deterministic, not with ``publish_lag``): Note [Publish peek]; the default of
    every deterministic run with the writer warp (:data:`PUBLISH_PEEK`, docs/RESULTS.md v0.14).
    ``det_rotate`` (deterministic, or the claims of ``dq_first_store``; no mask): the rotated order of
    Note [Rotated order] in fa4/bwd/common.py (:data:`CLAIM_ROTATE`). ``dq_direct``: the consumers add their dQ fragments into
    dq_accum with ``red.global.add.v4.f32`` from registers, no sdQ tile and no writer warp (Note
    [Direct dQ]; deterministic: in order, Note [Ordered direct dQ]). ``ds_from_p16``: dS^T from the 16-bit P^T (the dV wgmma's operand), not the
    float32 one, which frees S^T's registers early: d64's 128-row steps fit 240 registers without
    serialized wgmmas with it (and not without, unless ``dv_late``; the TUNING comment has the
    numbers); the d64 default until v0.13, now an option. ``tile_m = 80`` runs the dQ wgmma swapped (``dq_swap``, dQ^T = K^T dS^T,
    DqFragment.swap) with one dQ buffer: an experiment, compiled but wrong on the GPU (NaN gradients,
    an xfail in tests/test_bwd_gpu.py::test_bwd_sm90_experiments) and slower than the default where
    timed (v0.7); make_config refuses ``bwd_tile_m=80``. ``two_cta``: Note [Two-CTA dQ].
    ``stats_early``: where the row statistics are read from smem into registers: 0 after both
    S^T / dP^T wgmmas are issued (with ``rows_late``: each where it is used), 1 lse before the S^T
    issue (also with ``rows_late``), 2 also dpsum before the dP^T issue (not with ``rows_late``). In
    ncu, d128 s8k, the first use of lse waited on its ``LDS`` for 12.8% of the kernel's stall
    samples, the load queued behind the wgmmas' operand reads (:data:`STATS_EARLY_MAX_HD`).
    ``lane_slots``: the dQ writer (or sequencing) warp computes 32 steps' slots at once, one per lane
    (Note [Writer slots]; the default in the rotated order from head dim 128, :data:`LANE_SLOTS_MIN_HD`).
    ``det_up`` (deterministic, causal or local): the up order of Note [Up order] in
    fa4/bwd/common.py (m_blocks walked up from the diagonal, the largest K block adds first, the
    shortest blocks launch first); the causal default without GQA (:data:`DET_UP`). ``det_tail``
    (with ``det_up``; 0: off), ``det_tail_share``: the last ``min(det_tail, heads_k //
    det_tail_share)`` kv heads of every batch walk the down order instead and launch last (Note
    [Down tail], :data:`DET_TAIL`). ``det_rounds`` (with ``det_rotate``, deterministic): a pair's
    K blocks rotate in that many rounds (Note [Rotation rounds], :data:`DET_ROUNDS`). ``dv_late`` (with ``dkv_rs``): the dV wgmma is
    issued after dS^T is computed and stored, next to dQ and dK (flash-attn-4's place), not right
    after P^T, so the float32 P^T is dead before P^T's 16-bit registers are pinned by an in-flight
    wgmma; the d64 default (128-row steps, dS from the float32 P: no spills or serialized wgmmas, and
    a step loop of 633 instructions against 760 with ``ds_from_p16``; measured +1-4%, TUNING).
    ``step_cursor`` (not with ``det_rotate``): no division of the step index by the runtime GQA group
    in every step (:meth:`step_slot`: about 40 instructions of the d128 causal consumer loop's 503
    in the CPU SASS). The producer advances its (q head, m_block) from the previous step's
    (:meth:`FlashBwdSm90.next_step`); with a causal mask the consumers tell the masked steps by
    the step index and compute the m_block on those only. An experiment: the same bits as the
    default on the H200, and no clear gain (v0.13: d128 causal s8k 568 / 527 -> 558 / 547 TFLOP/s,
    s1k 345 / 333 -> 306 / 338, causal deterministic 500 / 495 -> 504 / 494).
    ``dq_first_store`` (the writer warp, not ``two_cta``): the first contributor of each dq_accum
    slot stores its tile instead of adding it, so the preprocess does not zero the accumulator
    (Note [First store]; the slot counters are allocated and zeroed in every mode then).
    ``dq_pass`` (not ``two_cta``; the default from padded head dim 160 when deterministic or
    without a mask, from 224 with one, :data:`DQ_PASS_MIN_HD`, :data:`DQ_PASS_MASKED_MIN_HD`): no
    dQ here, dK and dV only; the dQ pass (:mod:`fa4.bwd.dq_sm90`, Note [dQ pass]) computes dQ
    after this kernel, without reductions.
    ``exp2_emu_frac``: the share of P^T's exponentials computed by the polynomial on the FMA pipe
    instead of MUFU (Note [exp2 emulation] in fa4/softmax.py; the same columns of every row).
    ``kv_split`` (a power of two dividing the GQA group; not with ``two_cta``): the q heads
    of a kv head are split over that many CTAs per K block, each writing float32 partial dK / dV
    (Note [Split GQA group]).
    ``compact_grid`` (varlen K, not deterministic, not ``two_cta``, not ``dq_first_store``): the grid
    holds ``packed K rows // tile_n + batch`` K-block slots per kv head instead of ``ceil(max_seqlen_k
    / tile_n) * batch``, so no CTA is launched past its sequence's end (Note [Compact varlen grid];
    :data:`COMPACT_VARLEN`, off).
    ``block_skip`` (not deterministic): ``(aux slot, block_q, block_k)`` of a block-sparse call's
    block table (``AttnProblem.block_table``), ``()`` without one: each CTA narrows its m_blocks to
    those its K block is visible to (Note [Block skip in the backward]).
    ``pdl``: this kernel and (with ``pdl_post``) the postprocess are programmatic dependent launches
    (Note [Programmatic dependent launch]; :data:`PDL`); ``pdl_post`` off, this kernel lets nothing
    launch early and the postprocess is launched as before (flash-attn-4's form).
    """

    head_dim: int = 128
    head_dim_v: int = 0
    tile_m: int = 64
    tile_n: int = 128
    num_wg: int = 2
    dkv_rs: bool = True
    q_stages: int = 2
    pds_stages: int = 2
    dq_stages: int = 1
    deterministic: bool = False
    publish_lag: bool = False
    publish_peek: bool = False
    det_rotate: bool = False
    dq_direct: bool = False
    ds_from_p16: bool = False
    two_cta: bool = False
    stats_early: int = 0
    lane_slots: bool = False
    det_up: bool = False
    dv_late: bool = False
    step_cursor: bool = False
    dq_first_store: bool = False
    det_tail: int = 0
    det_tail_share: int = 8
    det_rounds: int = 1
    dq_pass: bool = False
    exp2_emu_frac: float = 0.0
    kv_split: int = 1
    compact_grid: bool = False
    block_skip: tuple = ()
    pdl: bool = False
    pdl_post: bool = True

    KERNEL: ClassVar[str] = "fa4.bwd.sm90:FlashBwdSm90"
    REQUIRED_SASS: ClassVar[tuple] = ("HGMMA", "UTMALDG")  # checked by tests/test_compile.py
    # 13 of its 81 variants (seven deterministic, five two-CTA, one plain d128) compile to other
    # instructions without strength reduction, not timed on a GPU: it keeps the pass (Note [Compiler
    # switches] in fa4/jit.py, RESULTS v0.54).
    PASS_SWITCHES_OK: ClassVar[bool] = False

    @property
    def num_threads(self) -> int:
        return 128 * self.num_wg

    @property
    def hd_v(self) -> int:
        """The padded head dim of V, dO and dV."""
        return self.head_dim_v or self.head_dim

    @property
    def cluster_n(self) -> int:
        """CTAs per cluster along the K blocks (Note [Two-CTA dQ])."""
        return 2 if self.two_cta else 1

    @property
    def dq_rows(self) -> int:
        """Rows of dQ this CTA adds per step: the step's ``tile_m``, or its half with ``two_cta``."""
        return self.tile_m // self.cluster_n

    @property
    def dq_swap(self) -> bool:
        """dQ^T = K^T dS^T (the head dim as wgmma's M) for dQ tiles of rows that are no multiple of 64."""
        return self.dq_rows % 64 != 0

    @property
    def dq_atoms(self) -> tuple[int, int]:
        """Warpgroups of the dQ wgmma along its (M, N): (rows, head dim), swapped (head dim, rows)."""
        if self.dq_swap:
            return self.num_wg, 1
        am = min(self.dq_rows // 64, self.num_wg)
        return am, self.num_wg // am

    @property
    def dq_hd_split(self) -> int:
        """Warpgroups of the dQ wgmma along the head dim."""
        return self.dq_atoms[0 if self.dq_swap else 1]

    @property
    def rows_stride(self) -> int:
        """Floats per stage of the sLSE / sD row tiles: ``tile_m`` rounded up to 128 bytes (a TMA
        destination's alignment)."""
        return (self.tile_m + 31) // 32 * 32

    @property
    def dq_fragment(self) -> DqFragment:
        """The order of this kernel's dQ tiles in dq_accum (Note [dQ accumulator layout])."""
        am, an = self.dq_atoms
        return DqFragment("sm90", self.num_threads, am, an, self.dq_swap)

    @property
    def walks_down(self) -> bool:
        """A CTA walks its m_blocks down from the last one (deterministic, but not the up order)."""
        return self.deterministic and not self.det_up

    @property
    def rows_late(self) -> bool:
        """Read lse / dpsum from smem where each query column is used, not ahead into registers: for
        steps of more than 64 rows, where the accumulators leave no room for 2 x tile_m / 4 registers
        of row statistics."""
        return self.tile_m > 64

    def smem_fields(self, sizes: Optional[dict] = None) -> list:
        """The fields of the kernel's shared storage, in order: ``(name, type, count, alignment)``
        (``sizes``: element counts of the smem layouts, traced; default: whole tiles). One list for
        :meth:`smem_bytes` and ``FlashBwdSm90._setup``, so the estimate is the struct's size."""
        d, dv, m, n = self.head_dim, self.hd_v, self.tile_m, self.tile_n
        sizes = sizes or {"sQ": m * d * self.q_stages, "sdO": m * dv * self.q_stages, "sK": n * d, "sV": n * dv,
                          "sdS": n * m * self.pds_stages}
        rows = self.rows_stride * self.q_stages
        fields = [("mbar_kv", "i64", 2, 8), ("mbar_q", "i64", 2 * self.q_stages, 8),
                  ("mbar_do", "i64", 2 * self.q_stages, 8), ("sLSE", "f32", rows, 128), ("sD", "f32", rows, 128)]
        if self.two_cta:  # ds_full, ds_empty per P/dS stage (Note [Two-CTA dQ])
            fields.append(("mbar_ds", "i64", 2 * self.pds_stages, 8))
        if self.dkv_rs:  # a placeholder of one element, in the slack before the aligned tiles
            fields.append(("sP", "16b", 1, 16))
        fields += [("sQ", "16b", sizes["sQ"], 1024), ("sdO", "16b", sizes["sdO"], 1024), ("sK", "16b", sizes["sK"], 1024),
                   ("sV", "16b", sizes["sV"], 1024), ("sdS", "16b", sizes["sdS"], 1024)]
        if self.two_cta:  # the partner's K tile and the half of its dS^T that this CTA's dQ rows need
            fields += [("sK_peer", "16b", sizes["sK"], 1024), ("sdS_in", "16b", sizes["sdS"] // 2, 1024)]
        if not self.dq_direct and not self.dq_pass:
            fields.append(("sdQ", "f32", self.dq_rows * d * self.dq_stages, 1024))
        if not self.dkv_rs:
            fields.append(("sP", "16b", sizes["sdS"], 1024))
        return fields

    def smem_bytes(self) -> int:
        """Bytes of the shared storage struct (fields aligned in order, the size rounded up to the
        largest alignment)."""
        nbytes = {"i64": 8, "f32": 4, "16b": 2}
        off, top = 0, 1
        for _, ty, count, align in self.smem_fields():
            off = (off + align - 1) // align * align + nbytes[ty] * count
            top = max(top, align)
        return (off + top - 1) // top * top


class FlashBwdSm90:
    """See the module docstring."""

    def __init__(self, cfg: BwdSm90Config):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        self.tile_m, self.tile_n, self.hd, self.hd_v = cfg.tile_m, cfg.tile_n, cfg.head_dim, cfg.hd_v
        self.num_wg = cfg.num_wg
        self.num_consumer_threads = 128 * cfg.num_wg
        self.num_threads = 128 * (cfg.num_wg + 1)
        self.consumer_regs, self.producer_regs = _REGS[cfg.num_wg]
        self.q_stages, self.pds_stages = cfg.q_stages, cfg.pds_stages
        self.rs = cfg.dkv_rs
        # Floats of dq_accum per consumer thread, and per warpgroup (one bulk reduce each).
        self.dq_frag_size = cfg.dq_rows * cfg.head_dim // self.num_consumer_threads
        self.dq_chunk = self.dq_frag_size * 128
        # User functions (fa4/mods.py), None when absent.
        self.score_mod, self.mask_mod = lookup(cfg.score_mod), lookup(cfg.mask_mod)
        self.score_mod_bwd = lookup(cfg.score_mod_bwd)
        self.user_mods = self.score_mod is not None or self.mask_mod is not None

    @property
    def dkv_split(self) -> int:
        """Warpgroups along the head dim of dK / dV."""
        return 1 if self.rs else self.num_wg

    def dq_bar(self, base: int, wg, step):
        """Named barrier of warpgroup ``wg``'s part of the dQ buffer that step ``step`` uses."""
        if const_expr(self.cfg.dq_stages == 1):
            return base + wg
        return base + wg * self.cfg.dq_stages + step % self.cfg.dq_stages

    @staticmethod
    def atom_cols(cols: int) -> int:
        """Columns whose swizzle atom an MN-major wgmma operand of ``cols`` columns per warpgroup
        partitions into: ``cols`` when a 128-byte (64-column) atom divides it, else 16 (32-byte)."""
        return cols if cols % 64 == 0 else 16

    # ----------------------------------------------------------------------------------------
    # Protocol
    # ----------------------------------------------------------------------------------------

    @staticmethod
    def can_implement(cfg: BwdSm90Config) -> None:
        cfg.check_target(_DTYPES, head_dim_multiple=32)
        name = "BwdSm90Config"
        if cfg.arch != "sm_90a":
            raise ValueError(f"{name}.arch must be sm_90a (wgmma, setmaxnreg), got {cfg.arch!r}")
        if cfg.num_wg not in _REGS:
            raise ValueError(f"{name}.num_wg must be one of {tuple(_REGS)}, got {cfg.num_wg}")
        if not cfg.pdl_post and not cfg.pdl:
            raise ValueError(f"{name}.pdl_post=False (the postprocess a plain launch) only means something with "
                             "pdl; without pdl leave it True (one compile key per kernel)")
        if cfg.compact_grid and not (cfg.varlen_k and not cfg.deterministic and not cfg.two_cta
                                     and not cfg.dq_first_store):
            raise ValueError(f"{name}.compact_grid (Note [Compact varlen grid]) needs varlen K (cu_seqlens_k) and "
                             "none of deterministic, two_cta, dq_first_store (their orders index K blocks by "
                             "the grid's x)")
        if cfg.causal and cfg.local:
            raise ValueError(f"{name}: causal and local are exclusive (local with window_right=0 is causal)")
        # (the ordered dQ and the rotated order: Note [Block skip in the backward])
        check_block_skip(cfg, name, deterministic=cfg.deterministic, det_rotate=cfg.det_rotate)
        if cfg.tile_m not in (64, 80, 128):
            raise ValueError(f"{name}.tile_m (KernelOptions.bwd_tile_m) must be 64, 80 or 128, got {cfg.tile_m}")
        if cfg.two_cta and not (cfg.head_dim in (64, 128) and cfg.tile_m in (64, 128)):
            # (The exchange's half tiles must be whole swizzle atoms of tile_m / 2 columns.)
            raise ValueError(f"{name}.two_cta (Note [Two-CTA dQ]) serves padded head dims 64 and 128 with tile_m 64 "
                             f"or 128, got head_dim {cfg.head_dim}, tile_m {cfg.tile_m}")
        if cfg.dq_swap and not (cfg.dkv_rs and cfg.head_dim % (64 * cfg.num_wg) == 0):
            raise ValueError(f"{name}: dQ tiles of {cfg.dq_rows} rows (the swapped dQ wgmma) need dkv_rs and a head "
                             f"dim that splits into {cfg.num_wg} warpgroups of 64, got head_dim {cfg.head_dim}")
        want_n = 64 * cfg.num_wg if cfg.dkv_rs else 64
        if cfg.tile_n != want_n:
            raise ValueError(f"{name}.tile_n (KernelOptions.bwd_tile_n) must be {want_n} with dkv_rs={cfg.dkv_rs} "
                             f"and {cfg.num_wg} consumer warpgroups, got {cfg.tile_n}")
        if not cfg.dkv_rs and cfg.tile_m % (16 * cfg.num_wg):
            raise ValueError(f"{name}: tile_m {cfg.tile_m} does not split into {cfg.num_wg} warpgroups' S^T columns")
        am, an = cfg.dq_atoms
        mm, nn = cfg.dq_fragment.mma_shape(cfg.dq_rows, cfg.head_dim)
        if mm % (64 * am) or nn % (8 * an) or nn // an > 256:
            raise ValueError(f"{name}: a {cfg.dq_rows}x{cfg.head_dim} dQ tile does not split into {am}x{an} "
                             "warpgroup wgmmas")
        if not 0.0 <= cfg.exp2_emu_frac <= 1.0:
            raise ValueError(f"{name}.exp2_emu_frac (BwdSm90Config) must be in [0, 1], got {cfg.exp2_emu_frac}")
        if cfg.stats_early not in (0, 1, 2):
            raise ValueError(f"{name}.stats_early (BwdSm90Config) must be 0, 1 or 2, got {cfg.stats_early}")
        if cfg.head_dim_v and (cfg.head_dim_v % 32 or not 32 <= cfg.head_dim_v <= (128 if cfg.dkv_rs else 256)):
            raise ValueError(f"{name}.head_dim_v must be a multiple of 32 in [32, {128 if cfg.dkv_rs else 256}] "
                             f"(dK and dV share a warpgroup's registers with dkv_rs), got {cfg.head_dim_v}")
        if cfg.kv_split < 1 or cfg.kv_split & (cfg.kv_split - 1) or (cfg.kv_split > 1 and cfg.two_cta):
            raise ValueError(f"{name}.kv_split (Note [Split GQA group]) must be a power of two, and 1 with "
                             f"two_cta, got {cfg.kv_split}")
        if cfg.two_cta and not (cfg.dkv_rs and cfg.pds_stages == 2 and not cfg.deterministic):
            raise ValueError(f"{name}.two_cta (Note [Two-CTA dQ]) needs dkv_rs, two P/dS stages and "
                             "deterministic=False")
        if cfg.q_stages not in (1, 2) or cfg.pds_stages not in (1, 2) or cfg.dq_stages not in (1, 2):
            raise ValueError(f"{name}.q_stages / pds_stages / dq_stages must be 1 or 2, got {cfg.q_stages} / "
                             f"{cfg.pds_stages} / {cfg.dq_stages}")
        if cfg.det_rotate and not ((cfg.deterministic or cfg.dq_first_store) and not cfg.causal and not cfg.local):
            raise ValueError(f"{name}.det_rotate (Note [Rotated order]) needs deterministic=True (or the claims of "
                             "dq_first_store) and no causal or local mask")
        if cfg.step_cursor and cfg.det_rotate:
            raise ValueError(f"{name}.step_cursor follows the plain and up orders, not det_rotate")
        if cfg.dv_late and not cfg.dkv_rs:
            raise ValueError(f"{name}.dv_late reorders the register-operand dV wgmma; it needs dkv_rs")
        if cfg.det_up and not (cfg.deterministic and (cfg.causal or cfg.local) and not cfg.det_rotate
                               and not cfg.two_cta):
            raise ValueError(f"{name}.det_up (Note [Up order]) needs deterministic=True and a causal or local mask")
        if cfg.det_rounds < 1 or (cfg.det_rounds > 1 and not (cfg.det_rotate and cfg.deterministic)):
            raise ValueError(f"{name}.det_rounds (Note [Rotation rounds]) needs det_rotate and deterministic=True, and "
                             f"must be >= 1; got {cfg.det_rounds}")
        if cfg.det_tail < 0 or cfg.det_tail_share < 1 or (cfg.det_tail and not (cfg.det_up and not cfg.step_cursor)):
            raise ValueError(f"{name}.det_tail (Note [Down tail]) needs det_up and no step_cursor, det_tail >= 0 and "
                             f"det_tail_share >= 1; got {cfg.det_tail} / {cfg.det_tail_share}")
        if cfg.publish_peek and not (cfg.deterministic and not cfg.publish_lag):
            raise ValueError(f"{name}.publish_peek (Note [Publish peek]) orders the deterministic dQ adds; it needs "
                             "deterministic=True and no publish_lag")
        if cfg.publish_lag and not (cfg.deterministic and not cfg.dq_direct):
            raise ValueError(f"{name}.publish_lag orders the deterministic dQ writer; it needs deterministic=True "
                             "and no dq_direct (the ordered direct adds have their own overlap, Note [Ordered direct dQ])")
        if cfg.dq_pass and (cfg.two_cta or cfg.dq_first_store):
            raise ValueError(f"{name}.dq_pass (Note [dQ pass] in fa4/bwd/dq_sm90.py) needs two_cta=False and "
                             "dq_first_store=False")
        if cfg.dq_first_store and (cfg.dq_direct or cfg.two_cta):
            raise ValueError(f"{name}.dq_first_store (Note [First store]) is the dQ writer warp's; it needs "
                             "dq_direct=False and two_cta=False")
        check_config(cfg, name, backward=True)
        if cfg.smem_bytes() > SMEM_CAPACITY:
            raise ValueError(f"{name}: {cfg.smem_bytes()} bytes of shared memory at head_dim {cfg.head_dim}, "
                             f"tile {cfg.tile_m}x{cfg.tile_n}, {cfg.q_stages} Q stages, {cfg.pds_stages} dS stages "
                             f"exceed sm_90a's {SMEM_CAPACITY}")

    @staticmethod
    def fake_args(cfg: BwdSm90Config) -> tuple:
        args = common.fake_args(cfg)
        return args[:-1] + (fake_aux(cfg.aux),) + args[-1:]  # the aux tensors before the stream

    # ----------------------------------------------------------------------------------------
    # Host side
    # ----------------------------------------------------------------------------------------

    def _setup(self):
        """Smem layouts, tiled MMAs and the shared storage struct (trace-time constants)."""
        dt, m, n, hd = self.dtype, self.tile_m, self.tile_n, self.hd
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        # MN-major views: sQ^T and sdO^T are the B operands of dK / dV (head dim split over the
        # warpgroups without dkv_rs), sK^T that of dQ (split over its warpgroups along the head dim).
        hdv = self.hd_v
        self.sQ_layout = smem_layout_sm90(dt, m, hd, self.q_stages, atom_cols=self.atom_cols(hd // self.dkv_split))
        self.sdO_layout = smem_layout_sm90(dt, m, hdv, self.q_stages, atom_cols=self.atom_cols(hdv // self.dkv_split))
        self.sK_layout = smem_layout_sm90(dt, n, hd, atom_cols=self.atom_cols(hd // self.cfg.dq_hd_split))
        # sV: also the dV epilogue's staging tile, stored per warpgroup's columns (whole swizzle atoms).
        self.sV_layout = self.sK_layout if const_expr(hdv == hd) else smem_layout_sm90(
            dt, n, hdv, atom_cols=self.atom_cols(hdv // self.dkv_split))
        self.sPdS_layout = smem_layout_sm90(dt, n, m, self.pds_stages)  # P^T / dS^T: queries contiguous
        # two_cta: the same tile in swizzle atoms of half its queries, halves outermost (memory: half,
        # stage, keys), so that each stage's half of the queries is one contiguous block, the unit of
        # the exchange with the partner CTA; sdS_in and the halves are (keys, queries / 2, stage) tiles.
        self.sHalf_layout = smem_layout_sm90(dt, n, m // 2, self.pds_stages)
        if const_expr(self.cfg.two_cta):
            self.sPdS_layout = smem_layout_sm90(dt, n, m, self.pds_stages, atom_cols=m // 2, order=(0, 2, 1))
        wg = self.num_wg
        # dK += dS^T Q and dV += P^T dO: the same tiling over their head dims (hd, hdv).
        if const_expr(self.rs):
            sdp_atoms, sdp_tile = (wg, 1, 1), (64, m)
            self.tiled_mma_dk, self.tiled_mma_dv = (sm90_utils.make_trivial_tiled_mma(
                dt, dt, K, MN, Float32, (wg, 1, 1), (64, d), warpgroup.OperandSource.RMEM) for d in (hd, hdv))
        else:
            sdp_atoms, sdp_tile = (1, wg, 1), (64, m // wg)
            self.tiled_mma_dk, self.tiled_mma_dv = (sm90_utils.make_trivial_tiled_mma(
                dt, dt, K, MN, Float32, (1, wg, 1), (64, d // wg)) for d in (hd, hdv))
        self.tiled_mma_sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, K, K, Float32, sdp_atoms, sdp_tile)
        self.tiled_mma_dq = dq_tiled_mma(self.cfg.dq_fragment, dt, self.cfg.dq_rows, hd)
        # Transaction bytes of a stage (Python ints: trace-time constants of the kernel).
        self.tma_bytes_q = m * hd * dt.width // 8 + 4 * m
        self.tma_bytes_do = m * hdv * dt.width // 8 + 4 * m
        self.tma_bytes_kv = ((2 if self.cfg.two_cta else 1) * hd + hdv) * n * dt.width // 8  # K, V (, peer's K)
        self.half_bytes = n * (m // 2) * dt.width // 8  # a stage's half of dS^T (two_cta)

        pds_elems = cute.cosize(self.sPdS_layout)

        types = {"i64": cutlass.Int64, "f32": Float32, "16b": dt}
        sizes = {"sQ": cute.cosize(self.sQ_layout), "sdO": cute.cosize(self.sdO_layout),
                 "sK": cute.cosize(self.sK_layout), "sV": cute.cosize(self.sV_layout), "sdS": pds_elems}
        fields = {}
        for name, ty, count, align in self.cfg.smem_fields(sizes):
            field = cute.struct.MemRange[types[ty], count]
            fields[name] = cute.struct.Align[field, align] if align > 8 else field
        SharedStorage = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        self.SharedStorage = SharedStorage

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # (b, s_q, h, d); varlen (1, total_q, h, d)
        mK: cute.Tensor,  # (b, s_k, h_k, d)
        mV: cute.Tensor,  # (b, s_k, h_k, d)
        mdO: cute.Tensor,  # (b, s_q, h, d)
        mLSElog2: cute.Tensor,  # (b, h, rows) float32 (fa4/bwd/workspace.py)
        mDpsum: cute.Tensor,  # (b, h, rows) float32
        mdQaccum: cute.Tensor,  # (b, h, rows, head_dim_padded) float32, fragment order
        mdK: cute.Tensor,  # (b, s_k, h_k, d)
        mdV: cute.Tensor,  # (b, s_k, h_k, d)
        mCuSeqlensQ: Optional[cute.Tensor],  # (b + 1,) int32
        mCuSeqlensK: Optional[cute.Tensor],  # (b + 1,) int32
        mSeqUsedK: Optional[cute.Tensor],  # (b,) int32
        mSemaphore: Optional[cute.Tensor],  # (b, h, ceil(max_seqlen_q / tile_m)) int32
        softmax_scale: Float32,
        softcap: Float32,
        window_left: Int32,
        window_right: Int32,
        max_seqlen_k: Int32,  # longest key sequence (varlen grid); ignored for fixed length
        section_pairs: Int32,  # (batch, kv head) pairs per launch section (Note [Launch order], common.py)
        mAux: Optional[tuple],  # the user functions' aux tensors (cfg.aux; fa4/mods.py)
        stream,
    ):
        common.check_main_kernel_types(self.cfg, self.dtype, mQ, mK, mV, mdO, mdK, mdV)
        self._setup()
        num_batch, seqlen_k = grid_extent(mK, mCuSeqlensK, max_seqlen_k)
        # Grid units along the K blocks: blocks, or with two_cta pairs of adjacent blocks (a cluster).
        num_x = cute.ceil_div(cute.ceil_div(seqlen_k, self.tile_n), self.cfg.cluster_n)
        # (batch, kv head) pairs: with kv_split, of the partials' virtual kv heads (Note [Split GQA group]).
        section = cutlass.max(cutlass.min(section_pairs, mdK.shape[2] * num_batch), 1)
        prescale, scale_log2 = score_scales(softmax_scale, softcap, self.cfg.has_softcap, self.score_mod is not None)
        if const_expr(not self.cfg.has_softcap and self.score_mod is None):
            prescale = Float32(1.0)

        g2s = cpasync.CopyBulkTensorTileG2SOp()
        q_tile = cute.select(self.sQ_layout, mode=[0, 1])
        tma_q, mQ_tma = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mQ), q_tile, (self.tile_m, self.hd))
        do_tile = cute.select(self.sdO_layout, mode=[0, 1])
        tma_do, mdO_tma = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mdO), do_tile, (self.tile_m, self.hd_v))
        tma_k, mK_tma = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mK), self.sK_layout, (self.tile_n, self.hd))
        tma_v, mV_tma = cpasync.make_tiled_tma_atom(g2s, to_sdhb(mV), self.sV_layout, (self.tile_n, self.hd_v))
        row_tile = cute.make_layout(self.tile_m)
        tma_lse, mLSE_tma = cpasync.make_tiled_tma_atom(g2s, rows_tma_order(mLSElog2), row_tile, (self.tile_m,))
        tma_dpsum, mDpsum_tma = cpasync.make_tiled_tma_atom(g2s, rows_tma_order(mDpsum), row_tile, (self.tile_m,))
        grid_x = num_x * self.cfg.cluster_n * mdK.shape[2] * num_batch
        if const_expr(self.cfg.compact_grid):  # Note [Compact varlen grid]: slots per kv head (packed K rows)
            num_x = mK.shape[1] // self.tile_n + num_batch
            grid_x = num_x * mdK.shape[2]
        self.kernel(
            mQ_tma, mK_tma, mV_tma, mdO_tma, mLSE_tma, mDpsum_tma, mdQaccum, mdK, mdV, mCuSeqlensQ, mCuSeqlensK,
            mSeqUsedK, mSemaphore, mAux, tma_q, tma_k, tma_v, tma_do, tma_lse, tma_dpsum, softmax_scale, prescale,
            scale_log2,
            window_left, window_right, num_x, num_batch, section, mQ.shape[1], mK.shape[1], mQ.shape[2],
            self.sQ_layout, self.sdO_layout, self.sK_layout, self.sV_layout, self.sPdS_layout, self.sHalf_layout,
            self.tiled_mma_sdp, self.tiled_mma_dk, self.tiled_mma_dv, self.tiled_mma_dq,
        ).launch(
            grid=(grid_x, 1, 1),
            block=[self.num_threads, 1, 1],
            cluster=(self.cfg.cluster_n, 1, 1),
            smem=self.SharedStorage.size_in_bytes(),
            stream=stream,
            min_blocks_per_mp=1,
            use_pdl=self.cfg.pdl,
        )

    # ----------------------------------------------------------------------------------------
    # Device side
    # ----------------------------------------------------------------------------------------

    @cute.kernel
    def kernel(
        self,
        mQ: cute.Tensor,  # TMA coordinates (s_q, d, h, b)
        mK: cute.Tensor,  # TMA coordinates (s_k, d, h_k, b)
        mV: cute.Tensor,
        mdO: cute.Tensor,
        mLSElog2: cute.Tensor,  # TMA coordinates (rows, h, b)
        mDpsum: cute.Tensor,  # TMA coordinates (rows, h, b)
        mdQaccum: cute.Tensor,
        mdK: cute.Tensor,
        mdV: cute.Tensor,
        mCuSeqlensQ: Optional[cute.Tensor],
        mCuSeqlensK: Optional[cute.Tensor],
        mSeqUsedK: Optional[cute.Tensor],
        mSemaphore: Optional[cute.Tensor],
        mAux: Optional[tuple],
        tma_q: cute.CopyAtom,
        tma_k: cute.CopyAtom,
        tma_v: cute.CopyAtom,
        tma_do: cute.CopyAtom,
        tma_lse: cute.CopyAtom,
        tma_dpsum: cute.CopyAtom,
        softmax_scale: Float32,
        prescale: Float32,
        scale_log2: Float32,
        window_left: Int32,
        window_right: Int32,
        num_x: Int32,
        num_batch: Int32,
        section: Int32,
        seqlen_q_static: Int32,
        seqlen_k_static: Int32,
        num_heads: Int32,
        sQ_layout: cute.ComposedLayout,
        sdO_layout: cute.ComposedLayout,
        sK_layout: cute.ComposedLayout,
        sV_layout: cute.ComposedLayout,
        sPdS_layout: cute.ComposedLayout,
        sHalf_layout: cute.ComposedLayout,
        tiled_mma_sdp: cute.TiledMma,
        tiled_mma_dk: cute.TiledMma,
        tiled_mma_dv: cute.TiledMma,
        tiled_mma_dq: cute.TiledMma,
    ):
        # Layouts and MMAs arrive as kernel arguments (values of the host function cannot be used
        # in the kernel's region); the role methods read them from self.
        self.tiled_mma_sdp, self.tiled_mma_dq = tiled_mma_sdp, tiled_mma_dq
        self.tiled_mma_dk, self.tiled_mma_dv = tiled_mma_dk, tiled_mma_dv
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == 0:
            for atom in (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_dpsum):
                cpasync.prefetch_descriptor(atom)
        storage = cutlass.memory.SmemAllocator().allocate(self.SharedStorage)
        pipes = self.make_pipelines(storage)
        if const_expr(self.cfg.two_cta):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(self.pds_stages):
                        cute.arch.mbarrier_init(storage.mbar_ds.data_ptr() + s, 1)  # ds_full
                        cute.arch.mbarrier_init(storage.mbar_ds.data_ptr() + self.pds_stages + s, self.num_wg)
        cute.arch.mbarrier_init_fence()
        if const_expr(self.cfg.two_cta):
            # The partner sends into this CTA's smem and arrives on its barriers: both are initialized.
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()
        else:
            cute.arch.sync_threads()
        # The postprocess may launch (Note [Programmatic dependent launch]).
        if const_expr(self.cfg.pdl and self.cfg.pdl_post):
            cute.arch.griddepcontrol_launch_dependents()

        # Each role builds its own view of the CTA's work and of the smem tensors: objects handed to
        # one role's loops must not be read by another role's branch.
        work = partial(self.work_info, cute.arch.block_idx()[0], num_x, num_batch, section, num_heads, mdK.shape[2],
                       mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, seqlen_q_static, seqlen_k_static, window_left,
                       window_right, mAux)
        smem = partial(self.smem_tensors, storage, sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout,
                       sHalf_layout)
        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == 0:
                self.load(mQ, mK, mV, mdO, mLSElog2, mDpsum, smem(), (tma_q, tma_k, tma_v, tma_do, tma_lse, tma_dpsum),
                          pipes, work())
            if const_expr(not self.cfg.dq_direct and not self.cfg.dq_pass):
                if warp_idx == 1:
                    self.await_preprocess()
                    self.store_dq(mdQaccum, mSemaphore, smem().sdQ, work())
            elif const_expr(self.cfg.deterministic and not self.cfg.dq_pass):
                if warp_idx == 1:
                    self.await_preprocess()
                    self.sequence_dq(mSemaphore, work())
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self.await_preprocess()
            self.mma(mdK, mdV, mdQaccum, smem(), pipes, work(), softmax_scale, prescale, scale_log2,
                     cute.arch.thread_idx()[0] - 128, mAux)

    def smem_tensors(self, storage, sQ_layout, sdO_layout, sK_layout, sV_layout, sPdS_layout,
                     sHalf_layout) -> SimpleNamespace:
        """The shared-memory tensors (module docstring)."""
        two = self.cfg.two_cta
        return SimpleNamespace(
            sK_peer=storage.sK_peer.get_tensor(sK_layout.outer, swizzle=sK_layout.inner) if const_expr(two) else None,
            sdS_in=storage.sdS_in.get_tensor(sHalf_layout.outer, swizzle=sHalf_layout.inner) if const_expr(two) else None,
            # Half h (runtime) of sdS (two_cta): (keys, queries / 2, stage), at element h * its size.
            sdS_half=partial(self.half_tensor, storage, sHalf_layout) if const_expr(two) else None,
            mbar_ds=storage.mbar_ds.data_ptr() if const_expr(two) else None,
            sQ=storage.sQ.get_tensor(sQ_layout.outer, swizzle=sQ_layout.inner),
            sdO=storage.sdO.get_tensor(sdO_layout.outer, swizzle=sdO_layout.inner),
            sK=storage.sK.get_tensor(sK_layout.outer, swizzle=sK_layout.inner),
            sV=storage.sV.get_tensor(sV_layout.outer, swizzle=sV_layout.inner),
            sdS=storage.sdS.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner),
            sP=None if const_expr(self.rs) else storage.sP.get_tensor(sPdS_layout.outer, swizzle=sPdS_layout.inner),
            sLSE=storage.sLSE.get_tensor(cute.make_layout((self.tile_m, self.q_stages), stride=(1, self.cfg.rows_stride))),
            sD=storage.sD.get_tensor(cute.make_layout((self.tile_m, self.q_stages), stride=(1, self.cfg.rows_stride))),
            sdQ=None if const_expr(self.cfg.dq_direct or self.cfg.dq_pass) else storage.sdQ.get_tensor(
                cute.make_layout((self.cfg.dq_rows * self.hd, self.cfg.dq_stages))),
        )

    @staticmethod
    def half_tensor(storage, sHalf_layout, h) -> cute.Tensor:
        """Half ``h`` of the queries of sdS (two_cta; the layout's halves are outermost)."""
        base = storage.sdS.get_tensor(sHalf_layout.outer, swizzle=sHalf_layout.inner)
        return cute.make_tensor(base.iterator + h * cute.cosize(sHalf_layout.outer), sHalf_layout.outer)

    def work_info(self, block: Int32, num_x: Int32, num_batch: Int32, section: Int32, num_heads: Int32,
                  num_heads_k: Int32, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, seqlen_q_static: Int32,
                  seqlen_k_static: Int32, window_left: Int32, window_right: Int32, mAux=None) -> "CtaWork":
        """What this CTA does (every role computes the same): its K block ``n_block`` of
        (``head_kv``, ``batch``) (Note [Launch order] in fa4/bwd/common.py), sequence, mask,
        m_blocks ``[m_min, m_min + num_m)`` (none for a block no query sees, or past
        ``seqused_k``), ``num_steps`` (``group`` q heads per m_block) and ``rows_k``, the dK/dV rows
        it owns (<= 0: the block is past its sequence, and has no steps). With ``two_cta`` the grid
        unit is a pair of adjacent K blocks, one per CTA of the cluster, and both walk the union of
        the two blocks' m_blocks (Note [Two-CTA dQ]). With ``block_skip`` each block's m_blocks are
        narrowed to those it is visible to (Note [Block skip in the backward]); every role calls this
        with whole warps."""
        cn = self.cfg.cluster_n
        rank = block % cn if const_expr(cn > 1) else Int32(0)
        down = None
        if const_expr(self.cfg.compact_grid):  # Note [Compact varlen grid] (every role: whole warps)
            n_block, head_kv, batch = compact_tile(block, mCuSeqlensK, num_batch, num_heads_k, section, self.tile_n,
                                                   1, False)
        elif const_expr(self.cfg.det_tail):  # the last kv heads walk down, launched last (Note [Down tail])
            x, head_kv, batch, down = self.tail_tile(block, num_x, num_heads_k, num_batch, section)
            n_block = x + (1 - down) * (num_x - 1 - 2 * x)
        else:
            x, head_kv, batch = section_tile(block // cn if const_expr(cn > 1) else block, num_x, num_heads_k,
                                             num_batch, section, False)
            n_block = x * cn + rank if const_expr(cn > 1) else x
            if const_expr(self.cfg.det_up):  # the shortest blocks first (Note [Up order])
                n_block = num_x - 1 - x
        args = (batch, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK, seqlen_q_static, seqlen_k_static, window_left,
                window_right, mAux, head_kv, num_heads, num_heads_k)
        seq, mask, m_min, num_m, rows_k = self.block_range(n_block, *args)
        if const_expr(cn > 1):
            _, _, m_min_p, num_m_p, _ = self.block_range(x * cn + 1 - rank, *args)
            m_min, num_m = self.range_union(m_min, num_m, m_min_p, num_m_p)
        group = num_heads // num_heads_k
        num_n = cutlass.max(cute.ceil_div(seq.seqlen_k, self.tile_n), 1)
        return CtaWork(seq, mask, n_block, head_kv, batch, group, m_min, num_m, num_m * group, rows_k, num_n, rank,
                       down)

    @cute.jit
    def tail_tile(self, block: Int32, num_x: Int32, num_heads_k: Int32, num_batch: Int32, section: Int32):
        """``(x, kv head, batch, down)`` of grid index ``block`` with ``det_tail`` (Note [Down tail]):
        the up-order pairs' sections first, then the down-order ones'. Twin of
        :func:`fa4.bwd.common.host_tail_tile`."""
        tail = common.tail_heads(num_heads_k, self.cfg.det_tail, self.cfg.det_tail_share)
        up_heads = num_heads_k - tail
        n_up_tiles = num_x * up_heads * num_batch
        x, head_kv, batch, down = Int32(0), Int32(0), Int32(0), Int32(0)
        if block < n_up_tiles:
            x, head_kv, batch = section_tile(block, num_x, up_heads, num_batch, section, False)
        else:
            x, head_kv, batch = section_tile(block - n_up_tiles, num_x, tail, num_batch, section, False)
            head_kv = head_kv + up_heads
            down = Int32(1)
        return x, head_kv, batch, down

    @cute.jit
    def range_union(self, m_min: Int32, num_m: Int32, m_min_p: Int32, num_m_p: Int32):
        """The m_blocks of both K blocks of a pair (each range contiguous, the two adjacent or
        overlapping, so their union is one range; with ``block_skip`` the narrowed ranges may leave
        a gap, walked with every score masked); either may be empty."""
        lo, n = m_min, num_m
        if num_m == 0:
            lo, n = m_min_p, num_m_p
        elif num_m_p > 0:
            lo = cutlass.min(m_min, m_min_p)
            n = cutlass.max(m_min + num_m, m_min_p + num_m_p) - lo
        return lo, n

    def make_pipelines(self, storage):
        """The K/V, Q and dO pipelines (arrive counts: module docstring)."""
        group = partial(pipeline.CooperativeGroup, pipeline.Agent.Thread)
        consumers = group(self.num_consumer_threads // 32)
        mk = partial(pipeline.PipelineTmaAsync.create, producer_group=group(1), consumer_group=consumers,
                     defer_sync=True)
        # A tuple (kv, q, do): each role unpacks it into locals (a shared object's attributes used
        # inside one role's staged branches would be rebound there and seen by the other roles).
        return (
            mk(barrier_storage=storage.mbar_kv.data_ptr(), num_stages=1, tx_count=self.tma_bytes_kv),
            mk(barrier_storage=storage.mbar_q.data_ptr(), num_stages=self.q_stages, tx_count=self.tma_bytes_q),
            mk(barrier_storage=storage.mbar_do.data_ptr(), num_stages=self.q_stages, tx_count=self.tma_bytes_do),
        )

    @cute.jit
    def block_range(self, n_block: Int32, batch: Int32, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK,
                    seqlen_q_static: Int32, seqlen_k_static: Int32, window_left: Int32, window_right: Int32,
                    mAux, head_kv: Int32, num_heads: Int32, num_heads_k: Int32):
        """``(seq, mask, m_min, num_m, rows_k)`` of K block ``n_block`` (:meth:`work_info`); with
        ``block_skip``, ``[m_min, m_min + num_m)`` spans only the m_blocks the block is visible to for
        the q heads of ``head_kv``'s group."""
        seq = SeqlenInfo.create(batch, seqlen_q_static, seqlen_k_static, mCuSeqlensQ, mCuSeqlensK, mSeqUsedK)
        # Keys the sequence owns (dK/dV rows to write) vs keys it uses (seqused_k <= that).
        seqlen_k_rows = seq.seqlen_k
        if const_expr(self.cfg.has_seqused_k):
            if const_expr(self.cfg.varlen_k):
                seqlen_k_rows = mCuSeqlensK[batch + 1] - seq.offset_k
            else:
                seqlen_k_rows = seqlen_k_static
        mask = AttentionMask(self.tile_m, self.tile_n, self.cfg.causal, self.cfg.local, seq.seqlen_q, seq.seqlen_k,
                             window_left, window_right)
        m_min, m_max = mask.m_block_range(n_block)
        if const_expr(self.cfg.block_skip):
            # (not for a block past the keys, a two-CTA pair's second: its table column does not exist)
            if n_block * self.tile_n < seq.seqlen_k:
                slot, bq, bk = self.cfg.block_skip
                group = num_heads // num_heads_k
                skip = BlockSkip(mAux[slot], bq, bk, self.tile_m, self.tile_n, batch, head_kv * group, Int32(0))
                m_min, m_max = skip.narrow_rows(n_block, m_min, m_max, head_kv * group, group)
        num_m = cutlass.max(m_max - m_min, 0)
        if n_block * self.tile_n >= seq.seqlen_k:
            num_m = Int32(0)  # keys past seqused_k: dK = dV = 0
        return seq, mask, m_min, num_m, seqlen_k_rows - n_block * self.tile_n

    def step_block_mods(self) -> dict:
        """UserMods' block-skipping fields of a step (:func:`fa4.mods_kernel.block_mods`), always with
        the table's MIXED pass: unlike the forward's, the steps include the hidden blocks inside the
        narrowed range (Note [Block skip in the backward]), whose state reads MIXED, so that pass hides
        all their scores."""
        mods = block_mods(self.mask_mod, self.cfg.block_skip, self.tile_m, self.tile_n)
        return dict(mods, mixed=True) if mods else mods

    def step_slot(self, work, t: Int32):
        """(q head, m_block) of step ``t``: :func:`fa4.bwd.common.step_slot`, or the rotated order
        (``det_rotate``: :func:`fa4.bwd.common.rotated_slot`)."""
        if const_expr(self.cfg.det_rotate):
            return common.rotated_slot(t, work.head_kv, work.group, work.n_block, work.num_m, work.num_n,
                                       self.cfg.det_rounds)
        return common.step_slot(t, work.head_kv, work.group, work.m_min, work.num_m, self.cfg.deterministic,
                                self.cfg.det_up, work.down)

    def first_step(self, work):
        """``(index in the GQA group, m_block)`` of step 0 (``step_cursor``): the order of
        :meth:`step_slot` (m_blocks down when deterministic, except in the up order)."""
        return Int32(0), (work.m_min + work.num_m - 1 if const_expr(self.cfg.walks_down) else work.m_min)

    @cute.jit
    def next_step(self, work, h_i: Int32, m_block: Int32):
        """The step after ``(h_i, m_block)`` (``step_cursor``): the next q head of the group, then the
        next m_block (down when deterministic, except in the up order); twin of :meth:`step_slot`."""
        h_i = h_i + 1
        if h_i == work.group:
            h_i = Int32(0)
            m_block = m_block + (-1 if const_expr(self.cfg.walks_down) else 1)
        return h_i, m_block

    @cute.jit
    def dq_rank(self, work, m_block: Int32) -> Int32:
        """The count of the slot's counter this CTA waits for (Note [Deterministic dQ]; with
        ``det_rotate`` Note [Rotated order], twin :func:`fa4.bwd.common.host_rotated_rank`; with
        ``det_up`` Note [Up order]: the largest K block of the slot adds first)."""
        n_min, n_max = work.mask.n_block_range(m_block)
        rank = work.n_block - n_min
        if const_expr(self.cfg.det_tail):  # Note [Down tail]: the down order's rank where down == 1
            up_rank = n_max - 1 - work.n_block
            rank = up_rank + work.down * (rank - up_rank)
        elif const_expr(self.cfg.det_up):
            rank = n_max - 1 - work.n_block
        if const_expr(self.cfg.det_rotate):  # (Note [Rotation rounds]: after the earlier rounds)
            base, n_r, num_r = common.rotation_round(work.n_block, work.num_n, self.cfg.det_rounds)
            stagger = work.num_m // num_r
            if stagger > 0:
                n0 = cutlass.min((work.num_m - 1 - m_block) // stagger, num_r - 1)
                rank = base + (n0 - n_r + num_r) % num_r
        return rank

    # --- producer ---------------------------------------------------------------------------

    @cute.jit
    def load(self, mQ, mK, mV, mdO, mLSElog2, mDpsum, sm, tmas, pipes, work) -> None:
        """Warp 0: K and V once (with ``two_cta`` also the partner's K), then per step Q + lse_log2 rows
        and dO + dpsum rows (all by TMA)."""
        pipe_kv, pipe_q, pipe_do = pipes
        tma_q, tma_k, tma_v, tma_do, tma_lse, tma_dpsum = tmas
        if work.num_steps > 0:  # (none for a block past its sequence: rows_k <= 0, unless two_cta)
            seq, batch = work.seq, work.batch
            one = cute.make_layout(1)
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            pipe_kv.producer_acquire(kv_state)
            bar = pipe_kv.producer_get_barrier(kv_state)
            tiles = [(tma_k, mK, sm.sK, work.n_block, self.hd), (tma_v, mV, sm.sV, work.n_block, self.hd_v)]
            if const_expr(self.cfg.two_cta):
                tiles.append((tma_k, mK, sm.sK_peer, work.n_block + 1 - 2 * work.rank, self.hd))
            head_k = work.head_kv // self.cfg.kv_split  # (Note [Split GQA group]: a virtual kv head)
            for tma, mT, sT, n, d in tiles:
                gT = cute.local_tile(seq.k_view_sd(mT, batch, head_k), (self.tile_n, d), (n, 0))
                tTsT, tTgT = cpasync.tma_partition(tma, 0, one, cute.group_modes(sT, 0, 2), cute.group_modes(gT, 0, 2))
                cute.copy(tma, tTgT, tTsT, tma_bar_ptr=bar)
            self.await_preprocess()  # before lse_log2 / dpsum
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.q_stages)
            cursor = self.cfg.step_cursor
            if const_expr(cursor):
                h_i, m_cur = self.first_step(work)
            for t in cutlass.range(work.num_steps, unroll=1):
                if const_expr(cursor):
                    head, m_block = work.head_kv * work.group + h_i, m_cur
                    h_i, m_cur = self.next_step(work, h_i, m_cur)
                else:
                    head, m_block = self.step_slot(work, t)
                self.load_rows_tile(tma_q, tma_lse, mQ, mLSElog2, sm.sQ, sm.sLSE, pipe_q, q_state, seq, batch, head,
                                    m_block, self.hd)
                self.load_rows_tile(tma_do, tma_dpsum, mdO, mDpsum, sm.sdO, sm.sD, pipe_do, do_state, seq, batch, head,
                                    m_block, self.hd_v)
                q_state.advance()
                do_state.advance()

    def await_preprocess(self) -> None:
        """With ``pdl``: wait for the preprocess to finish (Note [Programmatic dependent launch])."""
        if const_expr(self.cfg.pdl):
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def load_rows_tile(self, tma, tma_rows, mT, mRows, sT, sRows, pipe, state, seq: SeqlenInfo, batch: Int32,
                       head: Int32, m_block: Int32, d: cutlass.Constexpr[int]) -> None:
        """One stage: the ``(tile_m, d)`` tile of Q (or dO) and its ``tile_m`` row statistics, both
        by TMA completing on the stage's mbarrier."""
        pipe.producer_acquire(state)
        bar = pipe.producer_get_barrier(state)
        one = cute.make_layout(1)
        gT = cute.local_tile(seq.q_view_sd(mT, batch, head), (self.tile_m, d), (m_block, 0))
        tTsT, tTgT = cpasync.tma_partition(tma, 0, one, cute.group_modes(sT, 0, 2), cute.group_modes(gT, 0, 2))
        cute.copy(tma, tTgT, tTsT[None, state.index], tma_bar_ptr=bar)
        gRows = cute.local_tile(rows_view_tma(mRows, seq, batch, head, self.tile_m), (self.tile_m,), (m_block,))
        tRsR, tRgR = cpasync.tma_partition(tma_rows, 0, one, cute.group_modes(sRows, 0, 1),
                                           cute.group_modes(gRows, 0, 1))
        cute.copy(tma_rows, tRgR, tRsR[None, state.index], tma_bar_ptr=bar)

    # --- dQ writer --------------------------------------------------------------------------

    @cute.jit
    def store_dq(self, mdQaccum, mSemaphore, sdQ, work) -> None:
        """Warp 1: per step and consumer warpgroup, the bulk reduce-add of its dQ part from sdQ into
        dq_accum (barriers: module docstring; deterministic: Note [Deterministic dQ]; the step's
        slot: Note [Writer slots])."""
        if work.num_steps > 0:
            det = self.cfg.deterministic
            claims = self.cfg.dq_first_store and not det  # Note [First store]
            stages = self.cfg.dq_stages
            lane = cute.arch.lane_idx()
            if const_expr(stages > 1):  # step 0's buffer has not been used (num_steps >= 1)
                for w in cutlass.range_constexpr(self.num_wg):
                    cute.arch.barrier_arrive(barrier_id=self.dq_bar(_BAR.dq_empty, w, 0), number_of_threads=128 + 32)
            lane_head, lane_m, lane_rank = Int32(0), Int32(0), Int32(0)
            prev_head, prev_m = Int32(0), Int32(0)
            claim, prev_claim = Int32(1), Int32(1)  # the slot counter a claim read (0: this CTA stores first)
            lagged = Boolean(True)
            if const_expr(det and self.cfg.publish_lag and self.cfg.det_rotate):
                num_r = common.rotation_round(work.n_block, work.num_n, self.cfg.det_rounds)[2]
                lagged = common.rotation_lags(work.num_m, num_r)  # Note [Publish lag]
            for t in cutlass.range(work.num_steps, unroll=1):
                lane_head, lane_m, lane_rank, head, m_block, rank = self.next_slot(work, t, lane, lane_head, lane_m,
                                                                                   lane_rank)
                seen = Int32(-1)
                if const_expr(det and self.cfg.publish_peek):
                    if lane == 0:  # read early: the round trip overlaps the waits below (Note [Publish peek])
                        seen = semaphore.peek(self.dq_semaphore(mSemaphore, work, head, m_block))
                ahead = t + stages - 1  # the step whose buffer held step t - 1's dQ
                for w in cutlass.range_constexpr(self.num_wg):
                    # Step t - 1's reduce of part w has read sdQ (parts commit in order).
                    cute.arch.cp_async_bulk_wait_group(self.num_wg - 1 - w, read=True)
                    if ahead < work.num_steps:
                        cute.arch.barrier_arrive(barrier_id=self.dq_bar(_BAR.dq_empty, w, ahead),
                                                 number_of_threads=128 + 32)
                if const_expr(claims):
                    if t > 0:
                        if prev_claim == 0:  # this CTA stored step t - 1's slot: publish it before claiming
                            self.publish_dq(mSemaphore, work, prev_head, prev_m, lane)
                    if lane == 0:  # relaxed: not waited for until the step's dQ is ready
                        claim = cute.arch.atomic_cas(self.dq_semaphore(mSemaphore, work, head, m_block), cmp=Int32(0),
                                                     val=Int32(1), sem="relaxed", scope="gpu")
                gdQ = self.dq_tile(mdQaccum, work, head, m_block)
                sdQ_t = sdQ[None, t % stages if const_expr(stages > 1) else 0]
                first = Boolean(False)  # this CTA's tile is the slot's first: stored, not added
                if const_expr(det and self.cfg.dq_first_store):
                    first = rank == 0
                if const_expr(det and self.cfg.publish_peek):
                    self.publish_then_spin(mSemaphore, work, t, head, m_block, rank, seen, prev_head, prev_m, lane)
                elif const_expr(det):
                    if lane == 0:
                        semaphore.spin(self.dq_semaphore(mSemaphore, work, head, m_block), rank)
                        cute.arch.fence_proxy("async.global")  # the adds below follow the acquire
                    if const_expr(self.cfg.publish_lag):
                        # Step t - 1's adds completed while this step's slot was awaited (Note [Publish lag]).
                        if t > 0:
                            if lagged:
                                self.publish_dq(mSemaphore, work, prev_head, prev_m, lane)
                    cute.arch.sync_warp()
                for w in cutlass.range_constexpr(self.num_wg):
                    cute.arch.barrier(barrier_id=self.dq_bar(_BAR.dq_full, w, t), number_of_threads=128 + 32)
                    if const_expr(claims and w == 0):
                        if lane == 0:
                            if claim != 0:  # another CTA claimed the slot: acquire its store (waits while 1)
                                semaphore.spin(self.dq_semaphore(mSemaphore, work, head, m_block), Int32(2))
                                cute.arch.fence_proxy("async.global")  # the adds below follow the acquire
                        claim = cute.arch.shuffle_sync(claim, 0)
                        first = claim == 0
                    with cute.arch.elect_one():  # lane 0 (sync_warp above orders it after lane 0's acquire)
                        dst, src = gdQ.iterator + w * self.dq_chunk, sdQ_t.iterator + w * self.dq_chunk
                        if const_expr(self.cfg.dq_first_store):
                            if first:
                                bulk_store(dst, src, 4 * self.dq_chunk)
                            else:
                                bulk_reduce_add_f32(dst, src, 4 * self.dq_chunk)
                        else:
                            bulk_reduce_add_f32(dst, src, 4 * self.dq_chunk)
                    cute.arch.cp_async_bulk_commit_group()
                if const_expr(det and not self.cfg.publish_peek):
                    if const_expr(not self.cfg.publish_lag):
                        self.publish_dq(mSemaphore, work, head, m_block, lane)
                    elif const_expr(self.cfg.det_rotate):
                        if not lagged:  # stagger 1: published at once (Note [Publish lag])
                            self.publish_dq(mSemaphore, work, head, m_block, lane)
                prev_head, prev_m, prev_claim = head, m_block, claim
            if const_expr(claims):
                if prev_claim == 0:
                    self.publish_dq(mSemaphore, work, prev_head, prev_m, lane)
            if const_expr(det and self.cfg.publish_lag):
                if lagged:
                    self.publish_dq(mSemaphore, work, prev_head, prev_m, lane)
            if const_expr(det and self.cfg.publish_peek):
                self.publish_dq(mSemaphore, work, prev_head, prev_m, lane)
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def publish_then_spin(self, mSemaphore, work, t: Int32, head: Int32, m_block: Int32, rank: Int32, seen: Int32,
                          prev_head: Int32, prev_m: Int32, lane: Int32) -> None:
        """``publish_peek`` (Note [Publish peek]): ``seen`` is slot ``t``'s counter, read by lane 0 at
        the top of the step. Publish step ``t - 1``'s adds once complete (the fence also acquires
        ``seen``), and spin only if ``seen`` was not yet ``rank``."""
        if t > 0:
            self.publish_dq(mSemaphore, work, prev_head, prev_m, lane)  # waits for step t - 1's adds
        if lane == 0:
            if t == 0:
                cute.arch.fence_acq_rel_gpu()  # the acquire of seen (no publish at step 0)
            if seen != rank:
                semaphore.spin(self.dq_semaphore(mSemaphore, work, head, m_block), rank)
            cute.arch.fence_proxy("async.global")  # the adds below follow the acquire
        cute.arch.sync_warp()

    @cute.jit
    def publish_dq(self, mSemaphore, work, head: Int32, m_block: Int32, lane: Int32) -> None:
        """Once this CTA's adds into slot (head, m_block) are complete, publish them (lane 0)."""
        cute.arch.cp_async_bulk_wait_group(0, read=False)
        if lane == 0:
            semaphore.publish(self.dq_semaphore(mSemaphore, work, head, m_block), True)

    @cute.jit
    def sequence_dq(self, mSemaphore, work) -> None:
        """Warp 1 with ``dq_direct`` and ``deterministic`` (Note [Ordered direct dQ]): per step, waits
        for the slot's turn, lets every consumer warpgroup add (``dq_full``), waits until all of them
        have issued their adds (``dq_empty``), and publishes (the slot: Note [Writer slots]). With
        ``publish_peek`` the next slot's counter is read before that publish (Note [Publish peek])."""
        if const_expr(self.cfg.publish_peek):
            self.sequence_dq_peek(mSemaphore, work)
        else:
            lane = cute.arch.lane_idx()
            lane_head, lane_m, lane_rank = Int32(0), Int32(0), Int32(0)
            for t in cutlass.range(work.num_steps, unroll=1):
                lane_head, lane_m, lane_rank, head, m_block, rank = self.next_slot(work, t, lane, lane_head, lane_m,
                                                                                   lane_rank)
                sem = self.dq_semaphore(mSemaphore, work, head, m_block)
                if lane == 0:
                    semaphore.spin(sem, rank)
                cute.arch.sync_warp()
                self.open_dq_turn(t)
                self.await_dq_adds(t)
                if lane == 0:
                    semaphore.publish(sem, True)

    @cute.jit
    def sequence_dq_peek(self, mSemaphore, work) -> None:
        """:meth:`sequence_dq` with ``publish_peek``: once the consumers have issued step ``t``'s adds,
        lane 0 reads slot ``t + 1``'s counter (relaxed), then publishes step ``t``: the fence that
        waits for those adds is also the acquire of the value read, so the read's round trip and the
        next slot's computation leave the chain from step ``t``'s adds to step ``t + 1``'s turn; lane 0
        spins only if the value was not yet the rank. Step 0 fences on its own."""
        if work.num_steps > 0:
            lane = cute.arch.lane_idx()
            lane_head, lane_m, lane_rank, head, m_block, rank = self.next_slot(work, Int32(0), lane, Int32(0),
                                                                               Int32(0), Int32(0))
            seen = Int32(-1)
            if lane == 0:
                seen = semaphore.peek(self.dq_semaphore(mSemaphore, work, head, m_block))
                cute.arch.fence_acq_rel_gpu()  # the acquire of seen (no publish before step 0)
            for t in cutlass.range(work.num_steps, unroll=1):
                if lane == 0:
                    if seen != rank:
                        semaphore.spin(self.dq_semaphore(mSemaphore, work, head, m_block), rank)
                cute.arch.sync_warp()
                self.open_dq_turn(t)
                # Step t + 1's slot while the consumers compute (clamped: the last step computes its own
                # slot again and reads nothing).
                t_next = cutlass.min(t + 1, work.num_steps - 1)
                lane_head, lane_m, lane_rank, head_n, m_n, rank_n = self.next_slot(work, t_next, lane, lane_head,
                                                                                   lane_m, lane_rank)
                self.await_dq_adds(t)
                if lane == 0:
                    if t + 1 < work.num_steps:
                        seen = semaphore.peek(self.dq_semaphore(mSemaphore, work, head_n, m_n))
                    semaphore.publish(self.dq_semaphore(mSemaphore, work, head, m_block), True)
                head, m_block, rank = head_n, m_n, rank_n

    @cute.jit
    def open_dq_turn(self, t: Int32) -> None:
        """Warp 1, step ``t`` of Note [Ordered direct dQ], once the slot is this CTA's turn: arrive on
        every consumer warpgroup's ``dq_full``."""
        for w in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier_arrive(barrier_id=self.dq_bar(_BAR.dq_full, w, t), number_of_threads=128 + 32)

    @cute.jit
    def await_dq_adds(self, t: Int32) -> None:
        """Warp 1, step ``t``: wait until every consumer warpgroup has issued its adds (``dq_empty``)."""
        for w in cutlass.range_constexpr(self.num_wg):
            cute.arch.barrier(barrier_id=self.dq_bar(_BAR.dq_empty, w, t), number_of_threads=128 + 32)

    @cute.jit
    def slot_of(self, work, t: Int32):
        """``(q head, m_block, rank)`` of step ``t``: :meth:`step_slot` and, deterministic,
        :meth:`dq_rank` (else rank 0)."""
        head, m_block = self.step_slot(work, t)
        rank = Int32(0)
        if const_expr(self.cfg.deterministic):
            rank = self.dq_rank(work, m_block)
        return head, m_block, rank

    @cute.jit
    def next_slot(self, work, t: Int32, lane: Int32, lane_head: Int32, lane_m: Int32, lane_rank: Int32):
        """Step ``t``'s slot for the writer (or sequencing) warp, and the lanes' slots carried to the
        next step: ``(lane_head, lane_m, lane_rank, head, m_block, rank)``. With ``lane_slots``
        (Note [Writer slots]) every 32nd step refreshes the lanes' slots, lane ``l`` that of step
        ``t + l`` (clamped to the last step), and step ``t`` reads its own from lane ``t % 32``;
        otherwise each step computes its own."""
        if const_expr(self.cfg.lane_slots):
            if t % 32 == 0:
                lane_head, lane_m, lane_rank = self.slot_of(work, cutlass.min(t + lane, work.num_steps - 1))
            src = t % 32
            head = cute.arch.shuffle_sync(lane_head, src)
            m_block = cute.arch.shuffle_sync(lane_m, src)
            rank = cute.arch.shuffle_sync(lane_rank, src)
        else:
            head, m_block, rank = self.slot_of(work, t)
        return lane_head, lane_m, lane_rank, head, m_block, rank

    def dq_tile(self, mdQaccum: cute.Tensor, work, head: Int32, m_block: Int32) -> cute.Tensor:
        """The dq_accum tile this CTA adds step (head, m_block) into: the m_block's ``tile_m`` rows,
        or with ``two_cta`` its half ``rank`` (the halves are contiguous: Note [Two-CTA dQ])."""
        view = dq_accum_view(mdQaccum, work.seq, work.batch, head, self.tile_m)
        if const_expr(self.cfg.two_cta):
            return cute.local_tile(view, (self.cfg.dq_rows, self.hd), (m_block * 2 + work.rank, 0))
        return cute.local_tile(view, (self.tile_m, self.hd), (m_block, 0))

    @staticmethod
    def dq_semaphore(mSemaphore: cute.Tensor, work, head: Int32, m_block: Int32) -> cute.Pointer:
        """The counter of the dq_accum slot (batch, head, m_block) (Note [Deterministic dQ])."""
        return mSemaphore.iterator + cute.crd2idx((work.batch, head, m_block), mSemaphore.layout)

    # --- consumers --------------------------------------------------------------------------

    @cute.jit
    def mma(self, mdK, mdV, mdQaccum, sm, pipes, work, softmax_scale: Float32, prescale: Float32,
            scale_log2: Float32, tidx: Int32, mAux=None) -> None:
        """Consumer warpgroups: the step loop (:meth:`mma_step`), then :meth:`epilogue`."""
        pipe_kv, pipe_q, pipe_do = pipes
        wg = cute.arch.make_warp_uniform(tidx // 128)
        sdp, dk, dv, dq = self.tiled_mma_sdp, self.tiled_mma_dk, self.tiled_mma_dv, self.tiled_mma_dq
        thr_sdp, thr_dk, thr_dv, thr_dq = (m.get_slice(tidx) for m in (sdp, dk, dv, dq))
        wg_sdp, wg_dk, wg_dv, wg_dq = (m.get_slice(wg * 128) for m in (sdp, dk, dv, dq))

        # S^T = K Q^T, dP^T = V dO^T (A: keys x hd, B: queries x hd; both K-major).
        c = SimpleNamespace(
            tSrK=wg_sdp.make_fragment_A(wg_sdp.partition_A(sm.sK)),
            tSrQ=wg_sdp.make_fragment_B(wg_sdp.partition_B(sm.sQ)),
            tdPrV=wg_sdp.make_fragment_A(wg_sdp.partition_A(sm.sV)),
            tdPrdO=wg_sdp.make_fragment_B(wg_sdp.partition_B(sm.sdO)),
            # dV += P^T dO, dK += dS^T Q (B: hd x queries, MN-major views of sdO, sQ).
            tdVrdOt=wg_dv.make_fragment_B(wg_dv.partition_B(transposed(sm.sdO))),
            tdKrQt=wg_dk.make_fragment_B(wg_dk.partition_B(transposed(sm.sQ))),
            tdVrPt=None, tdKrdSt=None,
        )
        if const_expr(self.cfg.two_cta):
            # Note [Two-CTA dQ]: this CTA's half of the queries of its own dS^T, over its K, and the
            # partner's half (sdS_in, received), over the partner's K.
            c.tdQrdS, c.tdQrKt = self.dq_operands(wg_dq, sm.sdS_half(work.rank), sm.sK)
            c.tdQrdS_in, c.tdQrKt_peer = self.dq_operands(wg_dq, sm.sdS_in, sm.sK_peer)
            c.sdS_send, c.sdS_in = sm.sdS_half(1 - work.rank), sm.sdS_in
        else:
            c.tdQrdS, c.tdQrKt = self.dq_operands(wg_dq, sm.sdS, sm.sK)
        if const_expr(not self.rs):
            c.tdVrPt = wg_dv.make_fragment_A(wg_dv.partition_A(sm.sP))
            c.tdKrdSt = wg_dk.make_fragment_A(wg_dk.partition_A(sm.sdS))
        shape_S = (self.tile_n, self.tile_m)
        c.acc_S = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C(shape_S))
        c.acc_dP = thr_sdp.make_fragment_C(thr_sdp.partition_shape_C(shape_S))
        c.acc_dQ = thr_dq.make_fragment_C(thr_dq.partition_shape_C(self.cfg.dq_fragment.mma_shape(self.cfg.dq_rows,
                                                                                                   self.hd)))
        acc_dK = thr_dk.make_fragment_C(thr_dk.partition_shape_C((self.tile_n, self.hd)))
        acc_dV = thr_dv.make_fragment_C(thr_dv.partition_shape_C((self.tile_n, self.hd_v)))
        acc_dK.fill(0.0)
        acc_dV.fill(0.0)
        c.acc_dK, c.acc_dV = acc_dK, acc_dV
        # Query (column) coordinate of each column of this thread's S^T view.
        c.tScS_mn = make_acc_mn_view(thr_sdp.partition_C(cute.make_identity_tensor(shape_S)))
        c.r2s = cute.make_tiled_copy_C(stmatrix_atom(self.dtype), sdp).get_slice(tidx)
        c.thr_sdp = thr_sdp
        c.aux = mAux
        c.sdQ = sm.sdQ
        c.tidx = tidx

        # (num_steps = 0 for a block past its sequence, rows_k <= 0, unless two_cta: its partner's.)
        if work.num_steps > 0:
            kv_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)
            pipe_kv.consumer_wait(kv_state)
            if const_expr(self.cfg.has_seqused_k):
                self.clear_kv_tail(sm.sK, sm.sV, work.seq.seqlen_k - work.n_block * self.tile_n, tidx)
                if const_expr(self.cfg.two_cta):
                    n_peer = work.n_block + 1 - 2 * work.rank
                    self.clear_kv_tail(sm.sK_peer, None, work.seq.seqlen_k - n_peer * self.tile_n, tidx)
            q_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
            do_state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.q_stages)
            m_no_mask = work.mask.m_block_max_no_window_mask(work.n_block)
            seqlen_partial = (work.n_block + 1) * self.tile_n > work.seq.seqlen_k
            # step_cursor, causal: which steps need the mask follows from the step index (the m_blocks
            # below m_no_mask are the first or the last steps), so m_block is computed on those only.
            lazy = (self.cfg.step_cursor and self.cfg.causal and not self.cfg.local and not self.cfg.dq_direct
                    and not self.user_mods)  # (user functions read every step's q head and m_block)
            if const_expr(lazy):
                # Walking down the masked steps are the last ones (t >= edge), walking up the first (t < edge).
                edge = (work.m_min + work.num_m - m_no_mask if const_expr(self.cfg.walks_down)
                        else m_no_mask - work.m_min) * work.group
            for t in cutlass.range(work.num_steps, unroll=1):
                m_block, head = None, None
                if const_expr(not lazy):
                    head, m_block = self.step_slot(work, t)
                gdQ = None
                if const_expr(self.cfg.dq_direct and not self.cfg.dq_pass):
                    gdQ = self.dq_tile(mdQaccum, work, head, m_block)
                need_mask = seqlen_partial
                if const_expr(self.cfg.local):
                    need_mask = Boolean(True)
                elif const_expr(lazy):
                    need_mask = need_mask or (t >= edge if const_expr(self.cfg.walks_down) else t < edge)
                elif const_expr(self.cfg.causal):
                    need_mask = need_mask or m_block < m_no_mask
                self.mma_step(c, sm, pipe_q, pipe_do, work, q_state, do_state, t, m_block, need_mask, wg,
                              prescale, scale_log2, gdQ, head)
                q_state.advance()
                do_state.advance()
            if const_expr(self.cfg.two_cta):
                self.drain_exchange(sm, work.num_steps)
        if work.rows_k > 0:
            self.epilogue(acc_dK, acc_dV, mdK, mdV, sm, work, softmax_scale, tidx)

    @cute.jit
    def clear_kv_tail(self, sK, sV, rows_used: Int32, tidx: Int32) -> None:
        """Note [K/V rows past seqused_k]: zero the K (and V) rows ``>= rows_used`` in smem."""
        if rows_used < self.tile_n:
            zero_rows_from(sK, rows_used, tidx, self.num_consumer_threads)
            if const_expr(sV is not None):
                zero_rows_from(sV, rows_used, tidx, self.num_consumer_threads)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier(barrier_id=_BAR.epi, number_of_threads=self.num_consumer_threads)

    def dq_operands(self, wg_dq, sdS: cute.Tensor, sK: cute.Tensor):
        """(dS, K) fragments of the dQ wgmma over ``sdS`` ((keys, queries, stage), stored as dS^T) and
        ``sK``: dQ = dS K (A: the MN-major view of sdS, B: of sK), or swapped, dQ^T = K^T dS^T."""
        if const_expr(self.cfg.dq_swap):
            return (wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sdS))),
                    wg_dq.make_fragment_A(wg_dq.partition_A(transposed(sK))))
        return (wg_dq.make_fragment_A(wg_dq.partition_A(transposed(sdS))),
                wg_dq.make_fragment_B(wg_dq.partition_B(transposed(sK))))

    def gemm_dq(self, acc, tdS, tKt, zero_init: bool) -> None:
        """One dQ wgmma group (:meth:`dq_operands`)."""
        if const_expr(self.cfg.dq_swap):
            gemm_sm90(self.tiled_mma_dq, acc, tKt, tdS, zero_init=zero_init)
        else:
            gemm_sm90(self.tiled_mma_dq, acc, tdS, tKt, zero_init=zero_init)

    @cute.jit
    def drain_exchange(self, sm, num_steps: Int32) -> None:
        """Two-CTA: before the CTA may exit, the partner has read the last dS^T half sent into each of
        its sdS_in stages (so its remote arrives on this CTA's ds_empty barriers have landed)."""
        for s in cutlass.range_constexpr(self.pds_stages):
            uses = (num_steps - s + self.pds_stages - 1) // self.pds_stages
            if uses > 0:
                cute.arch.mbarrier_wait(sm.mbar_ds + self.pds_stages + s, (uses & 1) ^ 1)

    @cute.jit
    def mma_step(self, c, sm, pipe_q, pipe_do, work, q_state, do_state, t: Int32, m_block: Int32, need_mask,
                 wg: Int32, prescale: Float32, scale_log2: Float32, gdQ: Optional[cute.Tensor],
                 head: Optional[Int32] = None) -> None:
        """One (q head, m_block) step of a consumer warpgroup (module docstring)."""
        qi, di = q_state.index, do_state.index
        pds = t % self.pds_stages if const_expr(self.pds_stages > 1) else 0
        ncol = cute.size(c.tScS_mn, mode=[1])
        # The row statistics of this thread's query columns: read ahead of the waits into registers,
        # or, where registers are short (``rows_late``), from smem as each column is used.
        # ``stats_early``: read before the wgmmas are issued, whose operand reads would queue them.
        # With ``rows_late``, ``stats_early`` >= 1 still reads lse ahead (dpsum stays late).
        late = self.cfg.rows_late
        lse_early = self.cfg.stats_early >= 1
        d_early = self.cfg.stats_early >= 2 and not late
        lse_in_regs = lse_early or not late
        rLSE = cute.make_rmem_tensor(ncol, Float32)
        rD = cute.make_rmem_tensor(ncol, Float32)
        pipe_q.consumer_wait(q_state)
        if const_expr(lse_early):
            self.read_stats(c, sm.sLSE, qi, rLSE)
        gemm_sm90(self.tiled_mma_sdp, c.acc_S, c.tSrK, c.tSrQ[None, None, None, qi], zero_init=True)
        pipe_do.consumer_wait(do_state)
        if const_expr(d_early):
            self.read_stats(c, sm.sD, di, rD)
        gemm_sm90(self.tiled_mma_sdp, c.acc_dP, c.tdPrV, c.tdPrdO[None, None, None, di], zero_init=True)
        if const_expr(not late and not lse_early):
            self.read_stats(c, sm.sLSE, qi, rLSE)
        warpgroup.wait_group(1)  # S^T

        # P^T = exp2(S^T * scale_log2 - lse_log2[query]).
        tanh_S = None
        if const_expr(self.cfg.has_softcap):
            apply_softcap(c.acc_S, prescale)
            tanh_S = cute.make_rmem_tensor_like(c.acc_S)
            tanh_S.store(c.acc_S.load())
        umod, raw_S = None, None
        if const_expr(self.user_mods):  # every step (fa4/mods.py); head, m_block: not lazy
            umod = UserMods(self.score_mod, self.mask_mod, self.tile_m, self.tile_n, 1, work.batch, head, work.seq,
                            c.aux, transpose=True, score_mod_bwd=self.score_mod_bwd, backward=True,
                            **self.step_block_mods())
            if const_expr(self.score_mod is not None):  # Q K^T as the score_mod read it, for its derivative
                raw_S = cute.make_rmem_tensor_like(c.acc_S)
                raw_S.store(c.acc_S.load())
            mode = None
            if const_expr(self.cfg.block_skip):  # the step's block state: no mask function on a whole block
                # (a hidden block reads MIXED: the table's mask then hides every score)
                slot, bq, bk = self.cfg.block_skip
                _, mode = BlockSkip(c.aux[slot], bq, bk, self.tile_m, self.tile_n, work.batch, head,
                                    m_block).state(work.n_block)
            umod.apply(c.acc_S, c.thr_sdp, m_block, work.n_block, prescale, mask_mode=mode)
        if need_mask:
            m_masked = m_block
            if const_expr(m_block is None):  # step_cursor: only the masked steps compute it
                _, m_masked = self.step_slot(work, t)
            work.mask.apply(c.acc_S, c.thr_sdp, m_masked, work.n_block, mask_seqlen=True, mask_window=True,
                            transpose=True)
        acc_S_mn = make_acc_mn_view(c.acc_S)
        if const_expr(not lse_in_regs):
            emu = emulated_elements(ncol, self.cfg.exp2_emu_frac)
            for j in cutlass.range_constexpr(ncol):
                lse = sm.sLSE[c.tScS_mn[0, j][1], qi]
                for r in cutlass.range_constexpr(cute.size(acc_S_mn, mode=[0])):
                    acc_S_mn[r, j] = exp2_select(cute.math.fma(acc_S_mn[r, j], scale_log2, -lse), emu[j])
        else:
            exp2_rows(acc_S_mn, rLSE, scale_log2, self.cfg.exp2_emu_frac, bias_per_col=True)
        rP = cute.make_rmem_tensor_like(c.acc_S, self.dtype)
        convert_f32_to_half(c.acc_S, rP)
        if const_expr(self.pds_stages == 1):
            # The other warpgroups' wgmmas of the previous step have read this P/dS stage.
            cute.arch.barrier(barrier_id=_BAR.pds_free, number_of_threads=self.num_consumer_threads)
        dv_late = self.cfg.dv_late
        if const_expr(self.rs and not dv_late):
            gemm_sm90(self.tiled_mma_dv, c.acc_dV, make_acc_as_A(rP), c.tdVrdOt[None, None, None, di])
        elif const_expr(not self.rs):
            cute.copy(c.r2s, c.r2s.retile(rP), c.r2s.partition_D(sm.sP[None, None, pds]))
        if const_expr(not late and not d_early):
            self.read_stats(c, sm.sD, di, rD)
        # dP^T; with rows_late also dV, so that P^T's registers are free before dS^T.
        warpgroup.wait_group(1 if const_expr(self.rs and not late and not dv_late) else 0)

        # dS^T = P^T * (dP^T - D[query]).
        acc_dP_mn = make_acc_mn_view(c.acc_dP)
        # ``ds_from_p16``: P^T as rounded for the dV wgmma (the float32 S^T registers are then free
        # after the conversion; an experiment, see the config).
        P_mn = make_acc_mn_view(rP) if const_expr(self.cfg.ds_from_p16) else acc_S_mn
        for j in cutlass.range_constexpr(ncol):
            d = sm.sD[c.tScS_mn[0, j][1], di] if const_expr(late) else rD[j]
            for r in cutlass.range_constexpr(cute.size(acc_dP_mn, mode=[0])):
                acc_dP_mn[r, j] = P_mn[r, j].to(Float32) * (acc_dP_mn[r, j] - d)
        if const_expr(self.cfg.has_softcap):
            softcap_grad(c.acc_dP, tanh_S)
        if const_expr(self.score_mod is not None):  # through the score_mod: its derivative
            umod.apply_bwd(c.acc_dP, raw_S, c.thr_sdp, m_block, work.n_block, prescale)
        rdS = cute.make_rmem_tensor_like(c.acc_dP, self.dtype)
        convert_f32_to_half(c.acc_dP, rdS)
        use = t // self.pds_stages  # of this P/dS stage
        if const_expr(self.cfg.two_cta):
            # The partner has read the half that this stage sent it last time (so the bulk copy has
            # read this CTA's sdS stage too): ds_empty's completion number ``use`` (Note [Two-CTA dQ]).
            cute.arch.mbarrier_wait(sm.mbar_ds + self.pds_stages + pds, (use & 1) ^ 1)
        cute.copy(c.r2s, c.r2s.retile(rdS), c.r2s.partition_D(sm.sdS[None, None, pds]))
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.barrier(barrier_id=_BAR.pds, number_of_threads=self.num_consumer_threads)
        if const_expr(self.cfg.two_cta):
            # Expect the partner's half into sdS_in, and send it the half of its dQ rows.
            full = sm.mbar_ds + pds
            dst, src = c.sdS_in[None, None, pds].iterator, c.sdS_send[None, None, pds].iterator
            if c.tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(full, self.half_bytes)
                bulk_copy_to_peer(dst, src, full, 1 - work.rank, self.half_bytes)

        if const_expr(not self.rs):
            gemm_sm90(self.tiled_mma_dv, c.acc_dV, c.tdVrPt[None, None, None, pds], c.tdVrdOt[None, None, None, di])
        elif const_expr(dv_late):
            gemm_sm90(self.tiled_mma_dv, c.acc_dV, make_acc_as_A(rP), c.tdVrdOt[None, None, None, di])
        if const_expr(not self.cfg.dq_pass):
            self.gemm_dq(c.acc_dQ, c.tdQrdS[None, None, None, pds], c.tdQrKt, True)
        if const_expr(self.cfg.two_cta):
            cute.arch.mbarrier_wait(sm.mbar_ds + pds, use & 1)  # the partner's half has landed
            self.gemm_dq(c.acc_dQ, c.tdQrdS_in[None, None, None, pds], c.tdQrKt_peer, False)
        if const_expr(self.rs):
            gemm_sm90(self.tiled_mma_dk, c.acc_dK, make_acc_as_A(rdS), c.tdKrQt[None, None, None, qi])
        else:
            gemm_sm90(self.tiled_mma_dk, c.acc_dK, c.tdKrdSt[None, None, None, pds], c.tdKrQt[None, None, None, qi])
        warpgroup.wait_group(1)  # dV, dQ
        pipe_do.consumer_release(do_state)
        if const_expr(self.cfg.two_cta):
            # This warpgroup has read sdS_in's stage: the partner may send into it again.
            if c.tidx % 128 == 0:
                cute.arch.mbarrier_arrive(sm.mbar_ds + self.pds_stages + pds, 1 - work.rank,
                                          scope=nvvm.MemScopeKind.CLUSTER)

        if const_expr(self.cfg.dq_pass):
            pass  # (dQ: the dQ pass, Note [dQ pass])
        elif const_expr(self.cfg.dq_direct):
            self.add_dq(c, wg, t, gdQ)
        else:
            # dQ -> this warpgroup's part of sdQ (fragment order), for the writer warp.
            sdQ_frag = thread_fragment(
                c.sdQ[None, t % self.cfg.dq_stages if const_expr(self.cfg.dq_stages > 1) else 0],
                self.cfg.dq_fragment, self.dq_frag_size, 4, c.tidx)
            cute.arch.barrier(barrier_id=self.dq_bar(_BAR.dq_empty, wg, t), number_of_threads=128 + 32)
            acc_v = cute.make_tensor(c.acc_dQ.iterator, cute.make_layout(sdQ_frag.shape))
            for v in cutlass.range_constexpr(cute.size(sdQ_frag, mode=[1])):
                sdQ_frag[None, v].store(acc_v[None, v].load())
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.barrier_arrive(barrier_id=self.dq_bar(_BAR.dq_full, wg, t), number_of_threads=128 + 32)
        warpgroup.wait_group(0)  # dK
        pipe_q.consumer_release(q_state)

    @cute.jit
    def read_stats(self, c, sStat, stage: Int32, rStat) -> None:
        """This thread's query columns of a row-statistics tile (sLSE or sD, stage ``stage``) -> registers."""
        for j in cutlass.range_constexpr(cute.size(rStat)):
            rStat[j] = sStat[c.tScS_mn[0, j][1], stage]

    @cute.jit
    def add_dq(self, c, wg: Int32, t: Int32, gdQ: cute.Tensor) -> None:
        """Note [Direct dQ]: this thread's dQ fragment of step ``t`` straight into dq_accum;
        deterministic, once the sequencer warp says the slot is this CTA's turn, and then telling it
        the adds are issued (Note [Ordered direct dQ])."""
        if const_expr(self.cfg.deterministic):
            cute.arch.barrier(barrier_id=self.dq_bar(_BAR.dq_full, wg, t), number_of_threads=128 + 32)
        red_add_fragment(c.acc_dQ, thread_fragment(gdQ, self.cfg.dq_fragment, self.dq_frag_size, 4, c.tidx), 4)
        if const_expr(self.cfg.deterministic):
            cute.arch.barrier_arrive(barrier_id=self.dq_bar(_BAR.dq_empty, wg, t), number_of_threads=128 + 32)

    @cute.jit
    def epilogue(self, acc_dK, acc_dV, mdK, mdV, sm, work, softmax_scale: Float32, tidx: Int32) -> None:
        """dK *= softmax_scale; dK, dV -> 16 bits -> smem (over sK, sV) -> gmem, 16-byte stores of
        the rows the sequence owns (zeros for a block no query sees)."""
        acc_dK.store(acc_dK.load() * softmax_scale)
        if const_expr(self.cfg.kv_split > 1):
            # Float32 partials straight from registers (Note [Split GQA group]): no smem, so no barrier.
            for acc, mT, mma, d in ((acc_dK, mdK, self.tiled_mma_dk, self.hd), (acc_dV, mdV, self.tiled_mma_dv, self.hd_v)):
                common.store_dkv_partial(acc, mma.get_slice(tidx), mT, work.seq, work.batch, work.head_kv,
                                         work.n_block, work.rows_k, self.tile_n, d)
            return
        # Every warpgroup is done reading sK and sV (its last wgmmas completed before this).
        cute.arch.barrier(barrier_id=_BAR.epi, number_of_threads=self.num_consumer_threads)
        for acc, sT, mma in ((acc_dK, sm.sK, self.tiled_mma_dk), (acc_dV, sm.sV, self.tiled_mma_dv)):
            r2s = cute.make_tiled_copy_C(stmatrix_atom(self.dtype), mma).get_slice(tidx)
            rT = cute.make_rmem_tensor_like(acc, self.dtype)
            convert_f32_to_half(acc, rT)
            cute.copy(r2s, r2s.retile(rT), r2s.partition_D(sT))
        cute.arch.barrier(barrier_id=_BAR.epi, number_of_threads=self.num_consumer_threads)
        for mT, sT, d in ((mdK, sm.sK, self.hd), (mdV, sm.sV, self.hd_v)):
            gT = cute.local_tile(work.seq.k_view(mT, work.batch, work.head_kv), (self.tile_n, d), (work.n_block, 0))
            store_rows_16B(sT, gT, work.rows_k, mT.shape[3], tidx, self.num_consumer_threads)



FlashBwdSm90.kernel.set_name_prefix("fa4_bwd_sm90", remove_cutlass_symbol=True)



# --------------------------------------------------------------------------------------------
# Tuning table, variants, launcher
# --------------------------------------------------------------------------------------------

# Padded head dim -> (tile_m, dkv_rs, q_stages, pds_stages, dq_stages, publish_lag, det_rotate, dq_direct,
# dv_late). 64-row steps, except d64: 128 rows, which first fit 240 registers without serialized
# wgmmas with dS^T from the 16-bit P^T (ds_from_p16; v0.7: 439 -> 496 TFLOP/s, causal 406 -> 461;
# deterministic 386 -> 450, causal 359 -> 420; s1k +14%, s16k +8%; at 64 rows ds_from_p16 loses 2%: d64
# 429, d128 569 -> 556), and since v0.13 with the dV wgmma issued after dS^T and dS from the float32 P
# (dv_late; one lease, ds_from_p16 -> dv_late, TFLOP/s: s8k 486 / 487 -> 503 / 483, causal 469 / 449 ->
# 470 / 466, s1k 394 / 387 -> 402 / 395, s16k 497 / 475 / 503 / 497 / 489 -> 432 / 508 / 512 / 514 / 508,
# deterministic 478 / 474 -> 497 / 492, causal deterministic 441 / 434 -> 442 / 436; the same max
# gradient error against the float32 reference as ds_from_p16 and flash-attn-4, tools/bwd_accuracy.py;
# at d128's 64-row steps dv_late lost 1-12%: 592 / 557 -> 523 / 549); P/dS through smem above 128; two dQ buffers where smem allows (measured v0.6: +2% d128,
# +6% causal, +9% deterministic); the deterministic writer's publish lag (with PUBLISH_PEEK off) where faster
# (v0.6: +4-8% at head dims 64 and 128, -2 to -6% at 256); the rotated deterministic order (where
# :func:`rotate_ok`) where it measured faster (v0.6: d128 +4-5% at s8k in two runs, d256 +2%; d64 -7%
# in two runs with 64-row steps, shorter than a publish; v0.11, d64's 128-row steps, two rounds, plain ->
# rotated -> rotated with lane slots: s8k 457 / 440 -> 465 / 465 -> 475 / 454, s16k 464 / 426 -> 474 / 474 ->
# 426 / 484, s2k 413 / 414 -> 414 / 420 -> 436 / 412, so d64 rotates too; its stagger is 1 when s_q = s_k,
# where the writer does not lag its publishes, Note [Publish lag]);
# dQ added from registers above 128, which frees the smem of a second Q/dO (and P/dS) stage (v0.6:
# d256 303 -> 409 TFLOP/s, causal 285 -> 369, d192 366 -> 388; d128 -2%, d64 +0%: off there).
# Deterministic runs keep dq_direct, its adds ordered by warp 1 (Note [Ordered direct dQ], v0.9: d256
# 299 -> 374, causal 293 -> 345); with det_direct off they take the writer warp, and make_config
# then drops stages to fit.
TUNING = {
    32: (64, True, 2, 2, 2, True, False, False, False),
    64: (128, True, 2, 2, 2, True, True, False, True),
    96: (64, True, 2, 2, 2, True, False, False, False),
    128: (64, True, 2, 2, 2, True, True, False, False),
    160: (64, False, 2, 2, 1, False, True, True, False),
    192: (64, False, 2, 2, 1, False, True, True, False),
    224: (64, False, 2, 1, 1, False, True, True, False),
    256: (64, False, 2, 1, 1, False, True, True, False),
}

TWO_CTA: dict = {}
"""Padded head dims whose default backward is the two-CTA kernel (Note [Two-CTA dQ]); chosen by
measurement against the one-CTA kernel; ``KernelOptions.bwd_two_cta`` overrides. None: it measured
slower everywhere it runs (v0.7, one lease, TFLOP/s one-CTA -> two-CTA with the writer warp / with
direct adds): d128 s8k 567 -> 500 / 491, causal 517 -> 459 / 460, s2k 515 -> 449 / 440; d64 s8k
498 -> 420 / 377, causal 483 -> 387. Halving the dQ reductions does not pay for the exchange, which
couples the pair's steps (the partner's half gates the second dQ wgmma) and takes the second dQ
buffer's smem (sK_peer, sdS_in)."""

LAUNCH_ORDER = common.LaunchOrder(causal=16, det_no_mask=32, det_causal=16, det_causal_direct=8,
                                   det_causal_waves=4, causal_l2_bytes=32 << 20)
"""Pairs per launch section (Note [Launch order] in fa4/bwd/common.py); the sm80 family's values.
Measured for this kernel (v0.6, d128 s8k, one lease each, noisy): without a mask sections of 1 / 4 / 32
pairs gave 640 / 594 / 541 TFLOP/s (1 is the default there); deterministic, plain order, 1 / 2 / 4 /
8 / 16 / 32 / 64 pairs gave 500 / 540 / 542 / 462 / 519 / 484 / 502 (no clear optimum, 32 kept; the
rotated order, sections of 1, replaces it at d128); causal deterministic 16 / 64 / 256: 484 / 477 / 478.
v0.9, causal deterministic with the ordered direct dQ adds (d256 s8k, four runs in two leases): sections
of 8 pairs 344.7 / 345.4 / 344.3 / 342.6 against 333.9 / 335.9 / 334.8 / 332.3 with 64 (16: 334.6, 4:
331.4), hence ``det_causal_direct``; at d128 16 or 32 against 64 moved by -7% to +6% between runs.
v0.12 (sweep v16, one lease, two interleaved rounds, causal deterministic, sections of 64 -> 16 -> 32):
d128 s4k 424.7 / 425.3 -> 460.4 / 457.5 -> 465.0 / 461.8, s8k 497.1 / 486.0 -> 501.2 / 494.0 -> 488.6 /
440.8; d64 s8k 449.8 / 395.8 -> 434.2 / 424.8 -> 440.2 / 408.6. Hence 16. Sweep v17 (same lease,
sections of 16 -> 64 -> 4): d128 s1k 279.5 / 278.9 -> 294.1 / 293.8 -> 267.9 / 267.5, s16k 511.1 / 502.2
-> 499.7 / 502.5 -> 498.9 / 465.5, d64 s8k 433.1 / 409.8 -> 381.7 / 408.1 -> 368.9 / 372.6: the best
sections held 512-2048 CTAs, and at s1k 16 pairs are 128 CTAs, less than one wave. Hence
``det_causal_waves``: about four waves of CTAs per section, rounded to a power of two pairs (s1k: 64).
A first version without the rounding gave s4k 17 pairs: 413.0 / 440.3 against 447.1 / 456.9 with 16.
v0.14 (the peek default; sweeps v27, v28 and a rerun, one lease, five rounds): d128 s1k 64 -> 32 pairs
307.9 / 305.4 / 299.0 / 311.8 / 302.6 -> 324.5 / 322.4 / 317.8 / 325.9 / 313.2 (one more pair of
rounds: 16 pairs, 313.0 / 304.7), while d64 s1k keeps 64 (278.3 / 277.3 / 277.2 against 266.3 / 267.5 /
266.0 with 32), and d128 s2k is even between 16 and 32 (411.4 / 410.3 / 397.7 / 390.4 against 419.8 /
418.1 / 371.6 / 392.4). So the waves count work, not CTAs: four waves of head-dim-64 steps, half as
many CTAs per section at d128 (s1k 32 pairs, s2k 16, from s4k the table's 16 as before). Head dim 96
(s1k 32 pairs, s2k 16) follows the same rule unmeasured; (head_dim, head_dim_v) pairs by head_dim.
v0.17 (sweeps v31 and v32, one lease, three interleaved rounds, medians; non-deterministic causal, Note
[Causal sections]): at s1k / s2k / s4k 32 and 64 pairs lost to 16 (d128 s4k 498.1 -> 468.7 -> 438.5);
from s4k smaller sections won, d128 s16k 549.8 -> 600.8 / 593.5 / 587.7 / 587.6 with 1 / 2 / 4 / 8 pairs,
s8k 547.2 -> 562.0 / 557.6 / 557.9 with 2 / 4 / 8, s4k 508.5 -> 513.8 / 517.0 with 4 / 8, d64 s8k 464.0 ->
472.6 / 470.2 with 4 / 8, d256 s8k 368.1 -> 394.2 / 386.6 with 2 / 4: a budget of 32 MB of Q, dO and dQ
accumulator per section picks 2 / 4 / 8 / 8 / 2 there (within the noise of each best) and keeps 16 at
s1k / s2k. With GQA (sweep v35, four q heads per kv head) a section also holds about a wave of CTAs:
d128 s8k 1 / 2 / 8 pairs 459.4 / 528.3 / 507.4, s4k 2 / 4 / 16 398.1 / 469.9 / 460.7. The 32 MB are for
the H200's 60 MB L2; other GPUs scale them by theirs."""

STATS_EARLY_MAX_HD = 128
"""Padded head dims up to this read lse into registers before the S^T wgmma is issued
(``stats_early=1``). v0.10, d128, one lease, two interleaved rounds (TFLOP/s, default -> 1 -> 2):
s8k 592 / 572 -> 604 / 591 -> 568 / 536; causal 516 / 506 -> 548 / 527 -> 516 / 506; s1k 442 / 435 ->
456 / 466; s16k 502 / 535 -> 597 / 587; deterministic 531 / 511 -> 538 / 516; causal deterministic s4k
407 / 412 -> 412 / 416. d256: 412 / 407 -> 412 / 402 (no gain; not taken). Level 2 (dpsum too) lost
to 1 everywhere but causal deterministic. d96 and 64-row d64 steps take it by the same mechanism,
untimed; the d64 default's 128-row steps read the statistics late (``rows_late``) and are unchanged."""

LANE_SLOTS_MIN_HD = 128
"""The deterministic writer reads its slots from 32 lanes (``lane_slots``, Note [Writer slots]) in the
rotated order at padded head dims from LANE_SLOTS_MIN_HD only. At d64 (rotated since v0.11, sweep v15:
rotated -> with lane slots, s8k 465 / 465 -> 475 / 454, s16k 474 / 474 -> 426 / 484, s2k 414 / 420 -> 436 /
412) the lane slots showed no gain. v0.11, one lease, two interleaved rounds (TFLOP/s, per-step slots -> lane slots):
rotated d128 s8k 565 / 556 -> 575 / 566, s16k 558 / 540 -> 584 / 574, d256 s8k 375 / 372 -> 390 / 378; the
plain orders: d128 causal s8k 476 / 467 -> 481 / 465, s1k 282 / 287 -> 287 / 292, d64 causal 406 / 392 ->
409 / 397, but d64 (no mask, sections of 32 pairs) 453 / 445 -> 432 / 424 and d256 causal (the ordered
direct adds) 341 / 340 -> 325 / 335. Non-deterministic d128 s8k: 581 / 558 -> 578 / 560 (not taken)."""

DET_LAG_MAX_BLOCKS = 32
"""With :data:`PUBLISH_PEEK` off (v0.13's rule; the default since v0.14 is the peek): deterministic
runs with a causal mask (no window) hold the writer's publishes back (``publish_lag``, Note [Publish
lag]) only when a sequence has fewer K blocks than this (max seqlen_k over tile_n; a local window's
blocks cover few m_blocks, like short sequences', and keep the lag: not measured). The rule applies
wherever the table takes the lag (head dims 32-128, the up order too); it was measured at head dims
64 and 128. The lag moves publishes only, so either choice is correct. With the lag, block ``n + 1``
of a pair takes slot ``m`` only after block ``n`` has taken slot ``m - 1``: in the down walk it
trails by a whole step per rank, where without the lag it trails by one publish; without the lag the
writer instead waits for each step's adds before its next spin. v0.13, one lease, d128 causal
deterministic, lag -> no lag (TFLOP/s, two interleaved rounds): s2k 391 -> 332, s4k 452 / 446 -> 462
/ 459, s8k 527 / 489 -> 507 / 499, s16k 493 / 438 -> 522 / 516; d64 s8k 432 -> 442. See
docs/RESULTS.md v0.13 for the confirmation rounds."""

PUBLISH_PEEK = True
"""Deterministic runs with the writer warp take ``publish_peek`` (Note [Publish peek]) in every order,
in place of the publish lag and :data:`DET_LAG_MAX_BLOCKS`' rule; False: the lag rule. v0.13, one
lease, two interleaved rounds (TFLOP/s, lag rule -> peek): d128 causal s1k 298 / 293 -> 310 / 308,
s2k 400 / 345 -> 421 / 388, s4k 469 / 455 -> 475 / 464; rotated d128 s8k 554 / 550 -> 581 / 576; d64
causal s8k 446 / 446 -> 450 / 445. v0.14 (sweep v25, three rounds): d128 s1k causal +5-6%, s16k causal
+2-5%, rotated d128 up to +6.5% (5 of 6 pairs); d128 s8k causal is bimodal with the peek (about a third of
its readings 445-485, against 493-520 for the no-lag rule), with a median at least as high (507-512
against 501). docs/RESULTS.md v0.13, v0.14."""

SEQ_PEEK = True
"""(Since v0.22 the dQ pass serves deterministic runs from padded head dim 160: this and the
constants of the ordered direct adds below apply there with ``KernelOptions(bwd_dq_pass=False)``.)
Deterministic runs with the ordered direct adds (Note [Ordered direct dQ]) in the plain orders
(causal, local: not the rotated one) take ``publish_peek`` on their sequencing warp
(:meth:`FlashBwdSm90.sequence_dq_peek`). v0.15, sweep v30, one lease, three interleaved rounds
(TFLOP/s, without -> with the peek): d256 s8k causal 345.8 / 329.4 / 332.8 -> 355.6 / 343.4 / 345.5,
d192 causal 284.6 / 285.5 / 284.6 -> 322.7 / 325.2 / 322.8; rotated (no mask) d256 386.1 / 385.7 /
373.9 -> 390.9 / 373.3 / 374.1 and d192 304.3 / 306.8 / 304.8 -> 301.3 / 301.0 / 300.0, so the rotated
order keeps the plain spin."""

DET_ROTATE = True
"""Use the rotated deterministic order where it is safe (:func:`rotate_ok`); False: never."""

DET_UP = True
"""Deterministic causal runs without GQA take the up order (Note [Up order] in fa4/bwd/common.py, ``det_up``) with
the non-deterministic causal kernel's sections (Note [Causal sections]); local windows keep the down
order (the up order is an option there, not measured). v0.12 measured the up order with the
deterministic sections (16 / 64 pairs): 15-29% slower than the down order (d128 s8k 499.8 -> 356.5
TFLOP/s, s4k 460.3 -> 393.0). v0.19 (sweep v37, one lease, two interleaved rounds, TFLOP/s, down order
-> up order with the L2-bounded sections): d128 s1k 356.5 / 342.6 -> 361.6 / 352.0 (16 pairs), s4k
500.0 / 487.5 -> 511.7 / 504.8 (8), s8k 527.1 / 493.4 -> 542.3 / 533.0 (4), s16k 549.4 / 554.9 -> 563.1 /
556.9 (2); d64 s8k 462.8 / 455.2 -> 489.7 / 477.6 (8); d256 s8k (the ordered direct adds) 360.7 / 343.9
-> 375.4 / 360.8 (2). The up order at the deterministic sections lost again in the same run (d128 s4k,
16 pairs: 450.1 / 443.1), and at d256 4 pairs lost (325.1 / 315.1): the order wants the L2 bound, as
the non-deterministic kernel's (which walks up too) does. Sweep v38 (same lease, two rounds): d256 s8k
372.6 / 367.2 against the down order's 356.6 / 334.7 (one pair per section: 373.5 / 341.8); d64 s2k 382.9
/ 364.9 against 367.0 / 361.6; d128 s2k 366.2 / 419.4 against 418.5 / 400.4 (noise). With GQA it lost
by 31%: :data:`DET_UP_GQA`."""

DET_UP_LOCAL = False
"""Deterministic runs with a local window take the up order too (an option: not measured there)."""

DET_UP_GQA = False
"""Deterministic causal runs with GQA / MQA (more than one q head per kv head) take the up order too.
Off: v0.19 (sweep v38, one lease, two interleaved rounds, TFLOP/s, up -> down order), four q heads per
kv head, d128 causal s8k 358.9 / 350.9 -> 522.5 / 524.2, s4k 325.3 / 330.0 -> 474.7 / 480.7 (the
non-deterministic kernel: s8k 533.5 / 509.2); with sections of one or two pairs (sweep v39) s8k 375.0 /
356.6 / 368.0 and 358.2 / 344.7 / 353.9 against 525.6 / 515.0 / 517.6, so not the L2: a GQA block walks
its m_blocks once per q head, so its longest block (512 steps at s8k, about 1.2 ms of the kernel's 2.6)
is four times longer against the grid, and the up order launches it last (its SPT tail, Note [Up
order])."""

DET_TAIL, DET_TAIL_SHARE = 2, 8
"""``det_tail`` / ``det_tail_share`` of the up order (Note [Down tail] in fa4/bwd/common.py): the last
``min(2, heads_k // 8)`` kv heads of every batch walk the down order and launch last. Sweep v40 (one
lease, three interleaved rounds, TFLOP/s medians, causal deterministic; kv heads in the down order:
none -> one -> two -> four): d128 s8k 529.3 -> 544.5 -> 551.1 (non-deterministic 536.9); s16k 548.7 ->
558.2 -> 559.5 (573.3); s4k 498.9 -> 503.6 -> 509.7 (499.0); s1k 353.1 -> (two) 349.6; d64 s8k 457.5 ->
(two) 475.1 -> (four) 463.4 (471.6); d256 s8k 370.5 -> 379.8 -> (two) 368.3 (393.4). tools/det_model.py
puts the up order's SPT tail at 5-6% of the grid and the tail's fill at about 4 pairs at s8k."""

DET_ROUNDS = {192: 2}
"""``det_rounds`` of the rotated deterministic order by padded head dim (Note [Rotation rounds] in
fa4/bwd/common.py; 1 where absent; d192: with ``bwd_dq_pass=False``, the dQ pass being the default).
Sweep v42 (one lease, three interleaved rounds, TFLOP/s, s8k
without a mask, one round -> two): d192 308.9 / 309.0 / 308.1 -> 323.9 / 322.9 / 322.8 (+4.8%; not
deterministic 381-388); d256 389.1 / 384.3 / 386.0 -> 384.8 / 377.1 / 371.7 (-2.4%; 399-411); d128 585.3
/ 579.2 / 567.0 -> 569.9 / 547.9 / 555.3 (-3%, its stagger is 2 already); d64 502.0 / 502.1 / 502.4 ->
494.6 / 475.2 / 475.3 (-5%). At d256 the chain's wait is smaller than what the rounds cost (CTAs of a
second round resident before the first ends, sections of two pairs)."""

DQ_FIRST_STORE = {True: True, False: False}
"""Keyed by ``deterministic``: whether runs with the dQ writer warp (not ``dq_direct``, not ``two_cta``)
store each dq_accum slot's first tile, so the preprocess does not zero the accumulator (Note [First
store]). docs/RESULTS.md v0.18, one lease, d128 (16k tokens x 16 heads), us per call, zeroed -> first
store: the preprocess 67.5 -> 41.5 in every mode; deterministic (rank 0 stores, no new wait) the main
kernel unchanged (s1k causal 408.0 -> 409.2, s4k causal 1304.7 -> 1296.0), the call's span 529 -> 513
and 1408 -> 1381. Without determinism the claims cost the main kernel more than the zeroing saves (s1k
causal 360.1 -> 365.2, s1k 588.4 -> 643.6, s4k causal 1178.6 -> 1228.9, s16k 8474 -> 8736; d64 s8k
5108 -> 5091; the claim's first version, an acquire CAS waited for at the top of the step, now
relaxed and not yet measured): the CAS and the claimant's publish (store completion, ``MEMBAR.GPU``)
lengthen the writer's step, and without a mask every K block of a pair claims the same slot at once. Off there."""

ORDERED_SHORT_MAX_SEQLEN_K = 1024
ORDERED_SHORT_MIN_WAVES = 4
"""Note [The ordered kernel for short causal rows]
A call that does not ask for determinism takes the deterministic kernel where that kernel has measured
faster: padded head dim 128 (and head_dim_v equal), a causal mask, as many queries as keys, more than
half this many and at most this many keys (measured at 1024), MHA, dense (no varlen, seqused_k, pages or
user functions), no backward option set, and at least ``ORDERED_SHORT_MIN_WAVES`` waves of CTAs
(measured at 15.5: 2,048 CTAs on 132 SMs; with few CTAs the ordered adds have less other work to hide
behind, unmeasured). Its first contributor to each dQ slot stores (Note [First store]), so the
preprocess does not zero the float32 accumulator, 134 MB at 16k tokens x 16 heads (26-40 us of a call of
about 0.5 ms at d128 s1k causal), and its up order (Note [Up order]) walks each K block's queries up
from the diagonal as the non-deterministic kernel does, shortest blocks launched first. The
non-deterministic kernel's own first store (claims, :data:`DQ_FIRST_STORE`) cost its main kernel more
than the zeroing saved (v0.18-v0.19). Measured: ``python -m fa4.bench --mode bwd --deterministic`` at
d128 s1k causal (16 x 1024 tokens, 16 heads), deterministic / non-deterministic in the same run, 370.1 /
357.7 TFLOP/s (+3.5%, H200, v0.22) and 342.2 / 314.3 (+8.9%, H100, v0.59); at s4k causal 535.3 / 528.7
(+1.2%) and 506.1 / 508.1 (-0.4%), so longer rows keep the non-deterministic kernel; without a mask at
s1k +0.8% / +1.5% (inside a run's noise: not taken). The results are the deterministic kernel's: the
same bits on every run. 0 turns it off; ``fa4.explain()`` says when a call takes it."""


def ordered_for_speed(problem: AttnProblem, options: Optional[KernelOptions]) -> bool:
    """Whether a call that does not ask for determinism runs the deterministic kernel because it is the
    faster one there (Note [The ordered kernel for short causal rows])."""
    opts = options or KernelOptions()
    if any(getattr(opts, f.name) is not None for f in dataclass_fields(opts) if f.name.startswith("bwd_")):
        return False
    k_blocks = -(-problem.seqlen_k // (128 if TUNING[128][1] else 64))  # (make_config's tile_n at d128)
    # (Only square rows in the measured neighbourhood: with few queries per key block the K blocks of
    # a slot queue in order on few slots, where the non-deterministic kernel adds them at once.)
    return bool(ORDERED_SHORT_MAX_SEQLEN_K and problem.causal and not problem.local
                and problem.seqlen_q == problem.seqlen_k
                and ORDERED_SHORT_MAX_SEQLEN_K // 2 < problem.seqlen_k <= ORDERED_SHORT_MAX_SEQLEN_K
                and head_dim_padded(problem.head_dim) == 128 and problem.head_dim_v == problem.head_dim
                and problem.heads == problem.heads_k and not problem.is_varlen
                and not (problem.score_mod or problem.mask_mod or problem.score_mod_bwd or problem.block_table)
                and problem.batch * problem.heads_k * k_blocks >= ORDERED_SHORT_MIN_WAVES * _num_sms())


CLAIM_ROTATE = False
"""Non-deterministic runs with the first store (the claims of Note [First store], ``DQ_FIRST_STORE[False]``)
walk the rotated order of Note [Rotated order] where :func:`rotate_ok` allows it (no mask), not the plain
one, so that the K blocks of a pair do not all claim the same slot at once (block ``n`` starts ``n *
stagger`` m_blocks further on). An option, off: v0.19 (one lease, torch.profiler main-kernel us, the
default -> relaxed claims rotated / plain): d128 s1k 614.2 -> 651.9 / 641.9, s16k 8487 -> 8540 / 8756; d64
s8k 5244 -> 5154 / 4985 (that row's default read 5108 in v0.18). With a causal mask (the plain order
either way) s1k 360.3 -> 383.1, s4k 1175.9 -> 1208.2: the claims cost the main kernel about what the
unzeroed accumulator saves the preprocess (26 us), so they stay off (:data:`DQ_FIRST_STORE`)."""

DET_DIRECT = True
"""Deterministic runs of the head dims whose table takes ``dq_direct`` (160-256) keep it, with the
ordered direct adds of Note [Ordered direct dQ]; False: they take the ordered writer warp instead.
Since v0.22 those runs take the dQ pass unless ``KernelOptions(bwd_dq_pass=False)``."""

DQ_PASS_MIN_HD: dict = {True: 160, False: 160}
"""Keyed by ``deterministic``: the padded head dims from which the backward takes the dQ pass (Note
[dQ pass] in fa4/bwd/dq_sm90.py: dK / dV here, dQ in a second kernel without reductions; with the
writer warp's head dims the writer, its sdQ tile and the first store go too); None: never. Without
determinism and with a mask only from :data:`DQ_PASS_MASKED_MIN_HD`. With the pass a deterministic run takes the
non-deterministic main kernel (:func:`make_config`). Measured (docs/RESULTS.md v0.21 and v0.22,
sweeps v46-v48, three interleaved rounds, TFLOP/s off -> on): deterministic d192 321 -> 389-402, d256
390-392 -> 404-428; not deterministic without a mask d256 409-417 -> 413-428, d224 385-408 -> 408-418,
d160 374-398 -> 384-402, d192 379-398 -> 380-403 (flat); d128 580-603 -> 451-475 and d64 508-515 ->
391-398 (the two extra wgmmas cost more than the reductions there)."""

DQ_PASS_MASKED_MIN_HD = 224
"""The padded head dims from which a non-deterministic backward with a causal or local mask takes the
dQ pass too (None: never). v0.22 (sweep v48, the pass's old grid order, off -> on, TFLOP/s): causal
d160 368-386 -> 357-367, d192 381-387 -> 365-378, d224 371-391 -> 377-386, d256 394-403 -> 388-400, so
never. v0.24, the pass in the forward's tile order (Note [dQ pass tile order] in fa4/bwd/dq_sm90.py;
sweep v52, three interleaved rounds): d256 s2k 329 / 329 / 320 -> 342 / 337 / 334, s4k 369 / 361 / 361
-> 377 / 376 / 365, s8k 403 / 341 / 390 -> 401 / 388 / 381 (flat), d224 s8k 382 / 373 / 358 -> 384 /
380 / 367; d192 393 / 375 / 376 -> 378 / 377 / 372 and d160 369 / 350 / 368 -> 362 / 346 / 350 lose.
Local masks follow the causal rule (not measured)."""

BWD_EXP2_EMU_FRAC = {(64, "causal"): 0.125, (64, "none"): 0.125, (32, "none"): 0.5}
"""exp2 emulation in the backward (``exp2_emu_frac``, Note [exp2 emulation] in fa4/softmax.py): the share
of P^T's exponentials on the FMA pipe by default, keyed by (padded head dim, mask: "none" / "causal" /
"local"), for the configs measured: not deterministic (asked), the 1-CTA kernel, the table's own
``tile_m``, ``head_dim_v == head_dim`` (elsewhere 0; ``KernelOptions.bwd_exp2_emu_frac`` sets it on any
sm90 backward; the dQ pass's own kernel, :mod:`fa4.bwd.dq_sm90`, always uses MUFU). docs/RESULTS.md
v0.25: sweeps v54 / v55 (three interleaved rounds each, two leases), d64 s8k causal, 0.125 read +1.3% to
+5.7% in six of six rounds (ncu had 12.8% of its stall samples on MUFU, most of them the MIO queue's);
0.1875 no better. Sweep v56 (s8k, three rounds): d32 without a mask, 64-row steps with the most
exponentials per FLOP, 0.5 read +3.1% to +4.1% (0.25: +1.6%). v0.26, sweep v57 (five interleaved rounds):
d64 without a mask at 0.125, s2k +3.2% (ahead in 5 of 5 rounds), s8k +0.2% (3 of 5; v54 had read -6% to
+12% there, noise); 0.0625 no better. Not taken: d64 causal deterministic (-4% to +1%), d32 causal (-1.3%), d96 (-1% to -5%), d128 with or
without a mask at 0.125 / 0.25 / 0.375 / 0.5 (-18% to +4%, no sign); local masks not measured; the
forward neither (0.125 / 0.25: -2% to -8% at d64 / d128 s8k in the same lease)."""


COMPACT_VARLEN = False
"""Whether varlen backwards take the compact grid (Note [Compact varlen grid] in fa4/sched/tile.py;
not with determinism, 2-CTA or the first store). Off: two interleaved rounds (docs/RESULTS.md
v0.28, TFLOP/s, default -> compact) varlen d64 causal 385.9 -> 391.5 and 383.2 -> 392.2, d128
causal 466.9 -> 466.2 and 448.2 -> 460.1, GQA causal 439.4 -> 447.4 and 437.3 -> 434.6, d128
533.5 -> 542.2 and 484.3 -> 531.9: +1.7% median, under the timings' resolution (about 4%)."""

PDL = True
PDL_MAX_SEQLEN_K = 2048
"""Whether the main kernel and the postprocess are programmatic dependent launches (Note
[Programmatic dependent launch]): where ``PDL`` and the keys number at most ``PDL_MAX_SEQLEN_K``
(``max_seqlen_k`` for varlen calls). v0.56, H100, five interleaved rounds (sweep_bwd, TFLOP/s, off
-> on, per-round changes): d128 s1k +0.7 / +2.0 / -0.2 / -0.6 / +4.3%, causal +0.7 / +0.6 / +0.9 /
+0.8 / +0.8%; d64 s8k +0.9 / +0.4 / +0.2% (two rounds with a default outlier 10-20% low); d128 s8k
-1.6 / -0.9 / -5.6 / +0.6 / -4.8%; d128 s16k causal (three rounds) -0.9 / +2.0 / +3.0%. The gain
at short sequences is the launch gaps (the small kernels' share of the call is largest there); at
d128 s8k it lost in four rounds of five, with no cause measured, so longer calls keep plain launches
(the candidates: the postprocess's CTAs resident beside the main kernel's last wave, which
``pdl_post`` off would tell apart; the main kernel's CTAs placed beside the preprocess's last ones)."""


BLOCK_SPARSE_DET_DQ_PASS = True
"""Whether a deterministic block-sparse backward takes the dQ pass at every head dim (Note [dQ pass] in
fa4/bwd/dq_sm90.py), so that both its kernels narrow to the visible blocks (Note [Block skip in the
backward]); without it, below head dim 160, the main kernel's ordered dQ computes every block. The
pass recomputes S and dP per Q block (about 40% more tensor work per visible block), so it pays off
where a good share of the blocks is hidden. Measured (v0.39, H100, the block-sparse document lists,
b2 s8k h16 d128, deterministic): 7.60-7.62 ms with the ordered dQ computing every block, 1.87-1.88 ms
through the pass (non-deterministic: 1.28-1.31 ms; flash-attn-4 deterministic 15.9-16.0 ms)."""

COMPACT_LOOSE_BOUND = False
"""Whether a varlen backward whose ``max_seqlen_k`` is a loose bound (``fa4.sched.tile.loose_bound``:
the call omitted it, or one long sequence among short ones) takes the compact grid. Off: timed in
v0.38 (``tools/device_run.sh next30e``, H100, two rounds, calls without the lengths, ms, default /
compact): varlen d128 1.84 / 1.71-1.87, varlen GQA 32 / 8 d128 causal 3.11-3.12 / 3.08-3.09 (the
latter before its launch sections were judged on the average lengths, ``common.section_lengths``:
2.49-2.50 since, on the default grid). No gain seen."""


def _loose_k(problem: AttnProblem) -> bool:
    """Whether :data:`COMPACT_LOOSE_BOUND` sends ``problem`` to the compact grid (where it may run)."""
    return COMPACT_LOOSE_BOUND and problem.varlen_k and loose_bound(problem.seqlen_k, problem.total_k, problem.batch)


def kv_split_for(problem: AttnProblem, tile_m: int, tile_n: int, num_sms: int) -> int:
    """:func:`fa4.bwd.common.kv_split_for` (the rule, shared with the sm80 family)."""
    return common.kv_split_for(problem, tile_m, tile_n, num_sms)


def _num_sms() -> int:
    from fa4.arch import num_sms

    return num_sms()


def rotate_ok(problem: AttnProblem, tile_n: int) -> bool:
    """Whether the rotated deterministic order (Note [Rotated order] in fa4/bwd/common.py) serves
    ``problem``: no causal or local mask, and one CTA per SM leaves room for all the K blocks of a
    (batch, kv head) pair at once."""
    from fa4.arch import num_sms

    if not DET_ROTATE or problem.causal or problem.local:
        return False
    return -(-problem.seqlen_k // tile_n) <= num_sms()


def make_config(problem: AttnProblem, options: Optional[KernelOptions], arch: str,
                deterministic: bool = False, det_direct: Optional[bool] = None) -> BwdSm90Config:
    """The tuning table for the padded head dim with ``options.bwd_tile_m`` on top (ValueError
    naming the option when the kernel cannot run it). ``det_direct``: whether a deterministic run
    keeps the table's ``dq_direct`` (Note [Ordered direct dQ]); None: :data:`DET_DIRECT`."""
    hd = head_dim_padded(problem.head_dim)
    hd_v = head_dim_padded(problem.head_dim_v)
    tile_m, rs, q_stages, pds_stages, dq_stages, lag, rotate, direct, late = TUNING[hd]
    det_direct = DET_DIRECT if det_direct is None else det_direct
    if hd_v != hd:  # (head_dim, head_dim_v) pairs: the table's path with 64-row steps, which fit any pair
        tile_m, late = 64, False
    opts = options or KernelOptions()
    if opts.bwd_num_threads is not None and opts.bwd_num_threads != 384:
        raise ValueError(f"KernelOptions.bwd_num_threads={opts.bwd_num_threads}: the sm90 backward runs 384 threads "
                         "(a producer and two consumer warpgroups)")
    tile_n = 128 if rs else 64
    steps = opts.bwd_tile_m or tile_m  # Q rows per step
    if problem.score_mod and opts.bwd_tile_m is None:
        # The kept Q K^T of a score_mod (fa4/mods.py) spills with 128-row steps (d64 with the tanh
        # score_mod of the tests: 71 spill stores; 64-row steps: none).
        steps = 64
    if problem.block_table and opts.bwd_tile_m is None:
        # The steps' block states and mask passes (Note [Block skip in the backward]) spill with d64's
        # 128-row steps (a 40-byte frame against 8 without them; 64-row steps: none).
        steps = 64
    if opts.bwd_tile_m not in (None, 64, 128):
        raise ValueError(f"KernelOptions.bwd_tile_m={opts.bwd_tile_m}: the sm90 backward runs 64 or 128 rows per "
                         "step (80, with the swapped dQ wgmma, is an experiment not yet run on a GPU)")
    if opts.bwd_tile_n is not None and opts.bwd_tile_n != tile_n:
        raise ValueError(f"KernelOptions.bwd_tile_n={opts.bwd_tile_n}: the sm90 backward at head_dim "
                         f"{problem.head_dim} uses tile_n {tile_n}")
    asked_det = bool(deterministic)  # (a run with the dQ pass then takes the non-deterministic kernel)
    # Note [The ordered kernel for short causal rows]: the deterministic kernel where it is the faster.
    # Its config must equal the asked one (the CPU test checks): the two uses of ``asked_det`` below,
    # the emulation (no (128, "causal") entry) and the GQA split (MHA only), cannot tell them apart.
    deterministic = asked_det or ordered_for_speed(problem, options)
    two_cta = (bool(opts.bwd_two_cta) if opts.bwd_two_cta is not None
               else TWO_CTA.get(hd, False) and not deterministic and (opts.bwd_kv_split or 1) == 1)
    if opts.bwd_dq_pass is not None:
        dq_pass = opts.bwd_dq_pass
        if dq_pass and two_cta:
            raise ValueError("KernelOptions.bwd_dq_pass=True: the dQ pass (Note [dQ pass]) runs with the 1-CTA "
                             "backward; the 2-CTA kernel (bwd_two_cta) adds dQ in the main kernel")
    else:
        bound = DQ_PASS_MIN_HD[bool(deterministic)]
        dq_pass = (not two_cta and bound is not None and hd >= bound
                   and (deterministic or not (problem.causal or problem.local)
                        or (DQ_PASS_MASKED_MIN_HD is not None and hd >= DQ_PASS_MASKED_MIN_HD)))
        # A deterministic block-sparse run skips blocks only through the dQ pass (Note [Block skip in
        # the backward]): :data:`BLOCK_SPARSE_DET_DQ_PASS`.
        dq_pass = dq_pass or bool(BLOCK_SPARSE_DET_DQ_PASS and deterministic and problem.block_table and not two_cta)
    if dq_pass:
        # dQ comes from the dQ pass, the same bits on every run; the main kernel's dK / dV sums are in
        # CTA order in either mode: a deterministic run takes the non-deterministic kernel.
        deterministic = False
    writer = bool(deterministic) and not (direct and det_direct)  # the ordered writer warp
    dq_direct = direct and (det_direct or not deterministic)
    first_store = DQ_FIRST_STORE[bool(deterministic)] and not dq_direct and not two_cta and not dq_pass
    # Claims (the first store without determinism) walk the rotated order too, where it serves: the
    # K blocks of a pair then reach each slot at different steps (:data:`CLAIM_ROTATE`).
    claims_rotate = first_store and not deterministic and CLAIM_ROTATE
    block_skip = BlockSkip.table_fits(problem.block_table, steps, tile_n) if not deterministic else ()
    # (the rotated order counts m_blocks from 0: not over a narrowed range)
    rotated = (bool(deterministic) or claims_rotate) and rotate and rotate_ok(problem, tile_n) and not block_skip
    det_up = (bool(deterministic) and ((problem.causal and DET_UP) or (problem.local and DET_UP_LOCAL))
              and (problem.heads == problem.heads_k or DET_UP_GQA))
    cfg = BwdSm90Config(
        # dv_late belongs to the table's tile_m (it loses at 64 rows, v0.13).
        arch=arch, dtype=problem.dtype, head_dim=hd, head_dim_v=hd_v if hd_v != hd else 0,
        tile_m=steps, tile_n=tile_n, num_wg=2,
        dv_late=late and steps == tile_m,
        two_cta=two_cta,
        dkv_rs=rs, q_stages=q_stages, pds_stages=pds_stages, dq_stages=dq_stages, deterministic=bool(deterministic),
        publish_lag=writer and lag and not PUBLISH_PEEK and not (
            problem.causal and not problem.local and -(-problem.seqlen_k // tile_n) >= DET_LAG_MAX_BLOCKS),
        publish_peek=(writer and PUBLISH_PEEK) or (bool(deterministic) and not writer and not rotated and SEQ_PEEK),
        det_rotate=rotated, lane_slots=rotated and hd >= LANE_SLOTS_MIN_HD,
        det_rounds=DET_ROUNDS.get(hd, 1) if rotated and deterministic else 1,
        det_up=det_up, det_tail=DET_TAIL if det_up else 0, det_tail_share=DET_TAIL_SHARE,
        dq_direct=dq_direct, dq_first_store=first_store,
        dq_pass=dq_pass,
        # Not with more than 64 rows per step (``rows_late``): measured 7-16% slower at d64 (v0.11).
        stats_early=1 if hd <= STATS_EARLY_MAX_HD and steps <= 64 else 0,
        exp2_emu_frac=(float(opts.bwd_exp2_emu_frac) if opts.bwd_exp2_emu_frac is not None
                       else 0.0 if asked_det or two_cta or steps != TUNING[hd][0] or hd_v != hd
                       else BWD_EXP2_EMU_FRAC.get((hd, "causal" if problem.causal else
                                                   "local" if problem.local else "none"), 0.0)),
        # (1 when determinism is asked: a split that reads the batch would change a sample's bits.)
        kv_split=common.choose_kv_split(opts, problem, lambda: kv_split_for(problem, steps, tile_n, _num_sms()),
                                        two_cta=two_cta, deterministic=asked_det),
        compact_grid=((COMPACT_VARLEN or _loose_k(problem)) and problem.varlen_k and not deterministic and not two_cta and not first_store),
        # (deterministic: its dQ order counts every K block of a slot's mask range; with the dQ pass
        # the main kernel is not deterministic and narrows too.)
        block_skip=block_skip,
        score_mod_bwd=problem.score_mod_bwd,
        pdl=PDL and problem.seqlen_k <= PDL_MAX_SEQLEN_K,
        **BwdSm90Config.problem_flags(problem))
    # What a larger tile_m leaves no room for: the second dQ buffer. What the sdQ tile of a
    # deterministic run (no dq_direct) leaves no room for: P/dS stages, then Q/dO stages.
    fields = ("dq_stages", "pds_stages", "q_stages") if direct and deterministic and not cfg.dq_direct else ("dq_stages",)
    for field in fields:
        if cfg.smem_bytes() > SMEM_CAPACITY and getattr(cfg, field) > 1:
            cfg = replace(cfg, **{field: 1})
    try:
        FlashBwdSm90.can_implement(cfg)
    except ValueError as e:
        # Name the options that asked for something other than the table's choice.
        asked = [f"bwd_tile_m={opts.bwd_tile_m}"] if opts.bwd_tile_m is not None else []
        asked += ["bwd_two_cta=True"] if opts.bwd_two_cta else []
        asked += [f"bwd_dq_pass={opts.bwd_dq_pass}"] if opts.bwd_dq_pass is not None else []
        asked += [f"bwd_kv_split={opts.bwd_kv_split}"] if opts.bwd_kv_split not in (None, 1) else []
        if asked:
            raise ValueError(f"KernelOptions.{', '.join(asked)}: {e}") from None
        raise
    return cfg


def explain_notes(problem: AttnProblem, options: Optional[KernelOptions], cfg: BwdSm90Config) -> list[str]:
    """Lines for ``fa4.explain()``: the deterministic order in use, and where determinism costs a
    path (the writer warp instead of ``dq_direct``, and the stages it leaves room for); 1-CTA or
    2-CTA."""
    notes = []
    if cfg.two_cta:
        notes.append("2-CTA backward: clusters of two CTAs on adjacent K blocks swap halves of dS through "
                     "distributed shared memory, each adding half of the dQ rows (Note [Two-CTA dQ])")
    else:
        notes.append("1-CTA backward (one CTA per K block; KernelOptions(bwd_two_cta=True) selects the 2-CTA "
                     "kernel where it applies: padded head dims 64 and 128, not deterministic)")
    if cfg.kv_split > 1:
        notes.append(f"split GQA group: the {problem.heads // problem.heads_k} q heads of each kv head over "
                     f"{cfg.kv_split} CTAs per K block, float32 partial dK / dV summed after the kernel (Note "
                     "[Split GQA group]: few kv heads would leave too few CTAs)")
    elif not cfg.two_cta and (options is None or options.bwd_kv_split is None) and problem.heads > problem.heads_k:
        # Asked determinism keeps one CTA per kv head; name the split the rule gives without it.
        rule = kv_split_for(problem, cfg.tile_m, cfg.tile_n, _num_sms())
        if rule > 1:
            notes.append(f"GQA group not split (deterministic: the split rule reads the batch, so a sample's bits "
                         f"would depend on it); without determinism it would be {rule} CTAs per K block. A fixed "
                         f"KernelOptions(bwd_kv_split={rule}) keeps the bits batch-independent and is faster "
                         "where the kv heads leave too few CTAs (Note [Split GQA group])")
    if cfg.exp2_emu_frac:
        notes.append(f"exp2 emulation: {cfg.exp2_emu_frac:g} of the main backward kernel's P exponentials on the FMA pipe "
                     "(a polynomial, Note [exp2 emulation]; KernelOptions(bwd_exp2_emu_frac=0) turns it off)")
    pairs = problem.batch * problem.heads_k * cfg.kv_split  # (virtual kv heads: Note [Split GQA group])
    lengths = common.section_lengths(problem, problem.seqlen_k)
    sec = common.launch_sections(cfg, LAUNCH_ORDER, pairs, *lengths,
                                 problem.heads // (problem.heads_k * cfg.kv_split), problem.head_dim,
                                 problem.head_dim_v)
    averaged = [f"{n} {side}" for n, given, side in ((lengths[1], problem.seqlen_q, "queries"),
                                                      (lengths[0], problem.seqlen_k, "keys")) if n != given]
    judged = (f"; judged on the average sequence lengths ({', '.join(averaged)}): the call gave no max_seqlen for "
              "them" if averaged else "")
    rows = "Q and dO" if cfg.dq_pass else "Q, dO and dQ accumulator"  # no accumulator under the dQ pass
    why = (f" (their {rows} bounded by {LAUNCH_ORDER.causal_l2_bytes >> 20} MB per "
           f"{common.arch.H200_L2_BYTES >> 20} MB of L2, and at least about a wave of CTAs: Note [Causal sections])"
           if cfg.causal and ((not cfg.deterministic and LAUNCH_ORDER.section is None)
                              or (cfg.det_up and LAUNCH_ORDER.det_section is None)) else "")
    if cfg.compact_grid:
        heads_k = problem.heads_k * cfg.kv_split
        sec = min(lowest_pow2(sec), lowest_pow2(heads_k))  # as fa4.sched.tile.compact_tile
        why = ""
        if not COMPACT_VARLEN and _loose_k(problem):
            why = (f"; taken because max_seqlen_k {problem.seqlen_k} is over {LOOSE_BOUND_RATIO}x the average length "
                   "(COMPACT_LOOSE_BOUND)")
        notes.append(f"launch order: the compact varlen grid (packed K rows // {cfg.tile_n} + batch slots per kv "
                     f"head, no CTA past a sequence's end: Note [Compact varlen grid]), each sequence's blocks in "
                     f"sections of {sec} of its {heads_k} kv heads{why}{judged}")
    else:
        notes.append(f"launch order: sections of {sec} of the {pairs} (batch, kv head) pairs{why}{judged}")
    if cfg.dq_pass:
        notes.append("dQ pass: the main kernel computes dK and dV only, and a second kernel computes dQ with "
                     "its query rows stationary, without global reductions, so every run gives the same bits "
                     "and deterministic=True runs the same kernels (Note [dQ pass] in fa4/bwd/dq_sm90.py); "
                     "its grid in the forward's tile order, longest query tiles first, in L2 sections "
                     "(Note [dQ pass tile order])")
    if cfg.deterministic and ordered_for_speed(problem, options):
        notes.append(f"the deterministic kernel, taken without deterministic=True too: on square causal rows "
                     f"of at most {ORDERED_SHORT_MAX_SEQLEN_K} keys at head dim 128 it measured faster than "
                     "the non-deterministic one (its first tile stores, so the dQ accumulator is not zeroed: Note "
                     "[The ordered kernel for short causal rows]; fa4.bwd.sm90.ORDERED_SHORT_MAX_SEQLEN_K = 0 "
                     "turns that off)")
    if cfg.deterministic:
        rounds = (f", its K blocks in {cfg.det_rounds} rounds per pair (Note [Rotation rounds])"
                  if cfg.det_rounds > 1 else "")
        order = (f"the rotated order (Note [Rotated order] in fa4/bwd/common.py){rounds}" if cfg.det_rotate else
                 "the up order: m_blocks walked up from the diagonal, the shortest K blocks launched first, "
                 "sections bounded by L2 bytes as without determinism (Note [Up order] in fa4/bwd/common.py)"
                 if cfg.det_up else
                 "K blocks in launch order, m_blocks walked down (Note [Deterministic dQ])"
                 + (" (with GQA the up order's shortest-first launch leaves a long tail: DET_UP_GQA)"
                    if cfg.causal and problem.heads != problem.heads_k and DET_UP and not DET_UP_GQA else ""))
        notes.append(f"deterministic dQ: {order}")
        tail = common.tail_heads(problem.heads_k, cfg.det_tail, cfg.det_tail_share)
        if cfg.det_up and tail:
            notes.append(f"deterministic dQ, down tail: the last {tail} of the {problem.heads_k} kv heads of every "
                         "batch walk the down order and launch last, so the grid ends with short blocks (Note [Down "
                         "tail] in fa4/bwd/common.py)")
        free = make_config(problem, options, cfg.arch, False)
        if cfg.dq_direct:
            notes.append("deterministic dQ is added from registers like the non-deterministic kernel's, each slot's "
                         "adds in rank order (Note [Ordered direct dQ])")
        elif free.dq_direct:
            notes.append(f"deterministic dQ goes through the ordered writer warp, so {cfg.q_stages} Q/dO stage(s) "
                         f"fit where the non-deterministic kernel adds dQ from registers with {free.q_stages} "
                         "(measured 0.73-0.79x of its speed at head dim 256, docs/RESULTS.md v0.6)")
    return notes


def run_backward(cfg: BwdSm90Config, problem: AttnProblem, dout, q, k, v, out, lse, dlse, cu_seqlens_q,
                 cu_seqlens_k, seqused_k, dq, dk, dv, aux=None) -> None:
    """dq, dk, dv in place: :func:`fa4.bwd.common.run_backward` with this family's launch order;
    ``aux``: the mask_mod's aux tensors (``cfg.aux``), the main kernel's and the dQ pass's last
    argument."""
    common.run_backward(cfg, problem, dout, q, k, v, out, lse, dlse, cu_seqlens_q, cu_seqlens_k, seqused_k,
                        dq, dk, dv, order=LAUNCH_ORDER, extra=(launch_aux(aux) if cfg.aux else None,))


def variants(arch: str) -> list[BwdSm90Config]:
    """A covering set for sm_90a (none for other archs): every padded head dim bucket, both dtypes,
    both P/dS paths, one and two stages, and each of causal / local / softcap / varlen /
    seqused_k / deterministic at least once."""
    if arch != "sm_90a":
        return []
    P = common.representative_problem

    def ordered_config(p, options, arch, deterministic=False, **kw):
        """make_config with the main kernel's own dQ (the orders and paths below cover it; the dQ
        pass's cases use make_config)."""
        opts = (options or KernelOptions()).merged(KernelOptions(bwd_dq_pass=False))
        return make_config(p, opts, arch, deterministic, **kw)

    cases = [
        (P(64), False),
        (P(128), False),
        (P(128, causal=True), True),
        (P(96, "fp16", local=True), False),
        (P(128, softcap=30.0, varlen=True, seqused_k=True), True),
        (P(192, causal=True, varlen=True), False),
        (P(256), False),
        (P(256, "fp16", local=True, varlen=True, seqused_k=True), False),
        (P(160, softcap=30.0), False),
        (P(32, causal=True), False),
        (P(224, causal=True), True),
    ]
    out = [ordered_config(p, None, arch, det) for p, det in cases]
    short = [replace(c, kv_split=1) for c in out]  # (1024 keys: with pdl, PDL_MAX_SEQLEN_K)
    # (head_dim, head_dim_v) pairs: DeepSeek's (192, 128) (P/dS through smem), deterministic and
    # varlen causal; (128, 64) and (64, 128) with P/dS in registers.
    V = lambda p, dv: replace(p, head_dim_v=dv)  # noqa: E731
    out.append(ordered_config(V(P(192), 128), None, arch))
    out.append(ordered_config(V(P(192, causal=True, varlen=True, seqused_k=True), 128), None, arch, True))
    out.append(ordered_config(V(P(128, "fp16", local=True), 64), None, arch))
    out.append(ordered_config(V(P(64, causal=True), 128), None, arch))
    # What bwd_tile_m gives off the table: 64-row steps at d64 (no ds_from_p16).
    out.append(ordered_config(P(64), KernelOptions(bwd_tile_m=64), arch))
    out.append(ordered_config(P(64, causal=True), None, arch, True))  # 128-row deterministic steps
    out.append(ordered_config(P(64), None, arch, True))  # ... rotated (stagger 1 at s_q = s_k)
    out.append(replace(out[-1], lane_slots=True))
    # Two-CTA (Note [Two-CTA dQ]): d128 swapped half tiles, with the writer warp or direct adds;
    # masks, varlen and seqused_k; d64's 64-row halves; GQA is a runtime size.
    two = KernelOptions(bwd_two_cta=True)
    out.append(ordered_config(P(128), two, arch))
    out.append(replace(ordered_config(P(128, causal=True), two, arch), dq_direct=True))
    out.append(ordered_config(P(128, "fp16", local=True, varlen=True, seqused_k=True), two, arch))
    out.append(ordered_config(P(64, causal=True, varlen=True), two, arch))
    out.append(ordered_config(P(64, softcap=30.0), two, arch))
    # The experiment of the config docstring: 80-row steps (the swapped dQ wgmma) at d128.
    out.append(replace(out[1], tile_m=80, dq_stages=1, ds_from_p16=True))
    one_buffer = replace(out[2], dq_stages=1)  # one dQ buffer, deterministic
    out.append(one_buffer)
    # The rotated order at d128 (lane slots); the deterministic writer without the peeked slot
    # (PUBLISH_PEEK off: the rule of v0.13), with the publish lag and without it: causal d128 and d64,
    # the rotated order, one dQ buffer.
    lagged = lambda c, lag=True: replace(c, publish_peek=False, publish_lag=lag)  # noqa: E731
    causal64 = ordered_config(P(64, causal=True, varlen=True), None, arch, True)
    rot = ordered_config(replace(P(128), seqlen_q=8192, seqlen_k=8192), None, arch, True)
    out += [rot, lagged(out[2]), lagged(out[2], False), lagged(causal64), lagged(causal64, False), lagged(rot),
            lagged(one_buffer)]
    # Deterministic with the writer warp where the table adds dQ directly (det_direct off), and
    # with the ordered direct adds under a local mask, varlen and seqused_k.
    out.append(ordered_config(P(256, causal=True), None, arch, True, det_direct=False))
    out.append(ordered_config(P(256, "fp16", local=True, varlen=True, seqused_k=True), None, arch, True))
    # The writer's slots from 32 lanes (Note [Writer slots]) outside the rotated order: the writer
    # warp under a causal mask and the sequencing warp of the ordered direct adds.
    out.append(replace(out[2], lane_slots=True))
    out.append(replace(ordered_config(P(256, causal=True), None, arch, True), lane_slots=True))
    # The dQ pass (Note [dQ pass] in fa4/bwd/dq_sm90.py): dK / dV only, the defaults (from d160 without
    # a mask, and deterministic with any mask), and with a deterministic order's flags left on.
    out.append(make_config(P(256), None, arch))
    out.append(make_config(P(192, causal=True, varlen=True, seqused_k=True), None, arch, True))
    out.append(make_config(P(160, softcap=30.0), None, arch, True))
    out.append(replace(ordered_config(P(192, causal=True, varlen=True, seqused_k=True), None, arch, True),
                       dq_pass=True))
    # ... and with the writer warp's head dims (the writer, its sdQ tile and the first store dropped).
    out.append(replace(ordered_config(P(128), None, arch), dq_pass=True))
    out.append(replace(ordered_config(P(64, causal=True), None, arch, True), dq_pass=True, dq_first_store=False))
    # The sequencing warp of the ordered direct adds: the causal d256 default (peeked slot,
    # SEQ_PEEK); with the peeked slot in the rotated order (d256, an option), and without it in the
    # plain orders (SEQ_PEEK off: causal d256, local varlen d192 with seqused_k).
    out.append(ordered_config(P(256, causal=True), None, arch, True))
    out.append(replace(ordered_config(replace(P(256), seqlen_q=8192, seqlen_k=8192), None, arch, True),
                       publish_peek=True))
    out.append(replace(ordered_config(P(256, causal=True), None, arch, True), publish_peek=False))
    out.append(replace(ordered_config(P(192, "fp16", local=True, varlen=True, seqused_k=True), None, arch, True),
                       publish_peek=False))
    # The row statistics read before the wgmmas are issued (stats_early, an experiment).
    out.append(replace(out[1], stats_early=2))
    out.append(replace(out[0], stats_early=1))  # lse ahead with the d64 default's 128-row steps (rows_late)
    out.append(replace(ordered_config(P(256, causal=True), None, arch, True), stats_early=1))
    # The up order (Note [Up order]; the causal default without GQA, whose config is the GQA
    # problems' of these cases with det_up): the writer warp (causal, and local varlen with seqused_k,
    # an option there) and the sequencing warp of the ordered direct adds.
    out.append(replace(out[2], det_up=True))
    out.append(replace(ordered_config(P(128, local=True, varlen=True, seqused_k=True), None, arch, True), det_up=True))
    out.append(replace(ordered_config(P(256, causal=True), None, arch, True), det_up=True))
    # The down tail of the up order (Note [Down tail]): the writer warp (d128 causal, local varlen)
    # and the sequencing warp of the ordered direct adds (d256 causal).
    out.append(replace(out[2], det_up=True, det_tail=2))
    out.append(replace(ordered_config(P(128, local=True, varlen=True, seqused_k=True), None, arch, True), det_up=True,
                       det_tail=2))
    out.append(replace(ordered_config(P(256, causal=True), None, arch, True), det_up=True, det_tail=2))
    # Rotation rounds (Note [Rotation rounds]): the ordered direct adds (d256) and the writer (d128).
    out.append(replace(ordered_config(replace(P(256), seqlen_q=8192, seqlen_k=8192), None, arch, True), det_rounds=2))
    out.append(replace(rot, det_rounds=2))
    # d64's 128-row steps with dS from the 16-bit P and the dV wgmma right after P^T (ds_from_p16,
    # the d64 default until v0.13), plain and causal deterministic; dv_late at d128's 64-row steps.
    out.append(replace(out[0], ds_from_p16=True, dv_late=False))
    out.append(replace(ordered_config(P(64, causal=True), None, arch, True), ds_from_p16=True, dv_late=False))
    out.append(replace(out[2], dv_late=True))
    # No per-step division by the GQA group (step_cursor, an experiment): causal (the consumers'
    # masked steps by index), deterministic causal, the up order, local, and the direct adds.
    out.append(replace(out[1], step_cursor=True))
    out.append(replace(out[2], step_cursor=True))
    out.append(replace(out[2], step_cursor=True, det_up=True))
    out.append(replace(ordered_config(P(128, local=True, varlen=True, seqused_k=True), None, arch), step_cursor=True))
    out.append(replace(ordered_config(P(256, causal=True), None, arch, True), step_cursor=True))
    # The first store without determinism (claims, Note [First store]; an option): plain d128 and
    # causal varlen d64; deterministic with every tile added into a zeroed dq_accum (the rule before v0.18).
    out.append(replace(out[1], dq_first_store=True))
    out.append(replace(ordered_config(P(64, causal=True, varlen=True), None, arch), dq_first_store=True))
    # ... in the rotated order (CLAIM_ROTATE, an option; no mask): d128 with lane slots, d64 without.
    out.append(replace(out[1], dq_first_store=True, det_rotate=True, lane_slots=True))
    out.append(replace(out[0], dq_first_store=True, det_rotate=True))
    out.append(replace(out[2], dq_first_store=False))
    # exp2 emulation (BWD_EXP2_EMU_FRAC): the d64 causal default (128-row steps, lse read per column),
    # d32's default without a mask, and the option with 64-row steps (lse in registers) under softcap
    # and a local varlen mask.
    out.append(ordered_config(P(64, causal=True), None, arch))
    out.append(ordered_config(P(32, varlen=True), None, arch))  # d32's default, 64-row steps
    out.append(ordered_config(P(128, softcap=30.0), KernelOptions(bwd_exp2_emu_frac=0.25), arch))
    out.append(ordered_config(P(96, "fp16", local=True, varlen=True, seqused_k=True),
                              KernelOptions(bwd_exp2_emu_frac=0.5), arch, True))
    # The representative problem (8 q heads of 2 kv heads, 1024 tokens) would split its group: the
    # cases above keep one CTA per kv head, as most problems do; the split (Note [Split GQA group])
    # gets its own: causal, varlen with seqused_k at d64's 128-row steps, and under the dQ pass.
    # (Pinned, not from kv_split_for: the compiled set must not depend on the machine's SM count.)
    out = [replace(c, kv_split=1) for c in out]
    out.append(replace(make_config(P(128, causal=True), None, arch), kv_split=4))
    out.append(replace(make_config(P(64, varlen=True, seqused_k=True), None, arch), kv_split=4))
    out.append(replace(make_config(P(256, causal=True), None, arch, True), kv_split=4))  # the dQ pass (forced)
    # The compact varlen grid (Note [Compact varlen grid] in fa4/sched/tile.py): d64 causal (128-row
    # steps), d128 without a mask with seqused_k and a split group, d256 causal under the dQ pass.
    out.append(replace(make_config(P(64, causal=True, varlen=True), None, arch), kv_split=1, compact_grid=True))
    out.append(replace(make_config(P(128, varlen=True, seqused_k=True), None, arch), kv_split=2, compact_grid=True))
    out.append(replace(make_config(P(256, causal=True, varlen=True), None, arch), kv_split=1, compact_grid=True))
    # Every case above is compiled with plain launches (the defaults past PDL_MAX_SEQLEN_K keys).
    out = [replace(c, pdl=False) for c in out]
    # Programmatic dependent launch (Note [Programmatic dependent launch]): the cases above at 1024
    # keys with it (the writer warp, deterministic causal, the direct adds and their ordering warp),
    # two CTAs, and the dQ pass (the d256 default).
    out += short
    out.append(replace(ordered_config(P(128), two, arch), kv_split=1, pdl=True))
    out.append(replace(make_config(P(256), None, arch), kv_split=1, pdl=True))
    out.append(replace(short[1], pdl_post=False))  # (the main kernel alone a dependent: d128, the writer warp)
    return list(dict.fromkeys(out))
