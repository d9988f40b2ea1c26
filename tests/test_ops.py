"""The host drivers in fa4.ops, on the CPU with the kernel replaced by a recorder: what the kernels
are handed (4D views, kernel-ready strides, outputs laid out like q) and what comes back (the
user's layout, varlen lse as (h, total))."""

import torch

from fa4 import ops
from fa4.config import KernelOptions
from fa4.validate import allow_any_device, check_dense

BF16 = torch.bfloat16


class _Recorder:
    def __init__(self):
        self.calls = []

    def run(self, cfg, problem, q, k, v, out, lse, cu_q, cu_k, seqused_k, seqused_q=None, page_table=None, sink=None):
        self.calls.append(dict(q=q, k=k, v=v, out=out, lse=lse))
        out.fill_(1.0)
        if lse is not None:
            lse.fill_(0.5)


def _patched(monkeypatch):
    rec = _Recorder()
    monkeypatch.setattr(ops, "_plan", lambda *a: (rec, None))
    return rec


def _kernel_ready(t):
    return t.stride(-1) == 1 and all(s % 8 == 0 for s in t.stride()[:-1])


def test_odd_stride_on_size1_dim_never_reaches_the_kernel(monkeypatch):
    rec = _patched(monkeypatch)
    base = torch.randn(1, 7, 2, 64).to(BF16)
    q = base.as_strided(base.shape, (77, 128, 64, 1))  # batch of 1 with a stride torch allows
    with allow_any_device():
        p = check_dense(q, base, base, None, False, (None, None), 0.0)
    out, lse = ops.forward(p, q, base, base, None, None, None, KernelOptions(), True)
    call = rec.calls[-1]
    assert all(_kernel_ready(call[n]) for n in ("q", "k", "v", "out")), {n: call[n].stride() for n in call if n != "lse"}
    assert call["q"].data_ptr() == q.data_ptr()  # a view, not a copy
    assert out.shape == q.shape and lse.shape == (1, 2, 7)


def test_varlen_kernels_see_4d_and_user_gets_packed_layout(monkeypatch):
    rec = _patched(monkeypatch)
    q = torch.randn(30, 4, 64).to(BF16)
    k = torch.randn(50, 2, 64).to(BF16)
    cu = torch.tensor([0, 10, 30], dtype=torch.int32)
    from fa4.validate import check_varlen

    with allow_any_device():
        p = check_varlen(q, k, k, cu, cu, 20, 40, None, None, True, (None, None), 0.0)
    out, lse = ops.forward(p, q, k, k, cu, cu, None, KernelOptions(), True)
    call = rec.calls[-1]
    assert call["q"].shape == (1, 30, 4, 64) and call["out"].shape == (1, 30, 4, 64) and call["lse"].shape == (1, 4, 30)
    assert out.shape == (30, 4, 64) and lse.shape == (4, 30)
    assert bool((out == 1.0).all()) and bool((lse == 0.5).all())


def test_empty_key_set_gives_zero_out_and_minus_inf_lse(monkeypatch):
    rec = _patched(monkeypatch)
    q = torch.randn(2, 5, 2, 64).to(BF16)
    k = torch.randn(2, 0, 2, 64).to(BF16)
    with allow_any_device():
        p = check_dense(q, k, k, None, False, (None, None), 0.0)
    out, lse = ops.forward(p, q, k, k, None, None, None, KernelOptions(), True)
    assert not rec.calls
    assert bool((out == 0).all()) and bool((lse == float("-inf")).all())


def test_launches_run_under_the_device_guard(monkeypatch):
    """Note [Device guard]: the forward, the backward and flash_attn_combine launch with their
    tensors' GPU current (tests/test_device_guard_gpu.py checks the effect on two GPUs; here, on the
    CPU, that every entry enters the guard with its tensors and launches inside it)."""
    import contextlib

    from fa4 import arch, combine

    state = {"inside": 0, "seen": []}

    @contextlib.contextmanager
    def guard(t):
        state["seen"].append(t)
        state["inside"] += 1
        try:
            yield
        finally:
            state["inside"] -= 1

    monkeypatch.setattr(arch, "device_guard", guard)
    launched_inside = []

    class Fwd:
        def run(self, *a, **k):
            launched_inside.append(("fwd", state["inside"]))

    class Bwd:
        def run_backward(self, *a, **k):
            launched_inside.append(("bwd", state["inside"]))

    q = torch.randn(1, 7, 2, 64).to(BF16)
    with allow_any_device():
        p = check_dense(q, q, q, None, False, (None, None), 0.0)
    monkeypatch.setattr(ops, "_plan", lambda *a: (Fwd(), None))
    ops.forward(p, q, q, q, None, None, None, KernelOptions(), True)
    assert state["seen"][-1] is q
    monkeypatch.setattr(ops, "_plan", lambda *a: (Bwd(), None))
    ops.backward(p, q, q, q, q, q, torch.zeros(1, 2, 7), None, None, None, None, KernelOptions(), False)
    assert state["seen"][-1] is q
    monkeypatch.setattr(combine, "combine_into", lambda *a, **k: launched_inside.append(("combine", state["inside"])))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):  # fake CUDA tensors, as tests/test_combine.py
        op = torch.empty(2, 1, 3, 2, 64, device="cuda")
        lp = torch.empty(2, 1, 3, 2, device="cuda")
        combine.flash_attn_combine(op, lp)
    assert state["seen"][-1] is op
    assert launched_inside == [("fwd", 1), ("bwd", 1), ("combine", 1)]
