"""flash_attn.cute's block_sparse_tensors (fa4/block_sparse.py), on the CPU: the block table, the
checks before any launch, and the kernels' compile with the table's mask function."""

from __future__ import annotations

import math

import pytest
import torch

import fa4
from fa4 import block_sparse, mods
from fa4.config import AttnProblem
from mods_cases import BlockSparseTensorsTorch, MASK_MODS, random_block_sparse


def _slow_table(bst, batch, heads, seqlen_q, seqlen_k, block):
    """The table by loops over the lists (entries past a count, or outside [0, Nb), are dropped)."""
    mb, nb = math.ceil(seqlen_q / block[0]), math.ceil(seqlen_k / block[1])
    out = torch.zeros(batch, heads, mb, nb, dtype=torch.int8)
    for cnt, idx, mark in ((bst.mask_block_cnt, bst.mask_block_idx, 1), (bst.full_block_cnt, bst.full_block_idx, 2)):
        if cnt is None:
            continue
        for b in range(batch):
            for h in range(heads):
                for m in range(mb):
                    c = cnt[min(b, cnt.shape[0] - 1), min(h, cnt.shape[1] - 1), m]
                    for j in range(int(c)):
                        n = int(idx[min(b, idx.shape[0] - 1), min(h, idx.shape[1] - 1), m, j])
                        if 0 <= n < nb:
                            out[b, h, m, n] = mark
    return out


@pytest.mark.parametrize("heads_broadcast", [False, True])
@pytest.mark.parametrize("block", [(128, 128), (64, 192), (100, 37)])
def test_table_matches_the_lists(block, heads_broadcast):
    bst, state = random_block_sparse(2, 3, 300, 500, block, "cpu", seed=block[1], heads_broadcast=heads_broadcast)
    t = block_sparse.table(bst, 2, 3, 300, 500, block)
    assert t.shape == (2, 3, math.ceil(300 / block[0]), math.ceil(500 / block[1])) and t.dtype == torch.int8
    assert torch.equal(t.int(), state.int())
    assert torch.equal(t, _slow_table(bst, 2, 3, 300, 500, block))


def test_table_drops_indices_out_of_range_and_past_the_count():
    cnt = torch.tensor([[[3, 1]]], dtype=torch.int32)
    idx = torch.tensor([[[[0, 9, -2, 1], [1, 0, 0, 0]]]], dtype=torch.int32)  # 9, -2: outside; row 1: one entry
    bst = BlockSparseTensorsTorch(cnt, idx, block_size=(64, 64))
    t = block_sparse.table(bst, 1, 1, 128, 256, (64, 64))
    assert t.tolist() == [[[[1, 0, 0, 0], [0, 1, 0, 0]]]]
    assert torch.equal(t, _slow_table(bst, 1, 1, 128, 256, (64, 64)))


def _bst(**over):
    bst, _ = random_block_sparse(2, 4, 300, 500, (128, 128), "cpu", seed=1)
    return bst._replace(**over)


def test_checks():
    dev = torch.device("cpu")
    ok = _bst()
    assert block_sparse.check(ok, None, 2, 4, 300, 500, dev) == (128, 128)
    cases = [
        (dict(mask_block_cnt=ok.mask_block_cnt.long()), TypeError, "must be int32"),
        (dict(mask_block_idx=ok.mask_block_idx[..., 0]), ValueError, "must have 4 dimensions"),
        (dict(mask_block_cnt=ok.mask_block_cnt[:, :, :2]), ValueError, "expected 3"),
        (dict(full_block_idx=ok.full_block_idx.repeat(1, 2, 1, 1)), ValueError, "expected 4 or 1"),
        (dict(full_block_cnt=None, full_block_idx=ok.full_block_idx), TypeError, "full_block_cnt must be a torch"),
        (dict(block_size=(128,)), ValueError, "pair of positive ints"),
        (dict(block_size=(128, 0)), ValueError, "pair of positive ints"),
        (dict(cu_total_m_blocks=ok.mask_block_cnt), NotImplementedError, "cu_total_m_blocks"),
        (dict(dq_write_order=ok.mask_block_cnt), NotImplementedError, "dq_write_order"),
        (dict(block_size=(64, 128)), ValueError, "expected 5"),
    ]
    for over, err, match in cases:
        with pytest.raises(err, match=match):
            block_sparse.check(ok._replace(**over), None, 2, 4, 300, 500, dev)
    assert block_sparse.check(ok._replace(block_size=None), None, 2, 4, 300, 500, dev) == (128, 128)
    with pytest.raises(ValueError, match="only at head dim 128 with ceil"):
        block_sparse.check(ok._replace(block_size=None), None, 2, 4, 700, 500, dev)
    with pytest.raises(ValueError, match=r"\(head dim 256, 3 q blocks\); pass block_size"):
        block_sparse.check(ok._replace(block_size=None), None, 2, 4, 300, 500, dev, head_dim=256)
    assert block_sparse.check(ok._replace(spt=False), None, 2, 4, 300, 500, dev) == (128, 128)
    with pytest.raises(NotImplementedError, match="spt"):
        block_sparse.check(ok._replace(spt=True), None, 2, 4, 300, 500, dev)
    with pytest.raises(ValueError, match="block_sparse_tensors_bwd without block_sparse_tensors"):
        block_sparse.check(None, ok, 2, 4, 300, 500, dev)
    with pytest.raises(TypeError, match="BlockSparseTensorsTorch-like"):
        block_sparse.check((ok.mask_block_cnt, ok.mask_block_idx), None, 2, 4, 300, 500, dev)
    bwd, _ = random_block_sparse(2, 4, 500, 300, (128, 128), "cpu", seed=2)  # rows: K blocks
    assert block_sparse.check(ok, bwd, 2, 4, 300, 500, dev) == (128, 128)
    with pytest.raises(ValueError, match="block_sparse_tensors_bwd.mask_block_cnt has 3 rows"):
        block_sparse.check(ok, ok, 2, 4, 300, 500, dev)


def test_api_takes_block_sparse_tensors_before_launch():
    """Through flash_attn_func (CPU tensors, the device check lifted): the checks run and the call gets
    past validation (then fails: no GPU); varlen
    refuses them; a user mask_mod with causal is refused as without block sparsity, while the
    table alone combines with causal."""
    from fa4 import validate

    block_sparse._warned.clear()
    q = torch.empty(2, 300, 4, 64, dtype=torch.bfloat16)
    k = torch.empty(2, 500, 4, 64, dtype=torch.bfloat16)
    bst = _bst()
    with validate.allow_any_device():
        # Past every check, the call reaches the device (a CPU-only torch: "not compiled with CUDA").
        with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda|device"):
            fa4.flash_attn_func(q, k, k, block_sparse_tensors=bst, causal=True)
        with pytest.raises(ValueError, match="ignores causal and window_size"):
            fa4.flash_attn_func(q, k, k, block_sparse_tensors=bst, mask_mod=MASK_MODS["doc64"]()[0], causal=True)
        with pytest.raises(ValueError, match="has 3 rows of blocks; expected 2"):
            fa4.flash_attn_func(q[:, :200], k, k, block_sparse_tensors=bst)
        cu = torch.tensor([0, 300], dtype=torch.int32)
        with pytest.raises(NotImplementedError, match="block_sparse_tensors"):
            fa4.flash_attn_varlen_func(q[0], k[0], k[0], cu_seqlens_q=cu, cu_seqlens_k=torch.tensor([0, 500]).int(),
                                       block_sparse_tensors=bst)


def test_mask_function_is_one_object_per_arguments():
    """torch.compile guards on the mask function's identity: the same arguments give the same object."""
    um = MASK_MODS["doc64"]()[0]
    assert block_sparse.table_mask(um, 128, 128, 0, False) is block_sparse.table_mask(um, 128, 128, 0, False)
    assert block_sparse.table_mask(um, 128, 128, 0, False) is not block_sparse.table_mask(um, 128, 64, 0, False)
    keys = {mods.key_of(block_sparse.table_mask(m, 128, 128, 1, s), "mask_mod")
            for m in (None, um) for s in (False, True)}
    assert len(keys) == 4


def test_explain_names_the_paths_that_skip():
    q = torch.empty(2, 300, 4, 64, dtype=torch.bfloat16, device="meta")
    ex = fa4.explain(q, q, q, capability=(9, 0), block_sparse_tensors=_bst())
    assert any("the sm90 forward skips the hidden blocks" in n for n in ex.notes)


def test_dense_paths_warn_once_per_direction():
    block_sparse._warned.clear()
    for direction in ("forward", "backward"):
        with pytest.warns(UserWarning, match=f"in the {direction} .*every block is computed"):
            block_sparse.warn_dense(direction, "X")
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block_sparse.warn_dense("forward", "X")


@pytest.mark.parametrize("kind", ["fwd90", "fwd90_user_scalars", "bwd90", "bwd90_d256", "fwd80", "bwd80"])
def test_table_mask_compiles(kind):
    """The mask function of a block-sparse call (the table alone, or around a user mask_mod, with
    aux scalars) compiles in every family and direction, with causal."""
    from mods_cases import scalar_alibi_band

    from fa4 import jit
    from fa4.bwd import sm80 as bwd80
    from fa4.bwd import sm90 as bwd90
    from fa4.fwd import sm80, sm90

    bst, _ = random_block_sparse(2, 4, 300, 500, (128, 64), "cpu", seed=3)
    table = block_sparse.table(bst, 2, 4, 300, 500, (128, 64))
    scalars = (0.1, 40) if kind == "fwd90_user_scalars" else None
    user = scalar_alibi_band()[2] if scalars else (MASK_MODS["head_parity"]()[0] if kind != "bwd80" else None)
    fn = block_sparse.table_mask(user, 128, 64, 0, scalars is not None)
    d = 256 if kind == "bwd90_d256" else 128
    p = AttnProblem("bf16", 2, 300, 500, 4, 4, d, d, d ** -0.5, causal=user is None,
                    mask_mod=mods.key_of(fn, "mask_mod"), aux=mods.aux_signature([table], None, scalars))
    mod = {"fwd90": sm90, "fwd90_user_scalars": sm90, "bwd90": bwd90, "bwd90_d256": bwd90, "fwd80": sm80,
           "bwd80": bwd80}[kind]
    cfg = mod.make_config(p, None, "sm_80" if kind.endswith("80") else "sm_90a", kind.startswith("fwd"))
    jit.compile_uncached(cfg, engine=False)


def test_torch_compile_refuses_block_sparsity():
    from fa4 import validate

    bst = _bst()
    q = torch.randn(2, 300, 4, 64, dtype=torch.bfloat16)
    k = torch.randn(2, 500, 4, 64, dtype=torch.bfloat16)

    def call(q, k):
        return fa4.flash_attn_func(q, k, k, block_sparse_tensors=bst)[0]

    torch._dynamo.reset()
    with validate.allow_any_device(), pytest.raises(Exception, match="block_sparse_tensors under torch.compile"):
        torch.compile(call, fullgraph=True, backend="eager")(q, k)


def test_bench_block_lists_match_the_document_mask():
    """fa4/offgrid.py's block-sparse case: its lists mark a block pair full where every (q, k) pair
    in it is in one document, hidden where none is, mask otherwise."""
    from fa4 import offgrid

    q = torch.empty(2, 1024, 4, 64)
    kw = offgrid._block_doc(q, doc=200)
    ids, bst = kw["aux_tensors"][0], kw["block_sparse_tensors"]
    assert block_sparse.check(bst, None, 2, 4, 1024, 1024, q.device) == (128, 128)
    t = block_sparse.table(bst, 2, 4, 1024, 1024, (128, 128))
    same = ids[:, :, None] == ids[:, None, :]  # (b, s, s)
    blocks = same.view(2, 8, 128, 8, 128)
    want = torch.where(blocks.all(dim=(2, 4)), 2, torch.where(blocks.any(dim=(2, 4)), 1, 0))
    assert torch.equal(t[:, 0].long(), want) and torch.equal(t[:, 3], t[:, 0])
    assert (want == 0).any() and (want == 2).any() and (want == 1).any()


def test_config_skips_blocks_where_the_tile_allows():
    """The sm90 forward's block_skip: on for aligned and unaligned block sizes with few table
    reads a block, off with pack GQA and with sparse blocks much smaller than the tile; a config
    with it compiles (producer and consumers walking the visible blocks)."""
    from fa4 import jit
    from fa4.fwd import sm90

    def cfg(block, h=4, hk=4, sq=1000, d=128, causal=False):
        bst, _ = random_block_sparse(2, h, sq, 1000, block, "cpu", seed=4)
        table = block_sparse.table(bst, 2, h, sq, 1000, block)
        fn = block_sparse.table_mask(None, *block, 0, False)
        p = AttnProblem("bf16", 2, sq, 1000, h, hk, d, d, d ** -0.5, causal=causal,
                        mask_mod=mods.key_of(fn, "mask_mod"), aux=mods.aux_signature([table], None),
                        block_table=(0, *block))
        return sm90.make_config(p, None, "sm_90a", True)

    assert cfg((128, 128)).block_skip == (0, 128, 128)
    assert cfg((100, 37)).block_skip == (0, 100, 37)  # 3 x 5 reads
    assert cfg((16, 16)).block_skip == ()  # 9 x 9 reads: computed whole
    assert cfg((128, 128), h=16, hk=2, sq=4).block_skip == ()  # decode: packed GQA rows
    jit.compile_uncached(cfg((64, 192), d=64, causal=True), engine=False)


def _bwd_problem(block, d=128, h=8, hk=2, causal=False):
    bst, _ = random_block_sparse(2, h, 1000, 1000, block, "cpu", seed=4)
    table = block_sparse.table(bst, 2, h, 1000, 1000, block)
    fn = block_sparse.table_mask(None, *block, 0, False)
    return AttnProblem("bf16", 2, 1000, 1000, h, hk, d, d, d ** -0.5, causal=causal,
                       mask_mod=mods.key_of(fn, "mask_mod"), aux=mods.aux_signature([table], None),
                       block_table=(0, *block))


def test_backward_block_skip_never_rotates(monkeypatch):
    """The rotated order counts m_blocks from 0 (Note [Rotated order]): with the relaxed claims'
    switches on (off by default), a block-sparse backward keeps the plain order."""
    from fa4.bwd import sm90 as bwd90

    monkeypatch.setattr(bwd90, "DQ_FIRST_STORE", {True: True, False: True})
    monkeypatch.setattr(bwd90, "CLAIM_ROTATE", True)
    plain = bwd90.make_config(_without_table(_bwd_problem((128, 128))), None, "sm_90a", False)
    assert plain.det_rotate and not plain.block_skip  # (the switches do rotate a call without lists)
    cfg = bwd90.make_config(_bwd_problem((128, 128)), None, "sm_90a", False)
    assert cfg.block_skip and cfg.dq_first_store and not cfg.det_rotate


def _without_table(p):
    import dataclasses

    return dataclasses.replace(p, block_table=())


def test_backward_config_skips_blocks_where_it_may(monkeypatch):
    """Note [Block skip in the backward]: the sm90 backward narrows when not deterministic, and with
    its dQ pass (whose main kernel is not deterministic), which a deterministic run takes, the pass
    too; not with the ordered dQ (the rule off), nor with sparse blocks much smaller than the tile;
    a config that asks for it with the ordered dQ is refused."""
    import dataclasses

    from fa4.bwd import dq_sm90
    from fa4.bwd import sm90 as bwd90

    def cfg(block, det=False, opts=None, **kw):
        return bwd90.make_config(_bwd_problem(block, **kw), opts, "sm_90a", det)

    assert cfg((128, 128)).block_skip == (0, 128, 128)
    assert cfg((128, 128), causal=True).block_skip == (0, 128, 128)
    assert cfg((100, 37)).block_skip == (0, 100, 37)
    det = cfg((128, 128), det=True)  # (through the dQ pass: BLOCK_SPARSE_DET_DQ_PASS)
    assert det.dq_pass and not det.deterministic and det.block_skip == (0, 128, 128)
    assert dq_sm90.config_for(det).block_skip == (0, 128, 128)
    assert cfg((16, 16)).block_skip == ()
    two = cfg((128, 128), opts=fa4.KernelOptions(bwd_two_cta=True), h=8, hk=8)
    assert two.two_cta and two.block_skip == (0, 128, 128)
    for det in (False, True):  # d256: the dQ pass
        main = cfg((128, 128), det=det, d=256)
        assert main.dq_pass and not main.deterministic and main.block_skip == (0, 128, 128)
        assert dq_sm90.config_for(main).block_skip == (0, 128, 128)
    assert cfg((128, 128), d=64).tile_m == 64  # (d64's 128-row steps spill with the steps' mask passes)
    monkeypatch.setattr(bwd90, "BLOCK_SPARSE_DET_DQ_PASS", False)
    ordered = cfg((128, 128), det=True)
    assert ordered.deterministic and not ordered.dq_pass and ordered.block_skip == ()
    with pytest.raises(ValueError, match="block_skip"):
        bwd90.FlashBwdSm90.can_implement(dataclasses.replace(ordered, block_skip=(0, 128, 128)))
    with pytest.raises(ValueError, match="block_skip"):
        bwd90.FlashBwdSm90.can_implement(dataclasses.replace(cfg((128, 128)), block_skip=(1, 128, 128)))


def test_sm80_configs_skip_where_they_may(monkeypatch):
    """The sm80 backward narrows when not deterministic (as the sm90 one); the sm80 forward's
    narrowing is off (``fwd.sm80.BLOCK_SKIP``: it spills) and, turned on, compiles with its ballot."""
    import dataclasses

    from fa4 import sass
    from fa4.bwd import sm80 as bwd80
    from fa4.fwd import sm80 as fwd80

    p = _bwd_problem((128, 128))
    assert bwd80.make_config(p, None, "sm_90a", False).block_skip == (0, 128, 128)
    assert bwd80.make_config(p, None, "sm_90a", True).block_skip == ()
    with pytest.raises(ValueError, match="block_skip"):
        bwd80.FlashBwdSm80.can_implement(dataclasses.replace(bwd80.make_config(p, None, "sm_90a", True),
                                                             block_skip=(0, 128, 128)))
    assert fwd80.make_config(p, None, "sm_90a", True).block_skip == ()
    monkeypatch.setattr(fwd80, "BLOCK_SKIP", True)
    fwd = fwd80.make_config(p, None, "sm_90a", True)
    assert fwd.block_skip == (0, 128, 128)
    for c in (fwd, bwd80.make_config(p, None, "sm_90a", False)):
        ops = sass.opcode_counts(sass.disassemble(c))
        assert sass.count(ops, "VOTE") + sass.count(ops, "VOTEU") > 0, type(c).__name__


@pytest.mark.parametrize("arch", ["sm_80", "sm_100a"])
def test_sm80_block_skip_compiles_for_its_other_arches(arch, monkeypatch):
    """The sm80 family's block-skip configs (forward with its switch on, backward) compile for the
    arches the family claims besides sm_90a (there: the test above, with its SASS)."""
    from fa4 import jit
    from fa4.bwd import sm80 as bwd80
    from fa4.fwd import sm80 as fwd80

    monkeypatch.setattr(fwd80, "BLOCK_SKIP", True)
    p = _bwd_problem((128, 128))
    for cfg in (fwd80.make_config(p, None, arch, True), bwd80.make_config(p, None, arch, False)):
        assert cfg.block_skip == (0, 128, 128)
        jit.compile_uncached(cfg, engine=False)


@pytest.mark.parametrize("case", ["gqa_causal", "two_cta", "kv_split", "dq_pass"])
def test_backward_block_skip_compiles(case):
    """The narrowing backward compiles with each of the paths it runs on, and its SASS has the
    ballots (VOTE) of Note [Block skip in the backward] beyond the same config's without it;
    with the dQ pass the pass narrows too."""
    import dataclasses

    from fa4 import sass
    from fa4.bwd import dq_sm90
    from fa4.bwd import sm90 as bwd90

    opts = {"gqa_causal": None, "two_cta": fa4.KernelOptions(bwd_two_cta=True),
            "kv_split": fa4.KernelOptions(bwd_kv_split=2), "dq_pass": fa4.KernelOptions(bwd_dq_pass=True)}[case]
    heads = (8, 8) if case == "two_cta" else (8, 2)
    cfg = bwd90.make_config(_bwd_problem((128, 128), h=heads[0], hk=heads[1], causal=case == "gqa_causal"), opts,
                            "sm_90a", False)
    assert cfg.block_skip
    configs = [cfg] + ([dq_sm90.config_for(cfg)] if case == "dq_pass" else [])
    def ballots(c):
        ops = sass.opcode_counts(sass.disassemble(c))
        return sass.count(ops, "VOTE") + sass.count(ops, "VOTEU")

    for c in configs:
        votes, plain = ballots(c), ballots(dataclasses.replace(c, block_skip=()))
        assert votes > plain, (type(c).__name__, votes, plain)


def test_table_kernel_compiles_for_row_major_tables():
    """The one-launch table (Note [One launch for the table]) is compiled for the row-major int8
    table torch allocates: a fake tensor without a stride order is column-major, and the compiled
    call would then refuse every table of more than one batch (TVM-FFI checks the static stride)."""
    from fa4.block_table_kernel import BlockTableBuilder

    for cfg in block_sparse.variants("sm_90a"):
        args = BlockTableBuilder.fake_args(cfg)
        assert args[4].stride[-1] == 1 and all(not isinstance(s, int) for s in args[4].stride[:-1]), args[4].stride
        for lists in args[:4]:
            assert lists is None or not any(isinstance(s, int) for s in lists.stride), lists.stride  # stride 0 ok
