"""Backward config sweep on the GPU: time fa4's backward (one family) with config overrides.

    python tools/sweep_bwd.py [--family sm90] "d128 s8192" "d128 s8192 causal tile_m=128" ...
    python tools/sweep_bwd.py --plan v1        # a named list of experiments (PLANS)

An experiment: ``d<head_dim> s<seqlen> [g<group>] [causal] [det] [section=N] [const.NAME=value] [field=value ...]`` on
FlashAttention's grid shape (batch * seqlen = 16k tokens, heads * head_dim = 2048, bf16; ``g4``: GQA,
four q heads per kv head); the fields override the
family's ``make_config`` (``dataclasses.replace``), ``dq.<field>=value`` those of the dQ pass's
config (:func:`fa4.bwd.dq_sm90.config_for`), ``section`` the launch order's pairs per
section. Every config is compiled first, in parallel; then each experiment prints TFLOP/s (2.5x the
forward's FLOPs), ms and the max difference of the gradients from a first run of the defaults.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import importlib
import sys
from concurrent.futures import ProcessPoolExecutor

import torch

import fa4
from fa4 import jit, ops, validate
from fa4.bwd import common, postprocess, preprocess


PLANS = {
    # First sm90 sweep: the defaults, 128-row steps at d64, one P/dS stage at d256 (fits 2 with one Q
    # stage), the causal launch sections, the deterministic mode.
    "v1": [
        "d128 s8192", "d128 s8192 causal", "d64 s8192", "d64 s8192 causal", "d256 s8192", "d256 s8192 causal",
        "d128 s1024", "d128 s1024 causal",
        "d64 s8192 tile_m=128", "d64 s8192 causal tile_m=128",
        "d256 s8192 pds_stages=2", "d256 s8192 causal pds_stages=2",
        "d128 s8192 causal section=1", "d128 s8192 causal section=4", "d128 s8192 causal section=64",
        "d128 s8192 det", "d128 s8192 causal det", "d128 s1024 causal det",
    ],
    # v0.6: two dQ buffers (dq_stages=2, the new default at head dims <= 128) against one, with and
    # without determinism; stmatrix dS stores in both.
    "v2": [
        "d128 s8192", "d128 s8192 dq_stages=1", "d128 s8192 causal", "d128 s8192 causal dq_stages=1",
        "d128 s8192 det", "d128 s8192 det dq_stages=1", "d128 s8192 causal det", "d128 s8192 causal det dq_stages=1",
        "d128 s1024 causal", "d128 s1024 causal det", "d128 s1024 causal det dq_stages=1",
        "d64 s8192 causal", "d64 s8192 causal det", "d64 s8192 causal det dq_stages=1",
        "d256 s8192", "d256 s8192 det",
    ],
    # v0.6, second run: the deterministic writer's publish lag (default on) against none; 128-row
    # steps at d64 again (the spills are gone); launch sections of the causal deterministic mode.
    "v3": [
        "d128 s8192", "d128 s8192 det", "d128 s8192 det publish_lag=False",
        "d128 s8192 causal", "d128 s8192 causal det", "d128 s8192 causal det publish_lag=False",
        "d128 s8192 causal det dq_stages=1", "d128 s8192 causal det section=16", "d128 s8192 causal det section=256",
        "d128 s1024 causal", "d128 s1024 causal det", "d128 s1024 causal det publish_lag=False",
        "d64 s8192", "d64 s8192 tile_m=128", "d64 s8192 causal", "d64 s8192 causal tile_m=128",
        "d64 s8192 causal det", "d64 s8192 causal det publish_lag=False",
        "d256 s8192", "d256 s8192 det", "d256 s8192 det publish_lag=False",
    ],
    # v0.6, third run: the publish lag reordered (spin for step t, then publish step t - 1).
    "v4": [
        "d128 s8192", "d128 s8192 det", "d128 s8192 det publish_lag=False",
        "d128 s8192 causal", "d128 s8192 causal det", "d128 s8192 causal det publish_lag=False",
        "d128 s1024 causal", "d128 s1024 causal det", "d128 s1024 causal det publish_lag=False",
        "d64 s8192 causal", "d64 s8192 causal det", "d64 s8192 causal det publish_lag=False",
        "d256 s8192", "d256 s8192 det", "d256 s8192 det publish_lag=False",
        "d256 s8192 causal", "d256 s8192 causal det", "d256 s8192 causal det publish_lag=False",
    ],
    # v0.6, fourth run: launch sections of the deterministic mode (and of the non-deterministic one
    # at the deterministic default), 128-row steps at d64 with the row statistics read late.
    "v5": [
        "d128 s8192", "d128 s8192 section=4", "d128 s8192 section=32",
        "d128 s8192 det section=1", "d128 s8192 det section=2", "d128 s8192 det section=4",
        "d128 s8192 det section=8", "d128 s8192 det section=16", "d128 s8192 det", "d128 s8192 det section=64",
        "d64 s8192", "d64 s8192 det", "d64 s8192 det section=8",
        "d64 s8192 causal", "d64 s8192 causal det", "d64 s8192 causal det section=16",
        "d64 s8192 causal det section=128",
        "d64 s8192 tile_m=128", "d64 s8192 causal tile_m=128",
    ],
    # v0.6, fifth run: the rotated deterministic order (default where safe) against the plain one.
    "v6": [
        "d128 s8192", "d128 s8192 det", "d128 s8192 det det_rotate=False",
        "d128 s1024", "d128 s1024 det", "d128 s1024 det det_rotate=False",
        "d128 s4096", "d128 s4096 det", "d128 s4096 det det_rotate=False",
        "d128 s16384", "d128 s16384 det", "d128 s16384 det det_rotate=False",
        "d64 s8192", "d64 s8192 det", "d64 s8192 det det_rotate=False",
        "d256 s8192", "d256 s8192 det", "d256 s8192 det det_rotate=False",
    ],
    # v0.6, sixth run: the rotated order and the publish lag, crossed.
    "v7": [
        f"d{d} s{s}{x}" for d, s in ((64, 8192), (128, 4096), (128, 8192))
        for x in ("", " det", " det publish_lag=False", " det det_rotate=False",
                  " det det_rotate=False publish_lag=False")
    ],
    # v0.6, seventh run: dQ added from the consumers' registers (dq_direct), which frees the sdQ
    # tile for a second Q/dO stage at d256 (and a second P/dS stage).
    "v8": [
        "d256 s8192", "d256 s8192 dq_direct=True", "d256 s8192 dq_direct=True q_stages=2",
        "d256 s8192 dq_direct=True q_stages=2 pds_stages=2",
        "d256 s8192 causal", "d256 s8192 causal dq_direct=True q_stages=2",
        "d256 s8192 causal dq_direct=True q_stages=2 pds_stages=2",
        "d192 s8192", "d192 s8192 dq_direct=True pds_stages=2",
        "d128 s8192", "d128 s8192 dq_direct=True", "d128 s8192 causal", "d128 s8192 causal dq_direct=True",
        "d64 s8192", "d64 s8192 dq_direct=True",
    ],
    # Next (not yet run): 128-row steps at d64 with dS from the 16-bit P (ds_from_p16; at 240 registers
    # the only variant whose wgmmas ptxas does not serialize), against the default; check the
    # gradients' accuracy too (maxdiff here is against the default, not the reference).
    "v9": [
        "d64 s8192", "d64 s8192 tile_m=128 ds_from_p16=True", "d64 s8192 ds_from_p16=True",
        "d64 s8192 causal", "d64 s8192 causal tile_m=128 ds_from_p16=True",
        "d128 s8192", "d128 s8192 ds_from_p16=True", "d128 s8192 tile_m=80 dq_stages=1 ds_from_p16=True",
        "d128 s8192 causal", "d128 s8192 causal tile_m=80 dq_stages=1 ds_from_p16=True",
        "d128 s2048", "d128 s2048 tile_m=80 dq_stages=1 ds_from_p16=True",
    ],
    # The two-CTA backward (Note [Two-CTA dQ]) against the one-CTA defaults, with the writer warp (one
    # dQ buffer fits) or the direct adds; the 80-row experiment now that the preprocess serves it.
    "v10": [
        "d128 s8192", "d128 s8192 two_cta=True dq_stages=1", "d128 s8192 two_cta=True dq_direct=True",
        "d128 s8192 causal", "d128 s8192 causal two_cta=True dq_stages=1", "d128 s8192 causal two_cta=True dq_direct=True",
        "d128 s2048", "d128 s2048 two_cta=True dq_stages=1", "d128 s2048 two_cta=True dq_direct=True",
        "d64 s8192", "d64 s8192 two_cta=True dq_stages=1", "d64 s8192 two_cta=True dq_direct=True",
        "d64 s8192 causal", "d64 s8192 causal two_cta=True dq_stages=1",
        "d128 s8192 tile_m=80 dq_stages=1 ds_from_p16=True", "d128 s8192 causal tile_m=80 dq_stages=1 ds_from_p16=True",
    ],
    # Deterministic d64 with the new 128-row default steps (v0.7) against 64-row steps.
    "v11": [
        "d64 s8192 det", "d64 s8192 det tile_m=64 ds_from_p16=False", "d64 s8192 causal det",
        "d64 s8192 causal det tile_m=64 ds_from_p16=False", "d64 s1024 det", "d64 s1024 det tile_m=64 ds_from_p16=False",
        "d64 s1024", "d64 s1024 tile_m=64 ds_from_p16=False", "d64 s16384", "d64 s16384 tile_m=64 ds_from_p16=False",
    ],
    # Deterministic against non-deterministic in one run (v0.4: used to measure, and reject, a
    # writer that frees sdQ once read, before the adds complete and the slot is published).
    "det": [
        "d128 s8192", "d128 s8192 det", "d128 s8192 causal", "d128 s8192 causal det",
        "d128 s1024 causal", "d128 s1024 causal det", "d64 s8192 causal", "d64 s8192 causal det",
        "d256 s8192", "d256 s8192 det",
    ],
    # Session 8: the row statistics read before the wgmmas are issued (stats_early 1: lse, 2: also
    # dpsum), against the default, twice in interleaved rounds.
    "v12": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d128 s8192", "d128 s8192 causal", "d128 s1024", "d128 s16384", "d256 s8192",
                          "d128 s8192 det", "d128 s4096 causal det")
            for v in ("", "stats_early=1", "stats_early=2")],
    # Next: lse ahead of the wgmmas with the d64 default's 128-row steps (rows_late; written in v0.10,
    # not yet timed), against the default, twice in interleaved rounds.
    "v13": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d64 s8192", "d64 s8192 causal", "d64 s1024", "d64 s16384", "d64 s8192 det",
                          "d64 s8192 causal det")
            for v in ("", "stats_early=1")],
    # v0.11 (historical: make_config now picks lane_slots and the d64 rotation itself, so some pairs
    # below are the same config today): the writer's slots from 32 lanes at once (Note [Writer
    # slots]) against one slot per step, deterministic and not, twice in interleaved rounds.
    "v14": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d128 s8192", "d128 s8192 det", "d128 s8192 causal det", "d128 s1024 causal det",
                          "d128 s16384 det", "d64 s8192 det", "d64 s8192 causal det", "d256 s8192 det",
                          "d256 s8192 causal det")
            for v in ("lane_slots=False", "")],
    # v0.11 (historical: d64 now rotates by default): the rotated order at d64 again (v0.6 measured
    # it -7% with 64-row steps; the default steps are 128 rows since v0.7), with and without the lane
    # slots, twice in interleaved rounds.
    "v15": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d64 s8192 det", "d64 s16384 det", "d64 s2048 det")
            for v in ("", "det_rotate=True", "det_rotate=True lane_slots=True")] + ["d64 s8192", "d64 s16384"],
    # Next (written in v0.11, not yet run): the causal deterministic rows (0.82-0.91 of non-det): launch
    # sections of 16 / 32 pairs against the default 64, and lane slots, twice in interleaved rounds.
    "v16": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d128 s8192 causal det", "d128 s4096 causal det", "d64 s8192 causal det")
            for v in ("", "section=16", "section=32", "lane_slots=True")]
    + ["d128 s8192 causal", "d128 s4096 causal", "d64 s8192 causal"],
    # v0.12: the new default sections of 16 pairs (causal deterministic) where v16 did not look: s1k,
    # s16k and d64, against 64 and 4, twice in interleaved rounds.
    "v17": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d128 s1024 causal det", "d128 s16384 causal det", "d64 s8192 causal det")
            for v in ("", "section=64", "section=4")]
    + ["d128 s1024 causal", "d128 s16384 causal"],
    # v0.12, after det_causal_waves: the s1k rows, the widest det / non-det gaps (causal 0.78-0.83,
    # rotated 0.93): the default, then one writer or buffer knob changed; twice, interleaved.
    "v18": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d128 s1024 causal det", ("", "section=64", "publish_lag=False", "lane_slots=True",
                                                          "stats_early=0")),
                              ("d128 s1024 det", ("", "publish_lag=False", "lane_slots=False")),
                              ("d128 s4096 causal det", ("", "section=16")))
            for v in vs]
    + ["d128 s1024 causal", "d128 s1024", "d128 s4096 causal"],
    # Next (written in v0.12, not yet run): dV issued after dS^T (dv_late) at d64 with dS from the
    # float32 P (the CPU SASS: no spills or serialized wgmmas, the step loop 760 -> 633
    # instructions, flash-attn-4's 646), against the default; and at d128. Also step_cursor (no
    # division by the GQA group per step). Twice, interleaved.
    "v21": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d64 s8192", ("", "ds_from_p16=False dv_late=True")),
                              ("d64 s8192 causal", ("", "ds_from_p16=False dv_late=True")),
                              ("d64 s1024", ("", "ds_from_p16=False dv_late=True")),
                              ("d64 s16384", ("", "ds_from_p16=False dv_late=True")),
                              ("d64 s8192 det", ("", "ds_from_p16=False dv_late=True")),
                              ("d64 s8192 causal det", ("", "ds_from_p16=False dv_late=True")),
                              ("d128 s8192", ("", "dv_late=True")),
                              ("d128 s8192 causal", ("", "dv_late=True", "step_cursor=True")),
                              ("d128 s8192 causal det", ("", "step_cursor=True")),
                              ("d128 s1024 causal", ("", "step_cursor=True")))
            for v in vs],
    # v0.19: the up order (Note [Up order]) with the small sections that the L2 bound gives the
    # non-deterministic causal kernel (which walks up too; Note [Causal sections]): v0.12 measured the
    # up order only with the deterministic sections (16 / 64 pairs), 15-29% slower than the down order.
    # The non-deterministic rows for the ratio. Two interleaved rounds.
    "v37": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d128 s4096 causal det", ("", "det_up=True", "det_up=True section=8",
                                                         "det_up=True section=4", "det_up=True section=2")),
                              ("d128 s8192 causal det", ("", "det_up=True section=4", "det_up=True section=2")),
                              ("d128 s16384 causal det", ("", "det_up=True section=2", "det_up=True section=1")),
                              ("d128 s1024 causal det", ("", "det_up=True", "det_up=True section=16")),
                              ("d64 s8192 causal det", ("", "det_up=True section=8", "det_up=True section=4")),
                              ("d256 s8192 causal det", ("", "det_up=True section=2", "det_up=True section=4")),
                              ("d128 s4096 causal", ("",)), ("d128 s8192 causal", ("",)),
                              ("d128 s16384 causal", ("",)), ("d128 s1024 causal", ("",)),
                              ("d64 s8192 causal", ("",)), ("d256 s8192 causal", ("",)))
            for v in vs],
    # v0.19: the claims at d64 (one profile read them 2-5% faster there, a row that moved 3% between
    # leases) in the plain and rotated walks; the up order with GQA in sections bounded by bytes
    # only (one or two pairs, half a wave or less). Three interleaved rounds.
    # v0.20: the down tail of the up order (Note [Down tail]): T kv heads per batch walk down and
    # launch last, T = min(det_tail, heads_k // det_tail_share). Run with T = 0 / 2 / 1 at d128 (16 kv
    # heads), 0 / 4 / 2 at d64 (32), 0 / 1 / 2 at d256 (8), written here in the fields' final meaning
    # (the run's det_tail was the share: T = heads_k // det_tail). The non-deterministic rows for the
    # ratio. Three interleaved rounds.
    "v40": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d128 s8192 causal det", ("det_tail=0", "det_tail=2", "det_tail=1")),
                              ("d128 s16384 causal det", ("det_tail=0", "det_tail=2", "det_tail=1")),
                              ("d128 s4096 causal det", ("det_tail=0", "det_tail=2", "det_tail=1")),
                              ("d128 s1024 causal det", ("det_tail=0", "det_tail=2")),
                              ("d64 s8192 causal det", ("det_tail=0", "det_tail=4 det_tail_share=8",
                                                        "det_tail=2")),
                              ("d256 s8192 causal det", ("det_tail=0", "det_tail=1",
                                                         "det_tail=2 det_tail_share=4")),
                              ("d128 s8192 causal", ("",)), ("d128 s16384 causal", ("",)),
                              ("d128 s4096 causal", ("",)), ("d64 s8192 causal", ("",)),
                              ("d256 s8192 causal", ("",)))
            for v in vs],
    # v0.20: a counter per warpgroup part of each slot for the ordered direct adds (Note [Split
    # counters], branch wip/split-counters: the field was removed again, rejected): d256 / d192
    # without a mask (the rotated order at one step of slack); d256 causal without the peeked slot,
    # with and without the split. Three interleaved rounds.
    "v41": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d256 s8192 det", ("", "dq_split_sem=True")),
                              ("d192 s8192 det", ("", "dq_split_sem=True")),
                              ("d256 s8192 causal det", ("", "publish_peek=False",
                                                         "publish_peek=False dq_split_sem=True")),
                              ("d256 s8192", ("",)), ("d192 s8192", ("",)))
            for v in vs],
    # v0.20: the rotated order in rounds (Note [Rotation rounds]): d256 / d192 without a mask (M == N,
    # stagger 1 -> 2 in two rounds), d128 (stagger 2 already) and d64 (128 x 128 tiles: stagger 1 too). Three interleaved rounds.
    # The dQ pass (Note [dQ pass], dq_pass; branch wip/dq-pass): dK / dV in the main kernel, dQ
    # in a second kernel without reductions. Three interleaved rounds.
    "v46": [f"{shape} {v}".strip() for _ in range(3)
            for shape in ("d256 s8192", "d256 s8192 causal", "d256 s8192 det", "d192 s8192", "d192 s8192 det",
                          "d256 s2048")
            for v in ("", "dq_pass=True")],
    # v0.22, the dQ pass as the default (DQ_PASS_MIN_HD {det: 160, not: 256}): the head dims it does not
    # take without determinism (d160 / d192 / d224), and d64 / d128 (the writer warp's head dims,
    # where a deterministic run would take the non-deterministic config with the pass). Three
    # interleaved rounds.
    "v47": [f"{shape} {v}".strip() for _ in range(3)
            for shape in ("d224 s8192", "d160 s8192", "d192 s8192 causal", "d128 s8192", "d64 s8192")
            for v in ("", "dq_pass=True")],
    # v0.22, after v47 (d160 / d224 gain without a mask, d192 causal loses): the causal rows of d160 /
    # d224 / d256 and d192 without a mask again. Three interleaved rounds.
    "v48": [f"{shape} {v}".strip() for _ in range(3)
            for shape in ("d160 s8192 causal", "d224 s8192 causal", "d256 s8192 causal", "d192 s8192")
            for v in ("dq_pass=False", "dq_pass=True")],
    # v0.22, the defaults after v48 (DQ_PASS_MASKED off): causal deterministic (the dQ pass) against
    # causal non-deterministic (the main kernel's dQ) at d160-d256. Three interleaved rounds.
    "v49": [f"d{d} s8192 causal{det}" for _ in range(3) for d in (160, 192, 224, 256) for det in (" det", "")],
    # v0.25: part of P^T's exponentials on the FMA pipe (exp2_emu_frac, Note [exp2 emulation]) in the
    # backward, where ncu put 12.8% of d64's stall samples on MUFU (MIO queue). Three interleaved rounds.
    # (Run with "" as the baseline, MUFU then; since the defaults emulate at d64 causal and d32 without
    # a mask, the baselines of v54-v57 say exp2_emu_frac=0.0.)
    "v54": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d64 s8192", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.125")),
                              ("d64 s8192 causal", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.125")),
                              ("d128 s8192", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.125", "exp2_emu_frac=0.25")),
                              ("d128 s8192 causal", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.125", "exp2_emu_frac=0.25")),
                              ("d128 s2048", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.125", "exp2_emu_frac=0.25")))
            for v in vs],
    # v0.25, second run: the causal rows, where v54 found the emulation ahead (three interleaved rounds).
    "v55": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d128 s1024 causal", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.25", "exp2_emu_frac=0.375")),
                              ("d128 s4096 causal", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.25", "exp2_emu_frac=0.375")),
                              ("d128 s8192 causal", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.25", "exp2_emu_frac=0.375",
                                                     "exp2_emu_frac=0.5")),
                              ("d128 s16384 causal", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.25", "exp2_emu_frac=0.375")),
                              ("d64 s8192 causal", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.125", "exp2_emu_frac=0.1875")),
                              ("d128 s8192 causal det", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.25")),
                              ("d64 s8192 causal det", ("exp2_emu_frac=0.0", "exp2_emu_frac=0.125")))
            for v in vs],
    # v0.25, third run: the head dims with the most exponentials per FLOP (d32, d96: 64-row steps).
    "v56": [f"{shape} {v}".strip() for _ in range(3)
            for shape in ("d32 s8192", "d32 s8192 causal", "d96 s8192", "d96 s8192 causal")
            for v in ("exp2_emu_frac=0.0", "exp2_emu_frac=0.25", "exp2_emu_frac=0.5")],
    # Written in v0.25 for the next lease: d64 without a mask, whose rounds moved by up to 20% in v54
    # (439-545 TFLOP/s for the default), at smaller emulated shares, five interleaved rounds.
    "v57": [f"{shape} {v}".strip() for _ in range(5)
            for shape in ("d64 s8192", "d64 s2048")
            for v in ("exp2_emu_frac=0.0", "exp2_emu_frac=0.0625", "exp2_emu_frac=0.125")],
    # v0.26: the split GQA group (Note [Split GQA group]) on MQA (g16 at d128, g32 at d64: one kv
    # head) and GQA 4, against one CTA per kv head (kv_split=1). Two interleaved rounds.
    "v58": [f"{shape} kv_split={v}" for _ in range(2)
            for shape, vs in (("d128 s8192 g16 causal", (1, 2, 4, 8, 16)), ("d128 s8192 g16", (1, 2, 4, 8)),
                              ("d128 s2048 g16 causal", (1, 4, 8)), ("d64 s8192 g32 causal", (1, 4, 8, 16)),
                              ("d128 s4096 g4 causal", (1, 2, 4)))
            for v in vs],
    # Written in v0.26 for the next lease: the split GQA group forced under the ordered deterministic
    # dQ (asked determinism keeps 1: a batch-independent rule could use a gain), MQA d128 / d64 s8k, two
    # interleaved rounds.
    "v59": [f"{shape} kv_split={v}" for _ in range(2)
            for shape, vs in (("d128 s8192 g16 causal det", (1, 4, 8)), ("d128 s8192 g16 det", (1, 2, 4)),
                              ("d64 s8192 g32 causal det", (1, 4, 8)),
                              # and without determinism, a GQA grid the rule splits unmeasured (512 CTAs -> 2)
                              ("d128 s8192 g4 causal", (1, 2)), ("d128 s2048 g4 causal", (1, 2, 4)))
            for v in vs],
    # Written in v0.26 for the next lease: the sm80 backward's split GQA group (sm80.KV_SPLIT off until
    # this runs; `--family sm80`), MQA causal / not, two interleaved rounds.
    "v60": [f"{shape} kv_split={v}" for _ in range(2)
            for shape, vs in (("d128 s8192 g16 causal", (1, 4, 8)), ("d128 s8192 g16", (1, 2)),
                              ("d64 s8192 g32 causal", (1, 4, 8)))
            for v in vs],
    # v0.24, after v51: the dQ pass in its new order on the causal rows without determinism (v48, in
    # the old order: flat or -1..-5%, so off by default). Three interleaved rounds.
    "v52": [f"{shape} {v}".strip() for _ in range(3)
            for shape in ("d256 s8192 causal", "d224 s8192 causal", "d192 s8192 causal", "d160 s8192 causal",
                          "d256 s4096 causal", "d256 s2048 causal")
            for v in ("dq_pass=False", "dq_pass=True")],
    # v0.24: the dQ pass in the forward's tile order with 16 MB L2 sections (Note [dQ pass tile
    # order]) against its old order (one pair per section, dq.l2_section_mb=0) and 32 MB: the causal
    # rows that run the pass (deterministic from d160; d256 non-deterministic with dq_pass=True, which
    # v48 measured 1% behind the main kernel's dQ) and d256 without a mask. Three interleaved rounds.
    "v51": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d256 s8192 causal det", ("dq.l2_section_mb=0", "", "dq.l2_section_mb=32")),
                              ("d256 s8192 causal", ("dq_pass=False", "dq_pass=True dq.l2_section_mb=0", "dq_pass=True")),
                              ("d256 s4096 causal det", ("dq.l2_section_mb=0", "")),
                              ("d256 s1024 causal det", ("dq.l2_section_mb=0", "")),
                              ("d192 s8192 causal det", ("dq.l2_section_mb=0", "")),
                              ("d160 s8192 causal det", ("dq.l2_section_mb=0", "")),
                              ("d256 s8192", ("dq.l2_section_mb=0", "")))
            for v in vs],
    # v0.22 Next 3: the causal sections' bytes per pair count a dQ accumulator that the dQ pass does not
    # have (deterministic causal runs from d160): the default (s8k: d160 4 pairs, d192 / d256 2)
    # against the sections without those bytes (d160 8, d192 / d256 4). Three interleaved rounds.
    # Run in v0.23.
    "v50": [f"d{d} s8192 causal det{v}" for _ in range(3) for d, more in ((160, 8), (192, 4), (256, 4))
            for v in ("", f" section={more}")],
    "v42": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d256 s8192 det", ("", "det_rounds=2")),
                              ("d192 s8192 det", ("", "det_rounds=2")),
                              ("d128 s8192 det", ("", "det_rounds=2")),
                              ("d64 s8192 det", ("", "det_rounds=2")),
                              ("d256 s8192", ("",)), ("d192 s8192", ("",)), ("d128 s8192", ("",)),
                              ("d64 s8192", ("",)))
            for v in vs],
    "v39": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d64 s8192", ("", "dq_first_store=True", "dq_first_store=True det_rotate=True")),
                              ("d64 s8192 causal", ("", "dq_first_store=True")),
                              ("d128 s8192 g4 causal det", ("", "det_up=True section=1", "det_up=True section=2")),
                              ("d128 s4096 g4 causal det", ("", "det_up=True section=1", "det_up=True section=2")))
            for v in vs],
    # v0.19, with the up order the causal deterministic default: the down order (det_up=False) on the
    # rows v37 did not cover (GQA, s2k), d256's sections of one pair. Two interleaved rounds.
    "v38": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d256 s8192 causal det", ("", "section=1", "det_up=False")),
                              ("d128 s8192 g4 causal det", ("", "det_up=False")),
                              ("d128 s4096 g4 causal det", ("", "det_up=False")),
                              ("d128 s2048 causal det", ("", "det_up=False")),
                              ("d64 s2048 causal det", ("", "det_up=False")),
                              ("d128 s8192 g4 causal", ("",)), ("d128 s2048 causal", ("",)))
            for v in vs],
    # v0.17: the sm80 family's causal sections on the H200 (``--family sm80``): its table's 16 pairs
    # against the sm90 family's L2 picks and their neighbours. Two rounds.
    "v36": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d128 s16384 causal", ("", "section=1", "section=2", "section=4")),
                              ("d128 s8192 causal", ("", "section=2", "section=4")),
                              ("d64 s8192 causal", ("", "section=4", "section=8")))
            for v in vs],
    # v0.17: GQA (four q heads per kv head), where a pair holds its group's rows: the 32 MB budget
    # gives one pair per section at s8k (33.6 MB a pair) and two at s4k; the table's 16 before (capped
    # by the 8 / 16 pairs). Three rounds.
    "v35": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d128 s8192 g4 causal", ("", "section=2", "section=8")),
                              ("d128 s4096 g4 causal", ("", "section=4", "section=16")),
                              ("d64 s8192 g4 causal", ("", "section=16")))
            for v in vs],
    # v0.17: the causal deterministic sections at long sequences, for the same L2 reason (after the
    # first wave a section's K blocks start at the top while earlier ones are near their diagonal).
    # v0.12 measured d128 s16k 16 -> 4 pairs as a loss (511 / 502 -> 499 / 465). Three rounds.
    "v34": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d128 s16384 causal det", ("", "section=4", "section=2")),
                              ("d128 s8192 causal det", ("", "section=4")),
                              ("d256 s8192 causal det", ("", "section=2")))
            for v in vs],
    # v0.17: the 32 MB budget's picks against their neighbours where v32 could not tell them apart
    # (d128 s16k 2 against 1, s8k 4 against 2, s2k 16 against 8, d256 s8k 2 against 1); four rounds.
    "v33": [f"{shape} {v}".strip() for _ in range(4)
            for shape, vs in (("d128 s16384 causal", ("", "section=1")),
                              ("d128 s8192 causal", ("", "section=2")),
                              ("d128 s2048 causal", ("", "section=8")),
                              ("d256 s8192 causal", ("", "section=1")))
            for v in vs],
    # v0.17: the non-deterministic causal launch sections at long sequences, for the L2. ncu of d128
    # s16k causal: L2 hit rate 84.9% for fa4 (one section of all 16 pairs: 16 heads' Q, dO and dQ
    # accumulator in flight, 16 MB each) against 97.1% for flash-attn-4 (one head at a time).
    # Three interleaved rounds.
    "v32": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d128 s16384 causal", ("", "section=1", "section=2", "section=4", "section=8")),
                              ("d128 s8192 causal", ("", "section=2", "section=4", "section=8")),
                              ("d128 s4096 causal", ("", "section=4", "section=8")),
                              ("d64 s8192 causal", ("", "section=4", "section=8")),
                              ("d256 s8192 causal", ("", "section=2", "section=4")))
            for v in vs],
    # v0.16 (run in v0.17: 16 kept): the non-deterministic causal launch sections at short sequences.
    # The greedy tail model of RESULTS v0.16 gives d128 s1k 0.981 of the SMs' time with the default 16
    # pairs and 0.992 with 64 (+1% at most); s4k 0.991 / 0.995. Three interleaved rounds.
    "v31": [f"{shape} {v}".strip() for _ in range(3)
            for shape in ("d128 s1024 causal", "d128 s2048 causal", "d128 s4096 causal", "d64 s1024 causal")
            for v in ("", "section=32", "section=64")],
    # v0.15: the sequencing warp of the ordered direct adds with the peeked slot (publish_peek with
    # dq_direct, SEQ_PEEK) against without; the non-deterministic kernel for the ratio; three
    # interleaved rounds.
    "v30": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d256 s8192 det", ("", "publish_peek=True")),
                              ("d256 s8192 causal det", ("", "publish_peek=True")),
                              ("d256 s8192", ("",)), ("d256 s8192 causal", ("",)),
                              ("d192 s8192 det", ("", "publish_peek=True")),
                              ("d192 s8192 causal det", ("", "publish_peek=True")),
                              ("d192 s8192", ("",)))
            for v in vs],
    # v0.14: the s1k / s2k causal deterministic sections at d128 and d64 (v27 and a warm rerun: d128 s1k
    # took 32 pairs over 64 in four of four rounds), two more interleaved rounds.
    "v28": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d128 s1024 causal det", ("", "section=32", "section=16")),
                              ("d64 s1024 causal det", ("", "section=32")),
                              ("d64 s2048 causal det", ("", "section=32", "section=64")),
                              ("d128 s2048 causal det", ("", "section=16")))
            for v in vs],
    # v0.14: the causal deterministic launch sections again with the peek default (v0.12 chose them
    # with the lag: 64 pairs at s1k, 16 from s4k), two interleaved rounds.
    "v27": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d128 s1024 causal det", ("", "section=32", "section=128")),
                              ("d128 s2048 causal det", ("", "section=16", "section=64")),
                              ("d128 s4096 causal det", ("", "section=8", "section=32")),
                              ("d128 s8192 causal det", ("", "section=8", "section=32")))
            for v in vs],
    # v0.14: the peeked slot as the default (PUBLISH_PEEK, its read at the top of the step) against
    # v0.13's rule (the lag below 32 K blocks and in the rotated order, none above), three
    # interleaved rounds.
    "v25": [f"{shape} {v}".strip() for _ in range(3)
            for shape, old in (("d128 s1024 causal det", "publish_peek=False publish_lag=True"),
                               ("d128 s8192 causal det", "publish_peek=False"),
                               ("d128 s16384 causal det", "publish_peek=False"),
                               ("d128 s1024 det", "publish_peek=False publish_lag=True"),
                               ("d128 s8192 det", "publish_peek=False publish_lag=True"),
                               ("d64 s8192 causal det", "publish_peek=False"),
                               ("d64 s8192 det", "publish_peek=False publish_lag=True"))
            for v in ("", old)],
    # (v22-v24 ran with v0.13's defaults, the lag rule; since v0.14's peek default their lag and
    # direct variants need publish_peek=False to compile.)
    # v0.13: the writer's peeked slot (Note [Publish peek]) against the default (the lag below 32 K
    # blocks and in the rotated order, none above), two interleaved rounds.
    "v24": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d128 s1024 causal det", "d128 s2048 causal det", "d128 s4096 causal det",
                          "d128 s8192 causal det", "d128 s16384 causal det", "d128 s1024 det", "d128 s8192 det",
                          "d64 s8192 causal det", "d64 s8192 det")
            for v in ("", "publish_lag=False publish_peek=True")],
    # v0.13: the causal deterministic writer without its publish lag from DET_LAG_MAX_BLOCKS K blocks
    # (the new default) against with it, three interleaved rounds; below the bound the other way round.
    "v23": [f"{shape} {v}".strip() for _ in range(3)
            for shape, vs in (("d128 s4096 causal det", ("", "publish_lag=True")),
                              ("d128 s8192 causal det", ("", "publish_lag=True")),
                              ("d128 s16384 causal det", ("", "publish_lag=True")),
                              ("d128 s3072 causal det", ("", "publish_lag=False")),
                              ("d64 s8192 causal det", ("", "publish_lag=True")),
                              ("d64 s16384 causal det", ("", "publish_lag=True")))
            for v in vs],
    # v0.13: the ordered direct dQ adds (Note [Ordered direct dQ], d256's deterministic path) at head
    # dims 64 and 128, where the deterministic writer warp falls behind under a causal mask (v0.12's
    # ncu map); with the direct adds' sections of 8 pairs and the writer's 16.
    "v22": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d128 s8192 causal det", ("", "dq_direct=True publish_lag=False",
                                                          "dq_direct=True publish_lag=False section=16")),
                              ("d128 s4096 causal det", ("", "dq_direct=True publish_lag=False")),
                              ("d128 s1024 causal det", ("", "dq_direct=True publish_lag=False")),
                              ("d128 s16384 causal det", ("", "dq_direct=True publish_lag=False")),
                              ("d128 s8192 det", ("", "dq_direct=True publish_lag=False")),
                              ("d64 s8192 causal det", ("", "dq_direct=True publish_lag=False")))
            for v in vs],
    # The up order (Note [Up order], flash-attn-4's) against the down order on the causal deterministic
    # rows, twice, interleaved; its sections too (v0.12 ran four rows of it by hand: 15-29% slower).
    "v20": [f"{shape} {v}".strip() for _ in range(2)
            for shape in ("d128 s8192 causal det", "d128 s4096 causal det", "d128 s1024 causal det",
                          "d128 s16384 causal det", "d64 s8192 causal det", "d256 s8192 causal det")
            for v in ("", "det_up=True")]
    + [f"d128 s8192 causal det det_up=True section={n}" for n in (4, 8, 64)],
    # v0.12, the power-of-two sections: the default against the sections it should equal.
    "v19": [f"{shape} {v}".strip() for _ in range(2)
            for shape, vs in (("d128 s4096 causal det", ("", "section=16")),
                              ("d128 s1024 causal det", ("", "section=64")))
            for v in vs],
}


def parse(exp: str):
    words = exp.split()
    shape = dict(d=128, s=8192, g=1, causal=False, det=False, section=None, dq={}, const={})
    over = {}
    for w in words:
        if w.startswith("const.") and "=" in w:
            k, v = w[6:].split("=", 1)
            shape["const"][k] = ast.literal_eval(v)
        elif w.startswith("dq.") and "=" in w:
            k, v = w[3:].split("=", 1)
            shape["dq"][k] = ast.literal_eval(v)
        elif w == "causal":
            shape["causal"] = True
        elif w == "det":
            shape["det"] = True
        elif w.startswith("section="):
            shape["section"] = int(w.split("=", 1)[1])
        elif "=" in w:
            k, v = w.split("=", 1)
            over[k] = ast.literal_eval(v)
        elif w[0] in "dsg" and w[1:].isdigit():
            shape[w[0]] = int(w[1:])
        else:
            raise ValueError(f"bad word {w!r} in {exp!r}")
    return shape, over


def _tensors(shape, grad=True):
    d, s = shape["d"], shape["s"]
    b, h = 16384 // s, 2048 // d
    torch.manual_seed(0)
    return [torch.randn(b, s, h // (shape["g"] if i else 1), d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
            for i in range(3)]


def _options(family, over):
    """KernelOptions of an experiment and its other overrides: ``dq_pass=`` goes through
    ``KernelOptions.bwd_dq_pass`` (make_config then builds the deterministic config that goes with it:
    a deterministic run with the pass takes the non-deterministic one), the rest replace fields."""
    over = dict(over)
    return fa4.KernelOptions(arch=family, bwd_dq_pass=over.pop("dq_pass", None)), over


@contextlib.contextmanager
def _consts(mod, values):
    """The family module's constants of ``const.NAME=VALUE`` words set for the experiment (e.g.
    ``const.ORDERED_SHORT_MAX_SEQLEN_K=0``), restored after."""
    saved = {k: getattr(mod, k) for k in values}  # AttributeError: no such constant
    try:
        for k, v in values.items():
            setattr(mod, k, v)
        yield
    finally:
        for k, v in saved.items():
            setattr(mod, k, v)


def configs(family, shape, over):
    mod = importlib.import_module(f"fa4.bwd.{family}")
    with _consts(mod, shape["const"]):
        return _configs(mod, family, shape, over)


def _configs(mod, family, shape, over):
    q, k, v = (t.detach() for t in _tensors(shape, grad=False)) if torch.cuda.is_available() else [None] * 3
    problem = validate.check_dense(q, k, v, None, shape["causal"], (None, None), 0.0)
    opts, over = _options(family, over)
    cfg = dataclasses.replace(mod.make_config(problem, opts, "sm_90a", shape["det"]), **over)
    if shape["dq"] and not getattr(cfg, "dq_pass", False):
        print(f"warning: dq.* overrides {shape['dq']} ignored: this config has no dQ pass", flush=True)
    if getattr(cfg, "dq_pass", False):  # Note [dQ pass]: the dQ kernel, no postprocess, no counters
        from fa4.bwd import dq_sm90
        return [cfg, dataclasses.replace(dq_sm90.config_for(cfg), **shape["dq"]),
                preprocess.make_config("bf16", shape["d"], "sm_90a", has_semaphore=False, zero_dq=False,
                                       pdl=getattr(cfg, "pdl", False))]
    # (the driver's: a semaphore where the main kernel counts slots, no zeroing where it stores first)
    pre = preprocess.make_config("bf16", shape["d"], "sm_90a", has_semaphore=common.counts_slots(cfg),
                                 zero_dq=not postprocess.config_for(cfg).counted, pdl=getattr(cfg, "pdl", False))
    return [cfg, postprocess.config_for(cfg), pre]


def _precompile(cfg):
    try:
        return jit.precompile(cfg)
    except Exception as e:  # report, go on
        return {"error": f"{type(cfg).__name__}: {type(e).__name__}: {str(e)[:300]}"}


def run(family, shape, over):
    mod = importlib.import_module(f"fa4.bwd.{family}")
    orig = mod.make_config
    order = mod.LAUNCH_ORDER
    saved = (order.section, order.det_section)
    order.section = order.det_section = shape["section"]
    opts, over = _options(family, over)
    mod.make_config = lambda *a, **k: dataclasses.replace(orig(*a, **k), **over)
    from fa4.bwd import dq_sm90
    orig_dq = dq_sm90.config_for
    dq_sm90.config_for = lambda c: dataclasses.replace(orig_dq(c), **shape["dq"])
    ops._plans.clear()
    try:
        with _consts(mod, shape["const"]):
            return _time(shape, opts)
    finally:
        mod.make_config = orig
        dq_sm90.config_for = orig_dq
        order.section, order.det_section = saved
        ops._plans.clear()


def _time(shape, opts):
    """(ms, TFLOP/s, gradients) of one experiment's backward, its configs in place."""
    from triton.testing import do_bench

    q, k, v = _tensors(shape)
    out, _ = fa4.flash_attn_func(q, k, v, causal=shape["causal"], deterministic=shape["det"], kernel_options=opts)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
    ms = do_bench(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), warmup=25, rep=100,
                  return_mode="median")
    b, s, h, d = q.shape
    flops = 2.5 * 4 * b * h * s * s * d / (2 if shape["causal"] else 1)
    return ms, flops / ms / 1e9, grads


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("experiments", nargs="*")
    ap.add_argument("--plan", action="append", default=[], help="names of PLANS to run")
    ap.add_argument("--family", default="sm90")
    ap.add_argument("--jobs", type=int, default=14)
    args = ap.parse_args()
    texts = [e for name in args.plan for e in PLANS[name]] + list(args.experiments)
    exps = [parse(e) for e in texts]
    cfgs = {c.key(): c for shape, over in exps for c in configs(args.family, shape, over)}
    with ProcessPoolExecutor(args.jobs) as ex:
        for row in ex.map(_precompile, cfgs.values()):
            if "error" in row:
                print("compile error:", row["error"], flush=True)
    base = {}
    print(f"{'experiment':<48} {'TFLOP/s':>8} {'ms':>8} {'maxdiff':>8}", flush=True)
    for text, (shape, over) in zip(texts, exps):
        try:
            ms, tf, grads = run(args.family, shape, over)
            key = tuple(sorted((k, repr(v)) for k, v in shape.items() if k not in ("det", "section", "dq", "const")))
            ref = base.setdefault(key, grads)
            diff = max(float((a.float() - r.float()).abs().max()) for a, r in zip(grads, ref))
            print(f"{text:<48} {tf:8.1f} {ms:8.3f} {diff:8.1e}", flush=True)
        except Exception as e:
            print(f"{text:<48} ERR {type(e).__name__}: {str(e)[:200]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
