"""A timing model of the deterministic backward's dQ order (CPU, pure Python): how long a grid takes
when every step's dQ add waits for the slot's earlier contributors, against the same grid without
the waits.

    python tools/det_model.py                      # the d128 s8k rows, default latencies
    python tools/det_model.py --publish 0.6 --visible 0.3

Discrete events, one CTA per SM, dispatched in launch order as SMs free up. A CTA's consumers
compute its steps one after the other (``1.0`` each, the unit of time); its writer takes a step
once the consumers have finished it and the slot's counter has reached the CTA's rank, holds the
dQ buffer ``--read`` and publishes ``--publish`` after it starts; the count becomes visible to
the other CTAs ``--visible`` later. The consumers run at most ``--stages`` steps ahead of the
writer's reads (the dQ buffers). The writer publishes each step before it takes the next;
with ``--lag`` (the kernel's ``publish_lag``, Note [Publish lag] in fa4/bwd/sm90.py) it publishes
a step only after it has taken the next one (or at the end), and then, once the step's adds are
complete, issues the next one's; it is free again once that step's read is done. The schedules are those of :func:`fa4.bwd.common.deterministic_schedule` (the
kernel's), the up order (``det_up``, Note [Up order]: flash-attn-4's causal order) and its down tail
(``det_tail``, Note [Down tail]) included.

A model, not a measurement: it tells orders apart by their waits, nothing more. It has no memory
system: it rates the down order above the up order (0.94-0.999 against 0.91-0.95 of the LPT grid at
d128 s4k-s16k causal), while on the H200 the up order with L2-bounded sections won by 1-8%
(docs/RESULTS.md v0.19); it does get the up order's shortest-first tail right (about 6%, 23% with
four q heads per kv head, where the H200 lost 30%).
"""

from __future__ import annotations

import argparse
import heapq
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fa4.bwd import common  # noqa: E402


def run(visits, rank, resident: int, read: float, publish: float, visible: float, stages: int,
        ordered: bool = True, jitter: float = 0.0, seed: int = 0, lag: bool = False) -> float:
    """The grid's makespan (``ordered``: with the slot waits). ``jitter``: each step takes
    ``1 + jitter * e`` with ``e`` exponential of mean 1 minus 1 (mean 1.0, a long tail), drawn per
    (CTA, step) from ``seed``, so the ordered and free runs see the same step times. ``lag``: the
    publish lag (module docstring)."""
    n = len(visits)
    rng = random.Random(seed)
    durations = [[1.0 + jitter * (rng.expovariate(1.0) - 1.0) if jitter else 1.0 for _ in v] for v in visits]
    events: list = []
    seq = 0

    def push(time, kind, c, arg=None):
        nonlocal seq
        heapq.heappush(events, (time, seq, kind, c, arg))
        seq += 1

    count: dict = {}
    waiters: dict = {}
    cons_next, cons_busy, cons_done = [0] * n, [False] * n, [0] * n
    wr_next, wr_busy, reads = [0] * n, [False] * n, [0] * n
    held = [None] * n  # lag: (slot, time its adds complete) of the step whose publish is held back
    launched, finished, end = 0, 0, 0.0

    def try_consumer(c, now):
        t = cons_next[c]
        if not cons_busy[c] and t < len(visits[c]) and reads[c] >= t - stages + 1:
            cons_busy[c] = True
            cons_next[c] += 1
            push(now + max(durations[c][t], 0.05), "cdone", c)

    def try_writer(c, now):
        t = wr_next[c]
        if wr_busy[c] or t >= len(visits[c]) or cons_done[c] <= t:
            return
        slot = visits[c][t]
        if ordered and count.get(slot, 0) != rank(c, slot):
            waiters.setdefault(slot, set()).add(c)
            return
        wr_busy[c] = True
        wr_next[c] += 1
        if not lag:
            push(now + read, "wread", c)
            push(now + publish, "wpub", c, slot)
            return
        start = now
        if held[c] is not None:  # the previous step's publish, held back until this slot was taken;
            start = max(now, held[c][1])  # the writer waits for those adds before it issues this step's
            push(start + visible, "visible", c, held[c][0])
        push(start + read, "wread", c)
        held[c] = (slot, start + publish)

    def launch(now):
        nonlocal launched, finished
        while launched < n:
            c = launched
            launched += 1
            if visits[c]:
                try_consumer(c, now)
                return
            finished += 1  # an empty CTA leaves at once

    for _ in range(resident):
        launch(0.0)
    while events:
        now, _, kind, c, arg = heapq.heappop(events)
        if kind == "cdone":
            cons_busy[c] = False
            cons_done[c] += 1
            try_consumer(c, now)
            try_writer(c, now)
        elif kind == "wread":
            reads[c] += 1
            try_consumer(c, now)
            if lag:
                wr_busy[c] = False
                if wr_next[c] == len(visits[c]):  # the last step publishes at once
                    slot, done = held[c]
                    held[c] = None
                    push(max(now, done), "wpub", c, slot)
                else:
                    try_writer(c, now)
        elif kind == "wpub":
            wr_busy[c] = False
            push(now + visible, "visible", c, arg)
            if wr_next[c] == len(visits[c]):
                finished += 1
                end = max(end, now)
                launch(now)
            else:
                try_writer(c, now)
        else:  # visible
            count[arg] = count.get(arg, 0) + 1
            for w in sorted(waiters.pop(arg, ())):
                try_writer(w, now)
    assert finished == n, f"stuck: {finished} of {n} CTAs finished"
    return end


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--read", type=float, default=0.3, help="the writer's smem read of a step's dQ (steps)")
    ap.add_argument("--publish", type=float, default=0.6, help="from the writer's start to its publish (steps)")
    ap.add_argument("--visible", type=float, default=0.3, help="publish -> count seen by a waiter (steps)")
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--seqlen", type=int, default=8192)
    ap.add_argument("--pairs", type=int, default=32, help="(batch, kv head) pairs (b2 h16 at s8k)")
    ap.add_argument("--jitter", type=float, default=0.0, help="step-time spread (Run's jitter); 0: every step 1.0")
    ap.add_argument("--lag", action="store_true", help="the writer's publish lag (run's lag)")
    ap.add_argument("--causal-lag", action="store_true",
                    help="only the causal rows, each with and without the publish lag")
    args = ap.parse_args()
    s, pairs, tm, tn = args.seqlen, args.pairs, 64, 128
    lat = (args.read, args.publish, args.visible, args.stages)
    if args.causal_lag:
        print(f"latencies (steps): read {args.read}, publish {args.publish}, visible {args.visible}; "
              f"{args.stages} dQ buffers; {args.sms} SMs; s{s}, {pairs} pairs, jitter {args.jitter}")
        print(f"{'causal, LPT down':24s} {'free':>9s} {'no lag':>9s} {'lag':>9s} {'ratio no lag':>13s} {'ratio lag':>10s}")
        for section in (64, 16, 8):
            visits, rank = common.deterministic_schedule([s], [s], pairs, 1, tm, tn, causal=True, section=section)[:2]
            free = run(visits, rank, args.sms, *lat, ordered=False, jitter=args.jitter)
            t = [run(visits, rank, args.sms, *lat, jitter=args.jitter, lag=lag) for lag in (False, True)]
            print(f"{'sections of ' + str(section):24s} {free:9.1f} {t[0]:9.1f} {t[1]:9.1f} {free / t[0]:13.3f} "
                  f"{free / t[1]:10.3f}")
        return
    def kernel(**kw):
        if kw.get("tail"):  # 16 kv heads per batch: the tail is per batch
            nb = max(1, pairs // 16)
            return common.deterministic_schedule([s] * nb, [s] * nb, pairs // nb, 1, tm, tn, **kw)[:2]
        return common.deterministic_schedule([s], [s], pairs, 1, tm, tn, **kw)[:2]
    rows = {
        "no mask, plain order, sections of 32": kernel(section=32),
        "no mask, plain order, sections of 1": kernel(section=1),
        "no mask, rotated (the default)": kernel(rotated=True),
        "causal, LPT down, sections of 64 (GQA's table)": kernel(causal=True, section=64),
        "causal, LPT down, sections of 16": kernel(causal=True, section=16),
        "causal, LPT down, sections of 8": kernel(causal=True, section=8),
        "causal, SPT up (det_up), sections of 16": kernel(causal=True, section=16, up=True),
        "causal, SPT up (det_up), sections of 8": kernel(causal=True, section=8, up=True),
        "causal, SPT up (det_up), sections of 1": kernel(causal=True, section=1, up=True),
        # Note [Down tail]: the last kv heads (of 16 per batch) walk down and launch last.
        "causal, up + down tail of 2 (default), sections 4": kernel(causal=True, section=4, up=True, tail=2),
    }
    print(f"latencies (steps): read {args.read}, publish {args.publish}, visible {args.visible}; "
          f"{args.stages} dQ buffers; {args.sms} SMs; s{s}, {pairs} pairs")
    print(f"{'order':50s} {'free':>9s} {'ordered':>9s} {'ratio':>6s}")
    for name, (visits, rank) in rows.items():
        free = run(visits, rank, args.sms, *lat, ordered=False, jitter=args.jitter)
        det = run(visits, rank, args.sms, *lat, ordered=True, jitter=args.jitter, lag=args.lag)
        print(f"{name:50s} {free:9.1f} {det:9.1f} {free / det:6.3f}")


if __name__ == "__main__":
    main()
