"""The forward launchers hand the compiled kernel the arguments of its signature (CPU: the kernel
is replaced by a recorder), in the order of ``fake_args`` (fa4/fwd/common.py)."""

import dataclasses

import pytest
import torch

from fa4 import jit, validate
from fa4.fwd import sm80, sm90


@pytest.mark.parametrize("mod", [sm80, sm90])
@pytest.mark.parametrize("local", [False, True])
def test_run_passes_the_signature(monkeypatch, mod, local):
    calls = []
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *a: calls.append(a))
    if mod is sm90:
        monkeypatch.setattr(sm90, "_num_sms", lambda device: 132)
    q, k, v = (torch.empty(2, 100, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    window = (30, 5) if local else (None, None)
    with validate.allow_any_device():
        problem = validate.check_dense(q, k, v, 0.125, not local, window, 0.0)
    cfg = mod.make_config(problem, None, "sm_90a" if mod is sm90 else "sm_80", True)
    out, lse = torch.empty_like(q), torch.empty(2, 4, 100)
    mod.run(cfg, problem, q, k, v, out, lse)
    (args,) = calls
    # cu_seqlens_q / _k, seqused_q / _k, page table, sink
    assert args[:11] == (q, k, v, out, lse, None, None, None, None, None, None)
    assert args[11:16] == (0.125, 1.0, 30 if local else 0, 5 if local else 0, 100)
    # ([persistent grid,] K splits[, the dynamic scheduler's claims counter, the aux tensors])
    assert args[16:] == ((132, 1, None, None) if mod is sm90 else (1, None))
    # as many runtime arguments as the compiled signature (fake_args without the stream)
    assert len(args) == len(jit.kernel_class(cfg).fake_args(cfg)) - 1


def test_sm90_passes_the_aux_tensors(monkeypatch):
    """A call with a user function's aux tensors (fa4/mods.py): the kernel gets them as one tuple,
    last before the stream, as its compiled signature has them."""
    import cutlass.cute as cute

    from fa4 import mods

    @cute.jit
    def same_doc(b, h, q_idx, kv_idx, seqlen_info, aux_tensors):
        return aux_tensors[0][q_idx[0]] == aux_tensors[0][kv_idx[0]]

    calls = []
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *a: calls.append(a))
    monkeypatch.setattr(sm90, "_num_sms", lambda device: 132)
    q, k, v = (torch.empty(2, 100, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    ids = torch.zeros(100, dtype=torch.int32)
    with validate.allow_any_device():
        problem = validate.check_dense(q, k, v, 0.125, False, (None, None), 0.0)
    problem = dataclasses.replace(problem, mask_mod=mods.key_of(same_doc, "mask_mod"),
                                  aux=mods.aux_signature([ids], None))
    cfg = sm90.make_config(problem, None, "sm_90a", True)
    sm90.run(cfg, problem, q, k, v, torch.empty_like(q), torch.empty(2, 4, 100), aux=[ids])
    (args,) = calls
    assert args[-1] == (ids,)
    assert len(args) == len(jit.kernel_class(cfg).fake_args(cfg)) - 1


def test_sm90_dynamic_scheduler_gets_a_zeroed_counter(monkeypatch):
    """The dynamic persistent scheduler claims tiles from a counter that must be zero at launch: the
    launcher passes a fresh zeroed int32 (one per call, so concurrent streams cannot share it)."""
    calls = []
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *a: calls.append(a))
    monkeypatch.setattr(sm90, "_num_sms", lambda device: 132)
    q, k, v = (torch.empty(2, 100, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    with validate.allow_any_device():
        problem = validate.check_dense(q, k, v, 0.125, True, (None, None), 0.0)
    cfg = dataclasses.replace(sm90.make_config(problem, None, "sm_90a", True), persistent=True, dynamic_sched=True)
    for _ in range(2):
        sm90.run(cfg, problem, q, k, v, torch.empty_like(q), torch.empty(2, 4, 100))
    (a1, a2) = calls
    assert a1[16:18] == (132, 1) and a1[18].dtype == torch.int32 and a1[18].tolist() == [0]
    assert a2[18] is not a1[18]
    assert len(a1) == len(jit.kernel_class(cfg).fake_args(cfg)) - 1
    with pytest.raises(ValueError, match="dynamic_sched needs persistent"):
        sm90.FlashFwdSm90.can_implement(dataclasses.replace(cfg, persistent=False))


def test_sm80_split_launch(monkeypatch):
    """Split-KV (sm80 family): the kernel gets float32 partials with ``splits * b`` batches and the
    split count, then the combine merges them into the outputs."""
    import fa4.combine

    calls, combined = [], []
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *a: calls.append(a))
    monkeypatch.setattr(fa4.combine, "combine_into", lambda *a, **kw: combined.append(a))
    q, k, v = (torch.empty(2, 3, h, 64, dtype=torch.bfloat16) for h in (8, 2, 2))
    with validate.allow_any_device():
        problem = validate.check_dense(q, k, v, 0.125, False, (None, None), 0.0)
    problem = dataclasses.replace(problem, num_splits=3)
    cfg = sm80.make_config(problem, None, "sm_80", False)
    assert (cfg.split_kv, cfg.has_lse, cfg.qhead_per_kvhead) == (True, True, 4)
    out = torch.empty_like(q)
    sm80.run(cfg, problem, q, k, v, out, None)
    (args,) = calls
    o_part, lse_part = args[3], args[4]
    assert o_part.dtype == lse_part.dtype == torch.float32
    assert o_part.shape == (6, 3, 8, 64) and lse_part.shape == (6, 8, 3)
    assert args[16:] == (3, None)
    assert len(args) == len(jit.kernel_class(cfg).fake_args(cfg)) - 1
    (c,) = combined
    assert c[0].shape == (3, 2, 3, 8, 64) and c[2] is out and c[3] is None
