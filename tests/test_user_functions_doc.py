"""The examples of docs/USER_FUNCTIONS.md run and compile (CPU): every ``python`` block executes,
and every function it defines compiles into the sm90 forward and backward (a score_mod with the
``*_bwd`` of the same name as its derivative), so the guide cannot drift from what works."""

from __future__ import annotations

import inspect
import os
import re

import pytest

from fa4 import mods
from fa4.config import AttnProblem

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "USER_FUNCTIONS.md")
# The aux tensors the examples read ((dtype, ndim) each): the guide says what to pass.
AUX = {"same_document": (("int32", 2),), "causal_same_document": (("int32", 2),),
       "relative_bias": (("float32", 2),), "sliding_band": (("int32", 0),)}


def _functions() -> dict:
    """name -> function, of every block of the guide (each block a module of its own in a temporary
    directory: the DSL reads a function's source from its file)."""
    import atexit
    import importlib.util
    import shutil
    import tempfile

    blocks = re.findall(r"```python\n(.*?)```", open(DOC).read(), flags=re.S)
    assert len(blocks) >= 5
    found = {}
    folder = tempfile.mkdtemp(prefix="fa4-guide-")
    atexit.register(shutil.rmtree, folder, True)  # (kept while the tests compile: the DSL reads it)
    for i, code in enumerate(blocks):
        path = os.path.join(folder, f"guide_block_{i}.py")
        with open(path, "w") as f:
            f.write(code)
        spec = importlib.util.spec_from_file_location(f"guide_block_{i}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        found.update({name: value for name, value in vars(module).items()
                      if callable(value) and hasattr(value, "__wrapped__") and not name.startswith("make_")})
    return found


FUNCTIONS = _functions()


def _kind(fn) -> str:
    first = next(iter(inspect.signature(inspect.unwrap(fn)).parameters))
    return {"scores": "score_mod", "grad": "score_mod_bwd", "b": "mask_mod"}[first]


def test_the_guide_defines_each_kind():
    kinds = {_kind(f) for f in FUNCTIONS.values()}
    assert kinds == {"score_mod", "score_mod_bwd", "mask_mod"}
    for name, fn in FUNCTIONS.items():
        if _kind(fn) == "score_mod":
            assert name + "_bwd" in FUNCTIONS, f"{name} has no derivative in the guide"


@pytest.mark.parametrize("name", sorted(n for n, f in FUNCTIONS.items() if _kind(f) != "score_mod_bwd"))
def test_the_guide_compiles(name):
    from fa4 import jit
    from fa4.bwd import sm90 as bwd90
    from fa4.fwd import sm90

    fn = FUNCTIONS[name]
    kw = dict(aux=AUX.get(name, ()))
    if _kind(fn) == "score_mod":
        kw.update(score_mod=mods.key_of(fn, "score_mod"),
                  score_mod_bwd=mods.key_of(FUNCTIONS[name + "_bwd"], "score_mod_bwd"))
    else:
        kw.update(mask_mod=mods.key_of(fn, "mask_mod"))
    p = AttnProblem("bf16", 2, 1000, 1000, 4, 2, 64, 64, 0.125, **kw)
    jit.compile_uncached(sm90.make_config(p, None, "sm_90a", True), engine=False)
    jit.compile_uncached(bwd90.make_config(p, None, "sm_90a", False), engine=False)
