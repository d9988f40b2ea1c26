"""Forward calls for ncu on the device: fa4 (default path) or flash-attn-4 (``peer``), one shape
each, warm-up first so the profiled launch is a steady one::

    ncu --clock-control none --kernel-name regex:'(?i)(fwd|forward)' --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats python3 tools/ncu_fwd.py fa4 128,8192,0

``fa4:field=value,...`` runs fa4 with :class:`fa4.fwd.sm90.FwdSm90Config` fields overridden (e.g.
``fa4:pingpong=True,rescale_o_before_pv=True``), as ``tools/sweep_fwd.py`` does.

Shapes ``d,s,causal`` (bf16, b*s = 16k tokens, h*d = 2048, FlashAttention's grid); default d128 s8192;
``d,s,0,left`` is a sliding window ``(left, 0)`` instead of causal.
A dense case of ``fa4.offgrid`` by name (e.g. ``mods-docmask-d128``, the document mask_mod with its
aux tensor) runs that case instead, with its user functions, for both implementations."""
import sys

import torch

impl = sys.argv[1] if len(sys.argv) > 1 else "fa4"
shapes = [a if not a[0].isdigit() else tuple(int(x) for x in a.split(",")) for a in sys.argv[2:]] or [(128, 8192, 0)]
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
for shape in shapes:
    if isinstance(shape, str):  # an off-grid case, dense (not varlen), with its user functions
        from fa4 import offgrid

        q, k, v, _, _, causal, varlen, _ = offgrid.build(offgrid.CASES[shape])
        assert not varlen, f"{shape}: dense off-grid cases only"
        extra = offgrid.USER_FUNCS[shape][1](q) if shape in offgrid.USER_FUNCS else {}
    else:
        d, s, causal, *left = shape
        b, h = 16384 // s, 2048 // d
        q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        extra = {"window_size": (left[0], 0)} if left else {}
    for _ in range(3):
        flash_attn_func(q, k, v, causal=bool(causal), **extra)
    torch.cuda.synchronize()
print("done")
