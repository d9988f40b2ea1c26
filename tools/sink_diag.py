"""GPU diagnosis of the learnable-sink gradient (RESULTS v0.6 open bug): for the cases of
tests/test_flash_attn_cute_calls_gpu.py::test_learnable_sink_forward_and_backward, the dsink error
against the float32 reference of
  fa4          fa4's learnable_sink (in the kernels' softmax since v0.9; composed on the host before),
  exact->bf16  the float32 attention (no sink) rounded to bf16, composed the same way,
  pt bf16      PyTorch in bf16 with an explicit sink column (the test's baseline),
  pt composed  PyTorch's bf16 attention without the sink, composed like fa4,
  flash-attn-4 its own learnable_sink (n/a when not installed or unsupported),
and the out error (no sink) of fa4 and of PyTorch bf16.

    python tools/sink_diag.py
"""

import sys

import torch

sys.path.insert(0, "tests")
import fa4  # noqa: E402
from fa4.interface import _apply_sink  # noqa: E402
from fa4.testing import attention_ref, random_qkv  # noqa: E402
from test_flash_attn_cute_calls_gpu import _sink_ref  # noqa: E402  (the test's explicit sink column)


def dsink_of(out, lse, sink, g):
    s = sink.detach().clone().requires_grad_()
    o, _ = _apply_sink(out.detach(), lse.detach(), s, False, False)
    return torch.autograd.grad(o, s, g)[0]


def main():
    b, h, hk, d = 2, 8, 2, 64
    print(f"{'case':<22} {'bound':>8} {'fa4':>8} {'ex->bf16':>8} {'pt bf16':>8} {'pt comp':>8} "
          f"{'FA4':>8} {'out fa4':>8} {'out pt':>8} {'|dsink|':>8}")
    for family in ("sm90", "sm80"):
        for causal in (False, True):
            for sq, sk in ((1, 500), (77, 300), (300, 77)):
                q, k, v = random_qkv(b, sq, sk, h, hk, d, torch.bfloat16, "cuda", seed=sq, requires_grad=True)
                torch.manual_seed(sq + 1000 * causal)
                sink = (torch.randn(h, device="cuda") * 2).requires_grad_()
                out, lse = fa4.flash_attn_func(q, k, v, causal=causal, learnable_sink=sink, return_lse=True,
                                               kernel_options=fa4.KernelOptions(arch=family))
                g = torch.randn_like(out)
                ref, _ = _sink_ref(q, k, v, sink, causal, True)
                want = torch.autograd.grad(ref, sink, g.float())[0]
                pt, _ = _sink_ref(q, k, v, sink, causal, False)
                want_pt = torch.autograd.grad(pt, sink, g)[0]
                o_k, l_k = fa4.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=causal, return_lse=True,
                                               kernel_options=fa4.KernelOptions(arch=family))
                qd, kd, vd = q.detach(), k.detach(), v.detach()
                o_ex, l_ex = attention_ref(qd, kd, vd, causal=causal)  # rows with no key: 0 / -inf
                o_pt, l_pt = attention_ref(qd, kd, vd, causal=causal, upcast=False)
                err = lambda x: (x.float() - want).abs().max().item()  # noqa: E731
                e_fa4 = err(torch.autograd.grad(out, sink, g)[0])
                e_ex = err(dsink_of(o_ex.bfloat16(), l_ex, sink, g))
                e_pc = err(dsink_of(o_pt, l_pt, sink, g))
                bound = 2 * err(want_pt) + 1e-3 * want.abs().max().item()
                try:
                    from flash_attn.cute import flash_attn_func as peer

                    s2 = sink.detach().clone().requires_grad_()
                    o2 = peer(q, k, v, causal=causal, learnable_sink=s2)
                    o2 = o2[0] if isinstance(o2, tuple) else o2
                    e_peer = f"{err(torch.autograd.grad(o2, s2, g)[0]):8.1e}"
                except Exception as ex:  # noqa: BLE001 - report and go on
                    e_peer = f"{'n/a':>8}"
                    if family == "sm90" and not causal and sq == 1:
                        print("flash-attn-4:", type(ex).__name__, str(ex)[:200])
                oe = (o_k.float() - o_ex).abs().max().item()
                op = (o_pt.float() - o_ex).abs().max().item()
                flag = " FAIL" if e_fa4 > bound else ""
                print(f"{family} c{int(causal)} {sq:>4}x{sk:<4}     {bound:8.1e} {e_fa4:8.1e} {e_ex:8.1e} "
                      f"{err(want_pt):8.1e} {e_pc:8.1e} {e_peer} {oe:8.1e} {op:8.1e} {want.abs().max().item():8.1e}{flag}",
                      flush=True)


if __name__ == "__main__":
    main()
