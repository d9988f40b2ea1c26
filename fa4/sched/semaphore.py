"""Deterministic accumulation: per-slot int32 counters in global memory (device), and the order.

A kernel that accumulates partial results of several CTAs into one global buffer (the backward's
dQ: every K block adds ``dS @ K`` into the rows of the Q blocks it sees) is deterministic when the
additions into each slot happen in a fixed order. The slot's counter says how many contributors
have finished: contributor number ``r`` (its *rank*) waits until the counter equals ``r``, adds, and
bumps the counter to ``r + 1``.

Device API (call from every thread of the CTA; ``tidx`` is the thread's index):

* :func:`wait` -- thread 0 spins on ``ld.acquire.gpu`` until ``*sem == expected``, then a CTA
  barrier releases the others. Everything the previous contributors wrote before their
  :func:`signal` is visible to every thread of this CTA afterwards.
* :func:`signal` -- a CTA barrier (every thread's writes are issued), then thread 0 makes them
  visible GPU-wide (``fence.acq_rel.gpu``) and adds 1 with ``red.release.gpu``.

Note [No deadlock]
    A CTA only ever waits for contributors launched before it. CTAs are dispatched in increasing
    linear block index, so when a CTA runs, every CTA launched before it is running or finished.
    By induction on the launch index, the earliest unfinished CTA waits for no one unfinished: it
    progresses, so all do. Ranks must therefore follow launch order: in every slot, the
    contributor launched first has rank 0. :func:`check_schedule` checks a schedule for exactly
    this (pure Python, used by the CPU tests).

Counters must be zero before the first contributor arrives (the backward preprocess zeroes them).
"""

from __future__ import annotations

from typing import Callable, Hashable, Iterable, Sequence

import cutlass.cute as cute
from cutlass import Int32


@cute.jit
def wait(sem_ptr: cute.Pointer, expected: Int32, tidx: Int32) -> None:
    """Block the CTA until ``*sem_ptr == expected`` (acquire: later reads see the writes that
    preceded the matching :func:`signal`)."""
    if tidx == 0:
        seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
        while seen != expected:
            seen = cute.arch.load(sem_ptr, Int32, sem="acquire", scope="gpu")
    cute.arch.barrier()


@cute.jit
def signal(sem_ptr: cute.Pointer, tidx: Int32) -> None:
    """Publish this CTA's writes and add 1 to ``*sem_ptr`` (release)."""
    cute.arch.barrier()
    if tidx == 0:
        cute.arch.fence_acq_rel_gpu()
        cute.arch.red(sem_ptr, Int32(1), op="add", dtype=Int32, sem="release", scope="gpu")


# --------------------------------------------------------------------------------------------
# Schedule model (host, pure Python)
# --------------------------------------------------------------------------------------------


def check_schedule(
    visits: Sequence[Iterable[Hashable]],
    rank: Callable[[int, Hashable], int],
) -> None:
    """Check a deterministic schedule for deadlock freedom and consistency.

    ``visits[c]`` lists the slots CTA ``c`` contributes to, in the order it visits them, CTAs
    numbered in launch order. ``rank(c, slot)`` is the count the CTA waits for in that slot.
    Raises AssertionError unless, for every slot, the ranks of its contributors are exactly
    0, 1, 2, ... in launch order (so every wait targets an earlier-launched CTA, the counter reaches
    every awaited value, and the final count equals the number of contributors), and no CTA
    visits a slot twice. Then simulates the harshest residency, one CTA at a time in launch order,
    and asserts that every wait is already met when reached (then any in-order dispatch completes).
    """
    contributors: dict[Hashable, list[int]] = {}
    for c, slots in enumerate(visits):
        seen = set()
        for s in slots:
            assert s not in seen, f"CTA {c} visits slot {s!r} twice"
            seen.add(s)
            contributors.setdefault(s, []).append(c)
    for s, ctas in contributors.items():
        got = [rank(c, s) for c in ctas]
        assert got == list(range(len(ctas))), (
            f"slot {s!r}: contributors {ctas} (launch order) have ranks {got}, expected 0..{len(ctas) - 1}"
        )
    # Sequential simulation: one CTA at a time, in launch order; every wait must already be met.
    count: dict[Hashable, int] = {}
    for c, slots in enumerate(visits):
        for s in slots:
            r = rank(c, s)
            assert count.get(s, 0) == r, (
                f"CTA {c} would wait forever on slot {s!r} (count {count.get(s, 0)}, needs {r})"
            )
            count[s] = r + 1
