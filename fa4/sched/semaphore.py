"""Deterministic accumulation: per-slot int32 counters in global memory (device), and the order.

A kernel that accumulates partial results of several CTAs into one global buffer (the backward's
dQ: every K block adds ``dS @ K`` into the rows of the Q blocks it sees) is deterministic when the
additions into each slot happen in a fixed order. The slot's counter says how many contributors
have finished: contributor number ``r`` (its *rank*) waits until the counter equals ``r``, adds, and
bumps the counter to ``r + 1``.

Device API. The plain pair, called by every thread of the CTA (``tidx`` is the thread's index):

* :func:`wait` -- thread 0 spins on ``ld.acquire.gpu`` until ``*sem == expected``, then a CTA
  barrier releases the others. Everything the previous contributors wrote before their
  :func:`signal` is visible to every thread of this CTA afterwards.
* :func:`signal` -- a CTA barrier (every thread's writes are issued), then thread 0 publishes them
  and adds 1 (:func:`publish`: ``fence.acq_rel.gpu`` + ``red.relaxed.gpu``, one ``MEMBAR.GPU``;
  a ``red.release`` after the fence would add a second one).

The split-phase pieces, for a loop that adds into one slot per step (Note [Split-phase]); they are
called by one thread, the caller places the CTA barriers:

* :func:`peek` -- ``ld.relaxed.gpu`` of a counter, issued early; the value is not waited for.
* :func:`publish` -- ``fence.acq_rel.gpu``, then ``red.relaxed.gpu`` +1 on ``prev`` when asked.
  The fence is at once the release of the CTA's adds into ``prev`` (everything before the CTA
  barrier that precedes the call) and the acquire of the counter values read by earlier
  :func:`peek` calls of this thread.
* :func:`spin` -- ``ld.acquire.gpu`` until the counter equals ``expected`` (the slow path).

Note [Split-phase]
    The plain :func:`wait` / :func:`signal` put two global round trips on every step's critical
    path, with all warps idle at a barrier: the acquiring load, and the ``MEMBAR.GPU`` that waits
    for the adds to be acknowledged before the counter is bumped. A loop that adds into one slot
    per step hides both. At the top of step ``t``, right after the CTA barrier that already
    separates the steps (so every thread's adds of step ``t - 1`` are issued), one thread calls
    ``peek(slot t)`` and then ``publish(slot t - 1)``: one fence serves as the release of step
    ``t - 1`` (fence, then a strong write: a release pattern) and as the acquire of the peeked
    value (a strong read, then a fence: an acquire pattern). Only that thread's warp waits for the
    round trip, while the others start the step's MMAs. If the peeked value already equals the
    expected one (the usual case when the previous contributor is far ahead), the thread tells the
    CTA through shared memory, and the next CTA barrier makes the acquire cover every thread: the
    step adds without any further wait. Otherwise the CTA falls back to :func:`spin` + barrier
    just before adding. After the last step the CTA publishes its last slot (barrier first).

    The deferred publish never waits for anything, so each CTA still runs, per slot,
    wait -> add -> publish before it waits on the next slot: the order the schedule model below
    simulates, and all Note [No deadlock] needs.

Note [No deadlock]
    A CTA only ever waits for contributors launched before it. CTAs are dispatched in increasing
    linear block index, so when a CTA runs, every CTA launched before it is running or finished.
    By induction on the launch index, the earliest unfinished CTA waits for no one unfinished (it
    never waits between an add and the publish of that add): it progresses, so all do, whatever
    the number of CTAs resident at once. Ranks must therefore follow launch order: in every slot,
    the contributor launched first has rank 0. :func:`check_schedule` checks a schedule for exactly
    this and :func:`simulate` runs it with few CTAs resident (pure Python, used by the CPU tests).

Counters must be zero before the first contributor arrives (the backward preprocess zeroes them).
"""

from __future__ import annotations

import random
from typing import Callable, Hashable, Iterable, Optional, Sequence, Union

import cutlass.cute as cute
from cutlass import Boolean, Int32


@cute.jit
def wait(sem_ptr: cute.Pointer, expected: Int32, tidx: Int32) -> None:
    """Block the CTA until ``*sem_ptr == expected`` (acquire: later reads see the writes that
    preceded the matching :func:`signal`)."""
    if tidx == 0:
        spin(sem_ptr, expected)
    cute.arch.barrier()


@cute.jit
def signal(sem_ptr: cute.Pointer, tidx: Int32) -> None:
    """Publish this CTA's writes and add 1 to ``*sem_ptr`` (release)."""
    cute.arch.barrier()
    if tidx == 0:
        publish(sem_ptr, True)


@cute.jit
def spin(sem_ptr: cute.Pointer, expected: Int32) -> None:
    """One thread: ``ld.acquire.gpu`` until ``*sem_ptr == expected``."""
    seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
    while seen != expected:
        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")


@cute.jit
def peek(sem_ptr: cute.Pointer) -> Int32:
    """One thread: a strong relaxed read of the counter (no wait until the value is used). It
    acquires only once followed by :func:`publish`'s fence."""
    return cute.arch.load(sem_ptr, Int32, sem="relaxed", scope="gpu")


@cute.jit
def publish(prev_ptr: cute.Pointer, bump: Boolean) -> None:
    """One thread, after a CTA barrier that follows the CTA's adds into ``prev_ptr``'s slot:
    ``fence.acq_rel.gpu``, then (when ``bump``) ``red.relaxed.gpu`` +1 on ``*prev_ptr``."""
    cute.arch.fence_acq_rel_gpu()
    if bump:
        cute.arch.red(prev_ptr, Int32(1), op="add", dtype=Int32, sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------------------
# Schedule model (host, pure Python)
# --------------------------------------------------------------------------------------------


def check_schedule(
    visits: Sequence[Iterable[Hashable]],
    rank: Callable[[int, Hashable], int],
    resident: Sequence[int] = (1,),
    launch_ordered: bool = True,
) -> None:
    """Check a deterministic schedule for deadlock freedom and consistency.

    ``visits[c]`` lists the slots CTA ``c`` contributes to, in the order it visits them, CTAs
    numbered in launch order. ``rank(c, slot)`` is the count the CTA waits for in that slot.
    Raises AssertionError unless, for every slot, the ranks of its contributors are exactly
    0, 1, 2, ... in launch order (so every wait targets an earlier-launched CTA, the counter reaches
    every awaited value, and the final count equals the number of contributors), and no CTA
    visits a slot twice. Then :func:`simulate` runs the schedule with each number of ``resident``
    CTAs (1: one CTA at a time in launch order, where every wait must already be met on arrival).
    Without ``launch_ordered`` (the rotated order of fa4/bwd/common.py) a slot's ranks need only be
    a permutation of 0, 1, 2, ... and the schedule needs enough residency (``resident``).
    """
    visits = [list(v) for v in visits]
    contributors: dict[Hashable, list[int]] = {}
    for c, slots in enumerate(visits):
        seen = set()
        for s in slots:
            assert s not in seen, f"CTA {c} visits slot {s!r} twice"
            seen.add(s)
            contributors.setdefault(s, []).append(c)
    for s, ctas in contributors.items():
        got = [rank(c, s) for c in ctas]
        assert (got if launch_ordered else sorted(got)) == list(range(len(ctas))), (
            f"slot {s!r}: contributors {ctas} (launch order) have ranks {got}, expected 0..{len(ctas) - 1}"
        )
    for k in resident:
        simulate(visits, rank, k)


def simulate(
    visits: Sequence[Sequence[Hashable]],
    rank: Callable[[int, Hashable], int],
    resident: int,
    seed: Optional[int] = None,
    publish_lag: Union[bool, Callable[[int], bool]] = False,
) -> dict[Hashable, int]:
    """Run a schedule with at most ``resident`` CTAs on the machine at once.

    CTAs become resident in launch order as others finish (in-order dispatch). Each resident CTA
    runs its slots in order; in a slot it waits until the counter equals its rank, then adds and
    publishes (count + 1) -- no wait separates an add from its publish (Note [Split-phase]). With
    ``publish_lag`` (the sm90 writer's Note [Publish lag]; a callable: per CTA) a CTA publishes a
    slot only once its wait for the next slot is over (the last one when it finishes). A round
    advances every resident CTA by at most one slot (lockstep, in residency order; with ``seed``, in a shuffled
    order each round). Raises AssertionError when a round advances no CTA before all are done (a
    deadlock under this residency), or when a slot receives its adds out of rank order. Returns
    the final count of every slot.
    """
    rng = random.Random(seed) if seed is not None else None
    n = len(visits)
    count: dict[Hashable, int] = {}
    pos = [0] * n
    pending: list[Optional[Hashable]] = [None] * n  # added, not yet published (publish_lag)

    def publish_pending(c):
        if pending[c] is not None:
            count[pending[c]] = count.get(pending[c], 0) + 1
    running: list[int] = []
    launched = finished = 0
    while finished < n:
        while len(running) < resident and launched < n:
            running.append(launched)
            launched += 1
        order = list(running)
        if rng is not None:
            rng.shuffle(order)
        progressed = False
        for c in order:
            if pos[c] < len(visits[c]):
                s = visits[c][pos[c]]
                r = rank(c, s)
                have = count.get(s, 0)
                assert have <= r, f"slot {s!r}: CTA {c} (rank {r}) arrives after count {have}: added out of order"
                if have == r:
                    if publish_lag(c) if callable(publish_lag) else publish_lag:
                        publish_pending(c)
                        pending[c] = s
                    else:
                        count[s] = r + 1
                    pos[c] += 1
                    progressed = True
            if pos[c] == len(visits[c]):
                publish_pending(c)
                running.remove(c)
                finished += 1
                progressed = True
        if not progressed:
            waits = [(visits[c][pos[c]], count.get(visits[c][pos[c]], 0), rank(c, visits[c][pos[c]])) for c in running]
            raise AssertionError(f"deadlock with {resident} resident CTAs {running}: (slot, count, needs) {waits}")
    return count
