"""Public API surface, options and dispatch decisions (CPU only)."""

import inspect
import warnings

import pytest
import torch

import fa4
from fa4 import arch
from fa4.config import KernelOptions


def test_version_and_exports():
    assert isinstance(fa4.__version__, str) and fa4.__version__.count(".") == 2
    for name in ("flash_attn_func", "flash_attn_varlen_func", "explain", "cache_info", "KernelOptions"):
        assert hasattr(fa4, name)


def test_import_does_not_load_the_dsl():
    import subprocess
    import sys

    code = "import sys, fa4; print('cutlass' in sys.modules, 'torch._dynamo' in sys.modules)"
    # (torch._dynamo: about 1.5 s of import time; fa4 marks its compile-time constant without it)
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False False"


def test_signature_matches_flash_attn_cute():
    """Same positional order and names as flash-attn-4's flash_attn.cute (4.0.0b36), every parameter
    of it, then fa4's keyword-only ``kernel_options``."""
    params = list(inspect.signature(fa4.flash_attn_func).parameters)
    assert params == ["q", "k", "v", "qv", "gather_kv_indices", "softmax_scale", "causal", "window_size",
                      "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic", "score_mod",
                      "score_mod_bwd", "mask_mod", "aux_tensors", "aux_scalars", "block_sparse_tensors",
                      "block_sparse_tensors_bwd", "return_lse", "gather_bwd_recompute_p", "gather_bwd_token_chunk",
                      "kernel_options"]
    params = list(inspect.signature(fa4.flash_attn_varlen_func).parameters)
    assert params == ["q", "k", "v", "qv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k",
                      "min_seqlen_k", "seqused_q", "seqused_k", "gather_kv_indices", "page_table", "softmax_scale",
                      "causal", "window_size", "learnable_sink", "softcap", "num_splits", "pack_gqa", "deterministic",
                      "score_mod", "score_mod_bwd", "mask_mod", "block_sparse_tensors", "aux_tensors", "aux_scalars",
                      "return_lse", "scheduler_metadata", "seqlen_k_per_split", "disable_scheduler_metadata",
                      "gather_bwd_recompute_p", "gather_bwd_token_chunk", "kernel_options"]
    for f in (fa4.flash_attn_func, fa4.flash_attn_varlen_func):
        assert inspect.signature(f).parameters["kernel_options"].kind is inspect.Parameter.KEYWORD_ONLY


@pytest.mark.parametrize("name, value", [("gather_bwd_recompute_p", True), ("gather_bwd_token_chunk", 64)])
def test_gather_backward_arguments_are_refused_by_name(name, value):
    """flash-attn-4's gather_kv_indices backward knobs: accepted at their defaults (a drop-in call
    passes them), NotImplementedError naming the argument when set."""
    q = torch.empty(2, 10, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match=name):
        fa4.flash_attn_func(q, q, q, **{name: value})
    cu = torch.tensor([0, 10], dtype=torch.int32)
    with pytest.raises(NotImplementedError, match=name):
        fa4.flash_attn_varlen_func(q[0], q[0], q[0], cu_seqlens_q=cu, cu_seqlens_k=cu, **{name: value})


@pytest.mark.parametrize("opts", [
    KernelOptions(),
    KernelOptions(arch="sm80", tile_m=64, exp2_emu_frac=0.25, rescale_threshold=0.0),
    KernelOptions(tile_n=32, num_stages=2, bwd_tile_m=64, bwd_num_threads=256),
])
def test_options_string_roundtrip(opts):
    assert KernelOptions.from_str(opts.to_str()) == opts


def test_options_merge():
    a = KernelOptions(tile_m=64, exp2_emu_frac=0.5)
    b = KernelOptions(exp2_emu_frac=0.0)
    assert a.merged(b) == KernelOptions(tile_m=64, exp2_emu_frac=0.0)


@pytest.mark.parametrize("direction,cc,family,target,fallback", [
    ("fwd", (8, 0), "sm80", "sm_80", False),
    ("fwd", (8, 6), "sm80", "sm_86", False),
    ("fwd", (9, 0), "sm90", "sm_90a", False),   # the Hopper forward: native, no warning
    ("bwd", (9, 0), "sm90", "sm_90a", False),   # the Hopper backward: native too
    ("fwd", (10, 0), "sm80", "sm_100a", True),  # sm_90a kernels do not run on Blackwell
    ("bwd", (10, 0), "sm80", "sm_100a", True),
])
def test_natural_dispatch(monkeypatch, direction, cc, family, target, fallback):
    monkeypatch.delenv("FA4_ARCH", raising=False)
    arch._warned.clear()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        d = arch.resolve(direction, cc, KernelOptions())
        arch.resolve(direction, cc, KernelOptions())
    assert (d.family, d.target, d.fallback) == (family, target, fallback)
    assert len([x for x in w if "fa4.explain" in str(x.message)]) == (1 if fallback else 0)  # once


def test_forced_family(monkeypatch):
    monkeypatch.delenv("FA4_ARCH", raising=False)
    d = arch.resolve("bwd", (9, 0), KernelOptions(arch="sm80"))
    assert d.family == "sm80" and not d.fallback and "KernelOptions.arch" in d.reason
    monkeypatch.setenv("FA4_ARCH", "sm_80")
    assert "FA4_ARCH" in arch.resolve("fwd", (9, 0), None).reason
    with pytest.raises(ValueError, match="compute capability 9.x"):
        arch.resolve("fwd", (8, 0), KernelOptions(arch="sm90"))
    with pytest.raises(ValueError, match="compute capability 9.x"):
        arch.resolve("fwd", (10, 0), KernelOptions(arch="sm90"))
    assert arch.resolve("fwd", (9, 0), KernelOptions(arch="sm90")).family == "sm90"
    assert arch.resolve("bwd", (9, 0), KernelOptions(arch="sm90")).family == "sm90"
    with pytest.raises(NotImplementedError, match="no sm100 bwd kernel"):
        arch.resolve("bwd", (10, 0), KernelOptions(arch="sm100"))


def test_explain_on_cpu_shapes():
    q = torch.empty(2, 100, 8, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 300, 2, 128, dtype=torch.bfloat16)
    ex = fa4.explain(q, k, k, causal=True, capability=(9, 0), kernel_options=KernelOptions(arch="sm80"))
    text = str(ex)
    assert "family=sm80" in text and "forced by KernelOptions.arch" in text
    assert ex.problem.causal and ex.problem.heads_k == 2 and ex.problem.seqlen_k == 300


def test_explain_hopper_forward_is_native():
    q = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16)
    text = str(fa4.explain(q, q, q, causal=True, capability=(9, 0)))
    assert "[fwd] family=sm90 target=sm_90a: native" in text and "'rescale_o_before_pv': " in text


def test_explain_hopper_backward_is_native_and_says_deterministic():
    q = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    text = str(fa4.explain(q, q, q, causal=True, deterministic=True, capability=(9, 0)))
    assert "[bwd] family=sm90 target=sm_90a: native" in text and "'deterministic': True" in text
    assert "fallback" not in text


def test_explain_hopper_backward_notes_the_deterministic_path():
    """fa4.explain() says which deterministic order the sm90 backward takes, and that at head dim
    256 it keeps the direct dQ adds, in order (Note [Ordered direct dQ])."""
    q = torch.empty(2, 1000, 8, 128, dtype=torch.bfloat16, requires_grad=True)
    text = str(fa4.explain(q, q, q, deterministic=True, capability=(9, 0)))
    assert "rotated order" in text and "ordered writer warp" not in text
    text = str(fa4.explain(q, q, q, causal=True, deterministic=True, capability=(9, 0)))
    assert "launch order" in text
    q = torch.empty(2, 1000, 8, 256, dtype=torch.bfloat16, requires_grad=True)
    ordered = fa4.KernelOptions(bwd_dq_pass=False)
    text = str(fa4.explain(q, q, q, deterministic=True, kernel_options=ordered, capability=(9, 0)))
    assert "added from registers" in text and "rank order" in text and "ordered writer warp" not in text
    assert "deterministic dQ" not in str(fa4.explain(q, q, q, kernel_options=ordered, capability=(9, 0)))
    # The default there: the dQ pass (Note [dQ pass]), the same kernels with or without determinism.
    for det in (False, True):
        text = str(fa4.explain(q, q, q, deterministic=det, capability=(9, 0)))
        assert "dQ pass" in text and "deterministic dQ" not in text and "'dq_pass': True" in text


def test_explain_hopper_forward_notes_the_grid():
    """fa4.explain() names the sm90 forward's grid and rows: the decode tile (one CTA per tile,
    64-row K blocks, packed GQA rows), and the dynamic persistent grid with LPT for a long causal
    prefill, whose 4 q heads per kv head are packed by TMA (6 are not, and it says how to pack them)."""
    q = torch.empty(64, 1, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(64, 8192, 8, 128, dtype=torch.bfloat16)
    text = str(fa4.explain(q, k, k, capability=(9, 0)))
    assert "decode tile" in text and "one CTA per tile" in text and "packed GQA rows" in text
    assert "64-row K blocks" in text
    # Paged (v0.29): one CTA per tile too, with the table's K blocks.
    kc = torch.empty(64 * 512, 16, 8, 128, dtype=torch.bfloat16)
    table = torch.zeros(64, 512, dtype=torch.int32)
    used = torch.full((64,), 8192, dtype=torch.int32)
    text = str(fa4.explain(q, kc, kc, page_table=table, seqused_k=used, capability=(9, 0)))
    assert "decode tile" in text and "the table's 128-row K blocks" in text and "one CTA per tile" in text
    q = torch.empty(2, 4096, 32, 128, dtype=torch.bfloat16)
    k = torch.empty(2, 4096, 8, 128, dtype=torch.bfloat16)
    text = str(fa4.explain(q, k, k, causal=True, capability=(9, 0)))
    assert "dynamic persistent grid" in text and "LPT" in text and "decode tile" not in text
    # Prefill GQA: 4 q heads per kv head packed by TMA boxes (v0.42); 6, no divisor of the tile, by
    # boxes of 21 positions where asked (v0.43; by default for a ragged Q only); 16 (MQA) not packed.
    assert "packed GQA rows" in text and "TMA boxes of whole positions" in text
    q6, k6 = torch.empty(2, 4096, 36, 128, dtype=torch.bfloat16), torch.empty(2, 4096, 6, 128, dtype=torch.bfloat16)
    assert "GQA rows not packed" in str(fa4.explain(q6, k6, k6, causal=True, capability=(9, 0)))
    text6 = str(fa4.explain(q6, k6, k6, causal=True, pack_gqa=True, capability=(9, 0)))
    assert "21 positions (126 of the tile's 128 rows)" in text6
    k1 = torch.empty(2, 4096, 1, 128, dtype=torch.bfloat16)
    assert "GQA rows not packed" in str(fa4.explain(q6[:, :, :16], k1, k1, causal=True, capability=(9, 0)))
    # K/V multicast (v0.50): the d128 rows without a mask from s_k 4096, on the static persistent grid.
    q, k = torch.empty(2, 8192, 16, 128, dtype=torch.bfloat16), torch.empty(2, 8192, 16, 128, dtype=torch.bfloat16)
    text = str(fa4.explain(q, k, k, capability=(9, 0)))
    assert "static persistent grid" in text and "TMA multicast" in text and "KV_MCAST_MIN_SEQLEN_K" in text
    assert "multicast" not in str(fa4.explain(q[:, :1024], k[:, :1024], k[:, :1024], capability=(9, 0)))
    # v0.52: causal d128 rows from s_k 8192 too, on the dynamic grid with pair claims; not at s_k 4096.
    text = str(fa4.explain(q, k, k, causal=True, capability=(9, 0)))
    assert "dynamic persistent grid" in text and "KV_MCAST_CAUSAL_HEAD_DIMS" in text and "Pair claims" in text
    assert "multicast" not in str(fa4.explain(q[:, :4096], k[:, :4096], k[:, :4096], causal=True, capability=(9, 0)))


def test_explain_validates():
    q = torch.empty(2, 100, 8, 100, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="head_dim"):
        fa4.explain(q, q, q, capability=(9, 0))


def test_explain_reports_backward_launch_sections():
    """fa4.explain() names the sm90 backward's launch sections: bounded by L2 bytes with a causal
    mask (Note [Causal sections]: 2 pairs at d128 s16k), deterministic too in the up order (Note [Up
    order]), one pair without a mask; the deterministic table's count in the down order (GQA)."""
    def line(q, k, **kw):
        text = str(fa4.explain(q, k, k, capability=(9, 0), **kw))
        return [s for s in text.splitlines() if "launch order: sections" in s]

    q = torch.randn(1, 16384, 16, 128, dtype=torch.bfloat16, device="meta")
    (causal,) = line(q, q, causal=True)
    assert "sections of 2 of the 16 (batch, kv head) pairs" in causal and "Causal sections" in causal
    (plain,) = line(q, q)
    assert "sections of 1 of the 16" in plain and "Causal sections" not in plain
    (det,) = line(q, q, causal=True, deterministic=True)
    assert "sections of 2 of the 16" in det and "Causal sections" in det
    kv = torch.randn(2, 8192, 4, 128, dtype=torch.bfloat16, device="meta")  # GQA: the wave floor
    q16 = torch.randn(2, 8192, 16, 128, dtype=torch.bfloat16, device="meta")
    (gqa,) = line(q16, kv, causal=True)  # 512 CTAs: the group splits in two (Note [Split GQA group])
    assert "sections of 2 of the 16" in gqa and "split GQA group" in str(fa4.explain(q16, kv, kv, causal=True,
                                                                                     capability=(9, 0)))
    (gqa_det,) = line(q16, kv, causal=True, deterministic=True)  # the down order's table: all 8 pairs
    assert "sections of 8 of the 8" in gqa_det and "Causal sections" not in gqa_det
    # Asked determinism keeps the group whole and names the fixed split that would serve it.
    det_text = str(fa4.explain(q16, kv, kv, causal=True, deterministic=True, capability=(9, 0)))
    assert "GQA group not split" in det_text and "bwd_kv_split=2" in det_text
    fixed = str(fa4.explain(q16, kv, kv, causal=True, deterministic=True, capability=(9, 0),
                            kernel_options=fa4.KernelOptions(bwd_kv_split=2)))
    assert "split GQA group: the 4 q heads of each kv head over 2 CTAs" in fixed and "not split" not in fixed


def test_explain_reports_the_down_tail():
    """fa4.explain() names the deterministic up order's down tail (Note [Down tail]) with its kv head
    count: two of 16 at d128, one of 8 at d256, none with 4 kv heads or with GQA (the down order)."""
    def tail(q, k, **kw):
        text = str(fa4.explain(q, k, k, capability=(9, 0), deterministic=True, **kw))
        return [s for s in text.splitlines() if "down tail" in s]

    q = torch.randn(1, 4096, 16, 128, dtype=torch.bfloat16, device="meta")
    (d128,) = tail(q, q, causal=True)
    assert "the last 2 of the 16 kv heads" in d128 and "Down tail" in d128
    q256 = torch.randn(1, 4096, 8, 256, dtype=torch.bfloat16, device="meta")
    (d256,) = tail(q256, q256, causal=True, kernel_options=fa4.KernelOptions(bwd_dq_pass=False))
    assert "the last 1 of the 8 kv heads" in d256
    assert tail(q256, q256, causal=True) == []  # the dQ pass: no order
    q4 = torch.randn(1, 4096, 4, 128, dtype=torch.bfloat16, device="meta")
    assert tail(q4, q4, causal=True) == [] and tail(q, q) == []
    assert tail(q, torch.randn(1, 4096, 4, 128, dtype=torch.bfloat16, device="meta"), causal=True) == []


def test_explain_notes_missing_max_seqlen():
    """A varlen call without max_seqlen_q / max_seqlen_k (flash_attn.cute makes them optional): the
    packed token count stands in for the longest length, and explain() says so, what fa4 does about
    it (the forward's compact grid, the backward's sections on the average, v0.38) and how to avoid it."""
    q = torch.empty(300, 8, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 100, 300], dtype=torch.int32)
    text = str(fa4.explain(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, capability=(9, 0)))
    assert "max_seqlen_q not given" in text and "max_seqlen_k not given" in text
    assert "the compact varlen grid" in text and "'compact_grid': True" in text
    assert "judged on the average sequence lengths (150 queries, 150 keys)" in text
    text = str(fa4.explain(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, capability=(9, 0)))
    assert "max_seqlen_k not given" in text and "max_seqlen_q not given" not in text
    assert "'compact_grid': True" not in text and "(150 keys)" in text
    text = str(fa4.explain(q, q, q, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=200, max_seqlen_k=200,
                           capability=(9, 0)))
    assert "not given" not in text


@pytest.mark.parametrize("rows,keys", [(0, 0), (5, 0), (3, 5)])
def test_varlen_batch_of_no_sequences(rows, keys, calls):
    """cu_seqlens of length 1 (a batch of no sequences, as a data loader's last, empty shard gives):
    flash_attn.cute returns an empty out, so fa4 does too (it raised before); rows past the last
    sequence get zeros and lse -inf (with a learnable sink, lse = sink, as flash_attn.cute's empty
    rows), no kernel is launched (also where k has rows and no max_seqlen_k bounds them), the
    backward gives zero gradients and fa4.explain says no kernel runs."""
    launched = calls  # every kernel launch, recorded (tests/conftest.py)
    cu = torch.zeros(1, dtype=torch.int32)
    q = torch.randn(rows, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(keys, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=0, max_seqlen_k=None if keys else 0)
    out, lse = fa4.flash_attn_varlen_func(q, k, k, return_lse=True, **kw)
    assert out.shape == (rows, 4, 64) and lse.shape == (4, rows) and not launched
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -float("inf")).all())
    out.float().sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q)) and torch.equal(k.grad, torch.zeros_like(k)) and not launched
    ex = fa4.explain(q, k, k, capability=(9, 0), **kw)
    # a paged cache (page size 12, not loaded by TMA: the gather path) with a (0, pages) table
    cache = torch.randn(4, 12, 2, 64, dtype=torch.bfloat16)
    out, lse = fa4.flash_attn_varlen_func(q.detach(), cache, cache, cu_seqlens_q=cu, max_seqlen_q=0,
                                          page_table=torch.zeros(0, 2, dtype=torch.int32), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and not launched
    assert any(n.startswith("no kernel runs") for n in ex.notes), ex.notes
    with pytest.raises(ValueError, match=r"cu_seqlens_q must have length batch \+ 1"):
        fa4.flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu[:0], cu_seqlens_k=cu, max_seqlen_q=0, max_seqlen_k=0)
