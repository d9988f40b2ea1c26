"""Learnable sinks on the host side (CPU): the gradient formula the eager backward uses (Note
[Attention sinks in the softmax] in fa4/softmax.py) against autograd of attention with an explicit
sink column, and the launcher handing the kernel its sink."""

import pytest
import torch

from fa4 import jit, ops, validate
from fa4.fwd import sm80, sm90


def _attn_with_sink(q, k, v, sink):
    """(out, lse) of softmax([q k^T * d^-0.5, sink]) @ [v, 0] in float64; q (b, s, h, d)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    col = sink[None, :, None, None].expand(s.shape[0], -1, s.shape[2], 1)
    full = torch.cat([s, col], -1)
    lse = torch.logsumexp(full, -1)  # (b, h, s)
    p = torch.exp(full - lse[..., None])[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


@pytest.mark.parametrize("with_dlse", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_sink_grad_matches_autograd(with_dlse, packed):
    torch.manual_seed(0)
    b, s, h, d = 2, 37, 3, 16
    q, k, v = (torch.randn(b, s, h, d, dtype=torch.float64) for _ in range(3))
    sink = (torch.randn(h, dtype=torch.float64) * 2).requires_grad_()
    out, lse = _attn_with_sink(q, k, v, sink)
    dout = torch.randn_like(out)
    dlse = torch.randn_like(lse) if with_dlse else None
    loss = (out * dout).sum() + ((lse * dlse).sum() if with_dlse else 0.0)
    (want,) = torch.autograd.grad(loss, sink)
    out, lse = out.detach(), lse.detach()
    if packed:  # the varlen layouts: out (total, h, d), lse (h, total)
        out, dout = out.reshape(b * s, h, d), dout.reshape(b * s, h, d)
        lse = lse.permute(1, 0, 2).reshape(h, b * s)
        dlse = dlse.permute(1, 0, 2).reshape(h, b * s) if with_dlse else None
    got = ops.sink_grad(sink.detach(), out, dout, lse, dlse, packed)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_sink_grad_rows_without_keys():
    """A row whose lse is -inf (no key and a -inf sink) contributes nothing (not NaN)."""
    sink = torch.tensor([-torch.inf, 0.5])
    out = torch.zeros(1, 2, 2, 4)
    lse = torch.tensor([[[-torch.inf, -torch.inf], [0.5, 0.5]]])
    got = ops.sink_grad(sink, out, torch.ones_like(out), lse, None, False)
    assert torch.equal(got, torch.zeros(2))


@pytest.mark.parametrize("mod", [sm80, sm90])
def test_run_passes_the_sink(monkeypatch, mod):
    calls = []
    monkeypatch.setattr(jit, "get_kernel", lambda cfg: lambda *a: calls.append(a))
    monkeypatch.setattr(sm90, "_num_sms", lambda device: 132)
    q, k, v = (torch.empty(2, 100, h, 64, dtype=torch.bfloat16) for h in (4, 2, 2))
    with validate.allow_any_device():
        problem = validate.check_dense(q, k, v, 0.125, True, (None, None), 0.0)
    import dataclasses

    problem = dataclasses.replace(problem, has_sink=True)
    cfg = mod.make_config(problem, None, "sm_90a" if mod is sm90 else "sm_80", True)
    assert cfg.has_sink
    sink = torch.randn(4)
    mod.run(cfg, problem, q, k, v, torch.empty_like(q), torch.empty(2, 4, 100), sink=sink)
    (args,) = calls
    assert args[10] is sink
    assert len(args) == len(jit.kernel_class(cfg).fake_args(cfg)) - 1
