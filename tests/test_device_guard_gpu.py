"""Tensors on a GPU other than the current one (Note [Device guard] in fa4/arch.py): with cuda:0
current, calls on cuda:1 tensors give the bits of the same calls on cuda:0 (the forward, the
deterministic backward, a split-KV decode step with its combine, ``flash_attn_combine``). Needs two
GPUs of one kind; skips otherwise."""

from __future__ import annotations

import contextlib

import pytest
import torch

import fa4
from fa4.arch import device_guard
from fa4.testing import random_qkv


def test_device_guard_is_a_no_op_off_the_gpu():
    assert isinstance(device_guard(torch.empty(2)), contextlib.nullcontext)
    assert isinstance(device_guard(torch.empty(2, device="meta")), contextlib.nullcontext)


def _two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs (run on a two-GPU machine with `pytest -m gpu`)")
    if torch.cuda.get_device_capability(0) != torch.cuda.get_device_capability(1):
        pytest.skip("needs two GPUs of one compute capability")


def _run(q, k, v, g, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fa4.flash_attn_func(*leaves, return_lse=True, deterministic=True, **kw)
    return (out, lse) + torch.autograd.grad(out, leaves, g)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["sm90", "sm80"])
def test_calls_on_a_gpu_that_is_not_current(arch):
    _two_gpus()
    if arch == "sm90" and torch.cuda.get_device_capability(0)[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    opts = fa4.KernelOptions(arch=arch)
    torch.cuda.set_device(0)
    q, k, v = random_qkv(2, 700, 900, 8, 2, 128, torch.bfloat16, "cuda:0", seed=1)
    g = torch.randn(2, 700, 8, 128, device="cuda:0", dtype=torch.bfloat16)
    want = _run(q, k, v, g, causal=True, kernel_options=opts)
    got = _run(*(t.to("cuda:1") for t in (q, k, v, g)), causal=True, kernel_options=opts)
    assert torch.cuda.current_device() == 0
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.device == torch.device("cuda:1"), name
        assert torch.equal(a.cpu(), b.cpu()), f"{name} on cuda:1 differs from cuda:0"

    # A decode step with split-KV (and its combine), then flash_attn_combine on its own.
    qd, kd, vd = random_qkv(4, 1, 6000, 32, 8, 128, torch.bfloat16, "cuda:0", seed=2)
    want = fa4.flash_attn_func(qd, kd, vd, num_splits=4, return_lse=True, kernel_options=opts)
    got = fa4.flash_attn_func(*(t.to("cuda:1") for t in (qd, kd, vd)), num_splits=4, return_lse=True,
                              kernel_options=opts)
    for name, a, b in zip(("out", "lse"), got, want):
        assert a.device == torch.device("cuda:1"), name
        assert torch.equal(a.cpu(), b.cpu()), f"split-KV {name} on cuda:1 differs from cuda:0"
    op = torch.randn(3, 2, 50, 8, 64, device="cuda:0")
    lp = torch.randn(3, 2, 50, 8, device="cuda:0")
    want = fa4.flash_attn_combine(op, lp, out_dtype=torch.bfloat16)
    got = fa4.flash_attn_combine(op.to("cuda:1"), lp.to("cuda:1"), out_dtype=torch.bfloat16)
    for name, a, b in zip(("out", "lse"), got, want):
        assert a.device == torch.device("cuda:1"), name
        assert torch.equal(a.cpu(), b.cpu()), f"combine {name} on cuda:1 differs from cuda:0"
