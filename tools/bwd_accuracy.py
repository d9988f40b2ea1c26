"""Accuracy of sm90 backward config variants against the float32 reference (issue 8: a speed
technique may not make the error larger than the same kernel with it off, beyond noise).

    python tools/bwd_accuracy.py "d64" "d64 tile_m=128 ds_from_p16=True" ...

An experiment: ``d<head_dim> [causal] [peer] [field=value ...]`` (fields override make_config;
``peer`` runs flash-attn-4's ``flash_attn.cute`` on the same inputs instead of fa4). Each runs
on three seeds of (b 2, s_q 1000, s_k 777, 6 q / 2 kv heads) and at two score scales (randn inputs,
and x3 for peaked softmaxes); prints the max |error| of dq, dk, dv against the float32 reference and
the ratio to the first experiment of its head dim.
"""

import ast
import dataclasses
import sys

import torch

import fa4
from fa4.bwd import sm90
from fa4.testing import attention_ref, random_qkv


def parse(text):
    shape, over = dict(d=128, causal=False, peer=False), {}
    for w in text.split():
        if w in ("causal", "peer"):
            shape[w] = True
        elif "=" in w:
            k, v = w.split("=", 1)
            over[k] = ast.literal_eval(v)
        elif w[0] == "d" and w[1:].isdigit():
            shape["d"] = int(w[1:])
        else:
            raise ValueError(f"bad word {w!r}")
    return shape, over


def errors(shape, over):
    over = dict(over)  # dq_pass= through KernelOptions.bwd_dq_pass (the deterministic config goes with it)
    opts = fa4.KernelOptions(arch="sm90", bwd_dq_pass=over.pop("dq_pass", None))
    make = sm90.make_config
    sm90.make_config = lambda *a, **k: dataclasses.replace(make(*a, **k), **over)
    fa4.ops._plans.clear()
    worst = [0.0, 0.0, 0.0]
    try:
        for seed in (1, 2, 3):
            for scale in (1.0, 3.0):
                q, k, v = random_qkv(2, 1000, 777, 6, 2, shape["d"], torch.bfloat16, "cuda", seed=seed)
                q = (q.float() * scale).bfloat16()
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                if shape["peer"]:
                    from flash_attn.cute import flash_attn_func as peer
                    out = peer(q, k, v, causal=shape["causal"])
                    out = out[0] if isinstance(out, tuple) else out
                else:
                    out, _ = fa4.flash_attn_func(q, k, v, causal=shape["causal"],
                                                 kernel_options=opts)
                torch.manual_seed(seed)
                g = torch.randn_like(out)
                got = torch.autograd.grad(out, (q, k, v), g)
                ref = attention_ref(q.float(), k.float(), v.float(), causal=shape["causal"])
                ref = ref[0] if isinstance(ref, tuple) else ref
                want = torch.autograd.grad(ref, (q, k, v), g.float())
                for i in range(3):
                    worst[i] = max(worst[i], (got[i].float() - want[i].float()).abs().max().item())
    finally:
        sm90.make_config = make
        fa4.ops._plans.clear()
    return worst


def main():
    base = {}
    print(f"{'experiment':<44} {'dq':>9} {'dk':>9} {'dv':>9}  ratio to the first of its head dim")
    for text in sys.argv[1:]:
        shape, over = parse(text)
        try:
            e = errors(shape, over)
        except Exception as ex:  # report, go on
            print(f"{text:<44} ERR {type(ex).__name__}: {str(ex)[:200]}", flush=True)
            continue
        b = base.setdefault((shape["d"], shape["causal"]), e)
        ratio = " ".join(f"{x / y:5.2f}" for x, y in zip(e, b))
        print(f"{text:<44} {e[0]:9.2e} {e[1]:9.2e} {e[2]:9.2e}  {ratio}", flush=True)


if __name__ == "__main__":
    main()
