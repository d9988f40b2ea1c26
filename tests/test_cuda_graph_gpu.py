"""fa4 on the caller's CUDA stream, and inside CUDA graphs captured once and replayed with new inputs
(the pattern of vLLM / SGLang decode steps, of ``torch.compile(mode="reduce-overhead")`` and of
whole-step capture in training).

Every kernel, workspace fill and combine must go to the current stream: a launch on another stream
reads its inputs before the stream's earlier work wrote them (the first test), and under capture it
is either an error or not recorded, so a replay would leave the outputs stale (the others). Each
result is compared with an eager call on the new inputs: bit for bit (the forward and the
deterministic backward have fixed orders), and against the float32 reference with the usual rule.
"""

from __future__ import annotations

import pytest
import torch

import fa4
from fa4.testing import attention_ref, check_close, grad_noise_floor, random_qkv
from fwd_cases import check

FAMILIES = {"sm90": fa4.KernelOptions(arch="sm90"), "sm80": fa4.KernelOptions(arch="sm80")}


@pytest.fixture(autouse=True)
def _needs_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the GPU machine with `pytest -m gpu`)")


def _family(name):
    if name == "sm90" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the sm90 kernels need compute capability 9.x")
    return FAMILIES[name]


def _capture(fn):
    """Warm ``fn`` up on a side stream (compiles, plans, the allocator's pools), then capture one call.
    Returns the graph and the call's (static) outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = fn()
    return graph, static


def _refill(tensors, seed):
    """New random values (none zero) into ``tensors`` in place."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    with torch.no_grad():
        for t in tensors:
            new = torch.randn(t.shape, generator=gen, device="cuda", dtype=torch.float32)
            t.copy_(torch.where(new == 0, 1.0, new))


def _equal(name, got, want):
    assert torch.equal(got, want), f"{name}: max |graph - eager| = {(got.float() - want.float()).abs().max().item()}"


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "sm80"])
def test_forward_and_backward_run_on_the_current_stream(family):
    """A side stream sleeps, then writes new q / k / v, then calls fa4 (forward, deterministic
    backward): the results are those of the new inputs, so every launch waited for the writes."""
    opts = _family(family)
    q, k, v = random_qkv(2, 1000, 1000, 8, 2, 128, torch.bfloat16, "cuda", seed=1, requires_grad=True)
    new = [t.detach().clone() for t in (q, k, v)]
    _refill(new, seed=2)
    g = torch.randn(2, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    # Compile and plan everything first: the sleep must cover the launches, not a compile.
    warm, _ = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True, kernel_options=opts)
    torch.autograd.grad(warm, (q, k, v), g)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # about 0.1 s: any launch on another stream runs first
        with torch.no_grad():
            for t, n in zip((q, k, v), new):
                t.copy_(n)
        out, lse = fa4.flash_attn_func(q, k, v, causal=True, deterministic=True, return_lse=True,
                                       kernel_options=opts)
        grads = torch.autograd.grad(out, (q, k, v), g)
    torch.cuda.synchronize()
    leaves = [n.clone().requires_grad_() for n in new]
    want, want_lse = fa4.flash_attn_func(*leaves, causal=True, deterministic=True, return_lse=True,
                                         kernel_options=opts)
    want_grads = torch.autograd.grad(want, leaves, g)
    _equal("out", out, want)
    _equal("lse", lse, want_lse)
    for name, a, b in zip(("dq", "dk", "dv"), grads, want_grads):
        _equal(name, a, b)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("case", ["dense_causal", "varlen", "local_softcap_gqa"])
def test_forward_graph_replay(family, case):
    """A captured forward replayed on new q / k / v gives the eager call's bits."""
    opts = _family(family)
    if case == "varlen":
        lens = [1, 113, 700, 203]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v = random_qkv(1, sum(lens), sum(lens), 8, 8, 96, torch.float16, "cuda", seed=3)
        q, k, v = (t[0] for t in (q, k, v))
        kw = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lens), max_seqlen_k=max(lens), causal=True)
        call = lambda: fa4.flash_attn_varlen_func(q, k, v, return_lse=True, kernel_options=opts, **kw)  # noqa: E731
    else:
        local = case == "local_softcap_gqa"
        q, k, v = random_qkv(2, 333, 1000, 8, 2 if local else 8, 64 if local else 128, torch.bfloat16, "cuda",
                             seed=4)
        kw = dict(window_size=(100, 20), softcap=3.0) if local else dict(causal=True)
        call = lambda: fa4.flash_attn_func(q, k, v, return_lse=True, kernel_options=opts, **kw)  # noqa: E731
    graph, (out, lse) = _capture(call)
    for seed in (5, 6):
        _refill((q, k, v), seed)
        graph.replay()
        want, want_lse = call()
        torch.cuda.synchronize()
        _equal("out", out, want)
        _equal("lse", lse, want_lse)
    if case == "varlen":
        for i in range(len(lens)):
            rows = slice(int(cu[i]), int(cu[i + 1]))
            check(out[rows][None], lse[:, rows][None], q[rows][None], k[rows][None], v[rows][None], causal=True)
    else:
        check(out, lse, q, k, v, **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["sm90", "sm80"])
@pytest.mark.parametrize("num_splits", [None, 3])
def test_paged_decode_graph_replay(family, num_splits):
    """vLLM's decode step: one query per sequence, a paged KV cache of 16-row pages, seqused_k and the
    page table rewritten between replays (the split-KV count is the capture's: it reads shapes only;
    ``None``: the heuristic's, 3: split-KV and its combine for sure)."""
    opts = _family(family)
    b, h, hk, d, page, max_pages = 8, 32, 8, 128, 16, 128
    num_pages = b * max_pages + 7
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
    kc = torch.randn(num_pages, page, hk, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn(num_pages, page, hk, d, device="cuda", dtype=torch.bfloat16)
    table = torch.empty(b, max_pages, dtype=torch.int32, device="cuda")
    used = torch.empty(b, dtype=torch.int32, device="cuda")

    def new_step(seed):
        g = torch.Generator().manual_seed(seed)
        table.copy_(torch.randperm(num_pages, generator=g)[:b * max_pages].view(b, max_pages).to(torch.int32))
        lens = torch.randint(1, page * max_pages + 1, (b,), generator=g)
        lens[0] = page * max_pages
        used.copy_(lens.to(torch.int32))
        _refill((q,), seed)
        return lens.tolist()

    new_step(8)
    call = lambda: fa4.flash_attn_varlen_func(q, kc, vc, page_table=table, seqused_k=used,  # noqa: E731
                                              num_splits=num_splits, return_lse=True, kernel_options=opts)
    graph, (out, lse) = _capture(call)
    for seed in (9, 10):
        lens = new_step(seed)
        graph.replay()
        want, want_lse = call()
        torch.cuda.synchronize()
        _equal("out", out, want)
        _equal("lse", lse, want_lse)
    for i, n in enumerate(lens):
        pages = table[i].long()
        k_i = kc[pages].reshape(1, -1, hk, d)[:, :n]
        v_i = vc[pages].reshape(1, -1, hk, d)[:, :n]
        check(out[i:i + 1], lse[i:i + 1], q[i:i + 1], k_i, v_i)


@pytest.mark.gpu
@pytest.mark.parametrize("family,d,deterministic", [("sm90", 128, True), ("sm90", 128, False), ("sm90", 256, True),
                                                     ("sm90", 64, False), ("sm80", 128, True)])
def test_training_step_graph_replay(family, d, deterministic):
    """A captured forward + backward (``torch.autograd.grad``) replayed on new q / k / v / dout: the
    deterministic backward gives the eager call's bits, the other passes the reference rule (its dQ
    adds are unordered); d256 runs the dQ pass, d128 deterministic the ordered writer."""
    opts = _family(family)
    q, k, v = random_qkv(2, 777, 1000, 8, 2, d, torch.bfloat16, "cuda", seed=d, requires_grad=True)
    g = torch.randn(2, 777, 8, d, device="cuda", dtype=torch.bfloat16)

    def step():
        out, _ = fa4.flash_attn_func(q, k, v, causal=True, deterministic=deterministic, kernel_options=opts)
        return (out,) + torch.autograd.grad(out, (q, k, v), g)

    graph, static = _capture(step)
    for seed in (11, 12):
        _refill((q, k, v, g), seed)
        graph.replay()
        want = step()
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "dq", "dk", "dv"), static, want):
            if deterministic or name == "out":
                _equal(name, a, b)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = attention_ref(q32, k32, v32, causal=True)[0]
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), g.float())
    qp, kp, vp = (t.detach().clone().requires_grad_() for t in (q, k, v))
    pt = attention_ref(qp, kp, vp, causal=True, upcast=False)[0]
    pt_grads = torch.autograd.grad(pt, (qp, kp, vp), g)
    check_close("out", static[0], ref, pt)
    floors = grad_noise_floor(q, k, v, g)  # Note [gradient cancellation floor], as tests/test_bwd_gpu.py
    for name, a, r, p in zip(("dq", "dk", "dv"), static[1:], ref_grads, pt_grads):
        check_close(name, a, r, p, extra_atol=floors[name])
