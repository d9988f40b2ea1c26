"""Where the host's time of one backward call goes, piece by piece (issue 8: the bench's d128 s1k
rows, where the device waits for the host; RESULTS v0.23). Per row, the host's time per call while
the device is kept busy (:func:`bwd_profile.host_us`, three rounds of 30 calls), of:

* ``grad``: ``torch.autograd.grad`` of fa4's output, as ``fa4.bench`` times the backward;
* ``engine``: the same through a Python ``autograd.Function`` that saves the same tensors and whose
  backward only allocates dq, dk, dv: what torch's engine and a Python backward cost by themselves;
* ``ops.backward``: fa4's backward driver called directly (no autograd);
* ``driver``: the same with every kernel launch replaced by a no-op (Python and allocations);
* ``launch:<kernel>``: each compiled kernel of the call launched alone with the call's arguments;
* flash-attn-4's and cuDNN's ``grad`` for scale.

It also prints the thread the Python backward runs on (the caller's or an autograd worker's).
``python3 tools/host_breakdown.py [--profile] [d,s,causal ...]`` (default ``128,1024,1 128,1024,0``;
``--profile``: a cProfile of 50 direct ``ops.backward`` calls, by own time)."""
import statistics
import sys
import threading

import torch

import fa4
import fa4.jit
from bwd_profile import host_us, row_inputs
from host_profile import busy_profile
from fa4 import ops, validate
from fa4.bench import _results, flash_attn4_impl, sdpa_impl
from fa4.config import KernelOptions


def rounds(fn, n=3, calls=30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    return sorted(host_us(fn, calls, busy=True) for _ in range(n))


def show(name, times):
    print(f"  {name:28s} host us per call: {' / '.join(f'{t:7.1f}' for t in times)}  (median {statistics.median(times):.1f})",
          flush=True)


class Dummy(torch.autograd.Function):
    """The engine's and a Python backward's own cost: saves what fa4 saves, allocates the gradients."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def main(rows):
    for row in rows:
        d, s, causal, shape, q, k, v, dout = row_inputs(row)
        print(f"== bwd d{d} s{s} causal={bool(causal)} (b{shape.batch} h{shape.heads})", flush=True)
        ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        out, lse = fa4.flash_attn_func(ql, kl, vl, causal=bool(causal), return_lse=True)
        grad = lambda: torch.autograd.grad(out, (ql, kl, vl), dout, retain_graph=True)  # noqa: E731
        show("grad (fa4)", rounds(grad))

        seen = []
        orig_backward = ops.backward

        def spy(*a, **kw):
            seen.append(threading.get_ident())
            return orig_backward(*a, **kw)

        ops.backward = spy
        grad()
        ops.backward = orig_backward
        print(f"  the Python backward runs on the {'caller' if seen[-1] == threading.get_ident() else 'autograd worker'}'s"
              " thread", flush=True)

        dout_ = Dummy.apply(ql, kl, vl)
        show("engine (dummy Function)", rounds(lambda: torch.autograd.grad(dout_, (ql, kl, vl), dout, retain_graph=True)))

        problem = validate.check_dense(q, k, v, None, bool(causal), (None, None), 0.0)
        opts = KernelOptions()
        lse_d = lse.detach()
        direct = lambda: ops.backward(problem, dout, q, k, v, out.detach(), lse_d, None, None, None, None, opts,  # noqa: E731
                                      False)
        show("ops.backward", rounds(direct))
        if PROFILE:  # where ops.backward's host time goes (the caller's thread: no autograd worker)
            print(busy_profile(direct, 50, 25), flush=True)

        launched = []
        real_get = fa4.jit.get_kernel

        def recording_get(cfg):
            fn = real_get(cfg)

            def rec(*args):
                launched.append((type(cfg).__name__, fn, args))
                return fn(*args)
            return rec

        fa4.jit.get_kernel = recording_get
        direct()
        torch.cuda.synchronize()
        fa4.jit.get_kernel = lambda cfg: (lambda *a: None)
        show("driver (launches no-op)", rounds(direct))
        fa4.jit.get_kernel = real_get
        for name, fn, args in launched:
            show(f"launch:{name}", rounds(lambda: fn(*args)))

        for impl in (flash_attn4_impl(False), sdpa_impl("cudnn", "CUDNN_ATTENTION")):
            try:
                prepared = impl.setup(q, k, v, bool(causal), True)
                with prepared.context():
                    fn, _ = _results(prepared, "bwd", dout)
                    show(f"grad ({impl.name})", rounds(fn))
            except Exception as e:  # report and go on
                print(f"  {impl.name} ERR {type(e).__name__}: {str(e)[:160]}", flush=True)


PROFILE = "--profile" in sys.argv

if __name__ == "__main__":
    main([a for a in sys.argv[1:] if a != "--profile"] or ["128,1024,1", "128,1024,0"])
