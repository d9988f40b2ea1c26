"""Forward calls for ncu on the device: fa4 (default path) or flash-attn-4 (``peer``), one shape
each, warm-up first so the profiled launch is a steady one::

    ncu --clock-control none --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/ncu_fwd.py fa4 128,8192,0

``fa4:field=value,...`` runs fa4 with :class:`fa4.fwd.sm90.FwdSm90Config` fields overridden (e.g.
``fa4:pingpong=True,rescale_o_before_pv=True``), as ``tools/sweep_fwd.py`` does.

Shapes ``d,s,causal`` (bf16, b*s = 16k tokens, h*d = 2048, FlashAttention's grid); default d128 s8192."""
import sys

import torch

impl = sys.argv[1] if len(sys.argv) > 1 else "fa4"
shapes = [tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(128, 8192, 0)]
if impl == "peer":
    from flash_attn.cute import flash_attn_func
else:
    from fa4 import flash_attn_func

    if ":" in impl:
        import ast
        import dataclasses

        import fa4.fwd.sm90 as fam
        from fa4 import ops

        fields = {k: ast.literal_eval(v) for k, v in (i.split("=", 1) for i in impl.split(":", 1)[1].split(","))}
        make = fam.make_config
        fam.make_config = lambda *a, **kw: dataclasses.replace(make(*a, **kw), **fields)
        ops._plans.clear()
for d, s, causal in shapes:
    b, h = 16384 // s, 2048 // d
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    for _ in range(3):
        flash_attn_func(q, k, v, causal=bool(causal))
    torch.cuda.synchronize()
print("done")
