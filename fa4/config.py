"""Host-side configuration: what the user asks for and what a kernel is compiled for.

Three kinds of object live here:

* :class:`KernelOptions` -- the researcher-facing knobs (tile sizes, stages, the exp2-emulation
  fraction, the rescale threshold, a forced kernel family). Every field defaults to ``None``,
  meaning "let fa4 choose"; :func:`fa4.explain` shows what was chosen and why.
* :class:`AttnProblem` -- one attention call, normalized and validated: sizes, masking, varlen
  flags. Built by :mod:`fa4.validate` from the user's tensors; kernels never see user arguments.
* :class:`KernelConfig` -- the base of every kernel family's frozen compile key. A family defines
  a subclass (``FwdSm80Config`` ...) holding everything that changes the generated code; the JIT
  cache key is derived from the dataclass itself (class name + every field), so it cannot drift
  from what the kernel reads.
"""

from __future__ import annotations

import ast
import dataclasses
import numbers
import os
from dataclasses import dataclass
from typing import Any, ClassVar, Optional

ARCHS = ("sm_80", "sm_90a", "sm_100a")
"""Code-generation targets fa4 compiles for."""

FAMILIES = ("sm80", "sm90", "sm100")
"""Kernel families: which instruction set a kernel is written for. A family runs on its own arch
and newer ones (the sm80 family runs on sm_90a), so family and target arch are separate."""

DTYPES = ("bf16", "fp16")


def is_int(value) -> bool:
    """A Python or numpy integer, not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A Python or numpy int / float, not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _check_fraction(name: str, value: Optional[float]) -> None:
    if value is not None and not is_real(value):
        raise TypeError(f"KernelOptions.{name} must be a float in [0, 1] or None, got {value!r}")
    if value is not None and not (0.0 <= value <= 1.0):
        raise ValueError(f"KernelOptions.{name} must be in [0, 1], got {value!r}")


@dataclass(frozen=True)
class KernelOptions:
    """Kernel knobs a researcher may set; ``None`` means the tuned default.

    Forward: ``tile_m``, ``tile_n`` (rows of Q / K per CTA tile), ``num_threads``,
    ``num_stages`` (shared-memory stages of K/V), ``exp2_emu_frac`` (fraction of the softmax
    exponentials computed by a polynomial on the FMA pipe instead of MUFU ``ex2``; 0 = all MUFU),
    ``rescale_threshold`` (tau, in log2 units: O is rescaled only when a row max grows by more than
    tau; 0 = rescale whenever the max grows).
    Backward: ``bwd_tile_m``, ``bwd_tile_n``, ``bwd_num_threads``, ``bwd_two_cta`` (sm90: clusters of
    two CTAs on adjacent K blocks that swap halves of dS through distributed shared memory and add
    half as many dQ rows each; True / False over the tuned default), ``bwd_dq_pass`` (sm90: dQ from a
    second kernel with its query rows stationary, no global reductions, the same bits on every run;
    True / False over the tuned default), ``bwd_exp2_emu_frac`` (sm90: the share of the backward's
    P exponentials computed by the polynomial on the FMA pipe; 0 = all MUFU ``ex2``),
    ``bwd_kv_split`` (the GQA group's q heads split over this many CTAs per K block, each writing
    float32 partial dK / dV that are summed in a fixed order; a power of two dividing the group; 1 =
    no split; the default splits GQA/MQA grids too small to fill the GPU (with a mask up to about
    four waves of CTAs, without one up to one wave), and never a
    deterministic run, whose bits may not depend on the batch: a fixed split keeps them
    batch-independent, so a deterministic MQA backward may ask for one; both families).
    ``arch``: force a kernel family ("sm80", "sm90", "sm100") instead of the device's own, e.g. to
    run the Ampere path on a Hopper GPU. The environment variable ``FA4_ARCH`` does the same.
    """

    arch: Optional[str] = None
    tile_m: Optional[int] = None
    tile_n: Optional[int] = None
    num_threads: Optional[int] = None
    num_stages: Optional[int] = None
    exp2_emu_frac: Optional[float] = None
    rescale_threshold: Optional[float] = None
    bwd_tile_m: Optional[int] = None
    bwd_tile_n: Optional[int] = None
    bwd_num_threads: Optional[int] = None
    bwd_two_cta: Optional[bool] = None
    bwd_dq_pass: Optional[bool] = None
    bwd_exp2_emu_frac: Optional[float] = None
    bwd_kv_split: Optional[int] = None

    def __post_init__(self) -> None:
        if self.arch is not None and normalize_family(self.arch) is None:
            raise ValueError(
                f"KernelOptions.arch must be one of {FAMILIES} (or sm_80/sm_90a/sm_100a), got {self.arch!r}"
            )
        for name in ("tile_m", "tile_n", "num_threads", "num_stages", "bwd_tile_m", "bwd_tile_n", "bwd_num_threads"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"KernelOptions.{name} must be a positive int, got {v!r}")
        v = self.bwd_kv_split
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0 or v & (v - 1)):
            raise ValueError(f"KernelOptions.bwd_kv_split must be a power of two (1, 2, 4, ...), got {v!r}")
        for name in ("bwd_two_cta", "bwd_dq_pass"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"KernelOptions.{name} must be a bool or None, got {v!r}")
        _check_fraction("exp2_emu_frac", self.exp2_emu_frac)
        _check_fraction("bwd_exp2_emu_frac", self.bwd_exp2_emu_frac)
        if self.rescale_threshold is not None and not is_real(self.rescale_threshold):
            raise TypeError(f"KernelOptions.rescale_threshold must be a float in [0, 64] or None, got "
                            f"{self.rescale_threshold!r}")
        if self.rescale_threshold is not None and not (0.0 <= float(self.rescale_threshold) <= 64.0):
            raise ValueError(
                f"KernelOptions.rescale_threshold must be in [0, 64] (log2 units), got {self.rescale_threshold!r}"
            )

    def sets_backward(self) -> bool:
        """Whether any backward option (``bwd_*``) is set: a call that takes gradients has the
        backward's family check them before its forward runs."""
        for name in _BWD_OPTION_FIELDS:
            if getattr(self, name) is not None:
                return True
        return False

    # Options travel through torch.library custom ops as a canonical string "name=repr;...", built
    # from plain attribute reads and f-strings so torch.compile can trace it.
    def to_str(self) -> str:
        parts = []
        for name in _OPTION_FIELDS:
            v = getattr(self, name)
            if v is not None:
                parts.append(f"{name}={v!r}")
        return ";".join(parts)

    @staticmethod
    def from_str(s: str) -> "KernelOptions":
        if not s:
            return KernelOptions()
        kv = (item.split("=", 1) for item in s.split(";"))
        return KernelOptions(**{k: ast.literal_eval(v) for k, v in kv})

    def merged(self, other: Optional["KernelOptions"]) -> "KernelOptions":
        """``other``'s set fields override ours."""
        if other is None:
            return self
        upd = {k: v for k, v in dataclasses.asdict(other).items() if v is not None}
        return dataclasses.replace(self, **upd)


_OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(KernelOptions))
_BWD_OPTION_FIELDS = tuple(name for name in _OPTION_FIELDS if name.startswith("bwd_"))


def normalize_family(name: Optional[str]) -> Optional[str]:
    """'sm80' / 'sm_80' / 'sm80a' -> 'sm80'; unknown -> None."""
    if name is None:
        return None
    s = str(name).lower().replace("_", "").rstrip("a")
    return s if s in FAMILIES else None


def family_arch(family: str) -> str:
    """The code-generation arch a family is written for ('sm90' -> 'sm_90a')."""
    return {"sm80": "sm_80", "sm90": "sm_90a", "sm100": "sm_100a"}[family]


def env_options() -> KernelOptions:
    """Options set through the environment (``FA4_ARCH``)."""
    arch = os.environ.get("FA4_ARCH") or None
    return KernelOptions(arch=arch)


@dataclass(frozen=True)
class AttnProblem:
    """One attention call after validation; the contract between the interface and the launchers.

    Sizes: ``batch`` (number of sequences), ``seqlen_q`` / ``seqlen_k`` (per-sequence length for the
    fixed-length case, the max over sequences for varlen), ``heads`` / ``heads_k``, ``head_dim`` /
    ``head_dim_v``. Masking: ``causal`` (right = 0), ``local`` (a finite window on some side;
    ``window_left`` / ``window_right`` are then finite ints, an unbounded side being stored as
    ``max(seqlen_q, seqlen_k)``, which no index difference can exceed). ``softcap`` 0 means off.
    Varlen: ``varlen_q`` / ``varlen_k`` (cu_seqlens given), ``has_seqused_k``.
    Forward hints: ``num_splits`` (split-KV: 0 = chosen by fa4, 1 = no split, n = n splits),
    ``pack_gqa`` (None = chosen by fa4). Forward only: ``has_seqused_q`` (``seqused_q`` caps the
    queries of each sequence), ``page_size`` (> 0: paged K/V through a page table; ``seqlen_k`` is
    then ``max_pages * page_size`` unless ``seqused_k`` gives each sequence's length), ``has_sink``
    (a learnable sink logit per q head, applied in the forward's softmax). ``score_mod`` /
    ``mask_mod``: the keys of user functions (forward only; :mod:`fa4.mods`), '' when absent;
    ``aux``: the ``(dtype, ndim)`` of each of their aux tensors; ``score_mod_bwd``: the key of the
    score_mod's derivative (backward only). ``block_table``: ``(slot, block_q, block_k)`` when aux
    tensor ``slot`` is a block-sparse call's block table (fa4/block_sparse.py), whose hidden blocks
    a forward may skip.
    """

    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: int
    head_dim: int
    head_dim_v: int
    softmax_scale: float
    causal: bool = False
    local: bool = False
    window_left: int = 0
    window_right: int = 0
    softcap: float = 0.0
    varlen_q: bool = False
    varlen_k: bool = False
    has_seqused_k: bool = False
    total_q: int = 0
    total_k: int = 0
    num_splits: int = 0
    pack_gqa: Optional[bool] = None
    has_seqused_q: bool = False
    page_size: int = 0
    has_sink: bool = False
    score_mod: str = ""
    mask_mod: str = ""
    aux: tuple = ()
    score_mod_bwd: str = ""
    block_table: tuple = ()

    @property
    def qhead_per_kvhead(self) -> int:
        return self.heads // self.heads_k

    @property
    def has_softcap(self) -> bool:
        return self.softcap > 0.0

    @property
    def is_varlen(self) -> bool:
        return self.varlen_q or self.varlen_k or self.has_seqused_k or self.has_seqused_q or self.page_size > 0


@dataclass(frozen=True)
class KernelConfig:
    """Base of every family's compile key. Subclasses add the fields their code depends on.

    ``kernel`` names the family module entry (set by subclasses as a class-level default),
    ``arch`` is the code-generation target (sm_80 / sm_90a / sm_100a), ``dtype`` 'bf16'/'fp16'.
    """

    arch: str
    dtype: str

    # "module:Class" of the kernel this config compiles; subclasses override.
    KERNEL: ClassVar[str] = ""
    # Whether its kernels compile with fa4.jit.PASS_SWITCHES (Note [Compiler switches] in fa4/jit.py):
    # a family whose instruction listings change without the switched-off pass sets it False.
    PASS_SWITCHES_OK: ClassVar[bool] = True

    def key(self) -> str:
        """Stable text key: class name and every field (order fixed by the dataclass)."""
        items = ",".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({items})"

    @property
    def disk_cacheable(self) -> bool:
        """Whether the disk cache may hold this kernel (not with user functions: Note [User
        functions in the compile key] in fa4/mods.py)."""
        return True

    def describe(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def check_target(self, dtypes, head_dim_multiple: Optional[int] = None) -> None:
        """The checks every kernel's ``can_implement`` starts with: a known arch, a supported dtype
        and (for kernels on padded head dims) a head dim that is a multiple of ``head_dim_multiple``
        in [32, 256]. ValueError naming the field."""
        name = type(self).__name__
        if self.arch not in ARCHS:
            raise ValueError(f"{name}.arch must be one of {ARCHS}, got {self.arch!r}")
        if self.dtype not in dtypes:
            raise ValueError(f"{name}.dtype must be one of {tuple(dtypes)}, got {self.dtype!r}")
        if head_dim_multiple is not None:
            d = getattr(self, "head_dim")
            if d % head_dim_multiple or not 32 <= d <= 256:
                raise ValueError(f"{name}.head_dim must be a multiple of {head_dim_multiple} in [32, 256], got {d}")


@dataclass(frozen=True)
class AttnKernelConfig(KernelConfig):
    """Base of the attention kernels' compile keys (forward and backward, every arch): the masking
    and varlen flags of an :class:`AttnProblem` that the kernels compile in. ``score_mod`` /
    ``mask_mod``: keys of user functions traced into the kernel ('' when absent; :mod:`fa4.mods`),
    ``aux`` the ``(dtype, ndim)`` of each aux tensor they read; such kernels stay in process memory
    (a family that does not implement them refuses them in ``can_implement``)."""

    causal: bool = False
    local: bool = False
    has_softcap: bool = False
    varlen_q: bool = False
    varlen_k: bool = False
    has_seqused_k: bool = False
    score_mod: str = ""
    mask_mod: str = ""
    aux: tuple = ()
    score_mod_bwd: str = ""  # (backward configs only: the forward kernels do not read it)

    @property
    def disk_cacheable(self) -> bool:
        return not (self.score_mod or self.mask_mod or self.aux or self.score_mod_bwd)

    @staticmethod
    def problem_flags(problem: AttnProblem) -> dict[str, bool]:
        """The flag fields for ``problem`` (``causal`` and ``local`` are exclusive there)."""
        return dict(
            causal=problem.causal,
            local=problem.local,
            has_softcap=problem.has_softcap,
            varlen_q=problem.varlen_q,
            varlen_k=problem.varlen_k,
            has_seqused_k=problem.has_seqused_k,
            score_mod=problem.score_mod,
            mask_mod=problem.mask_mod,
            aux=problem.aux,
        )



@dataclass(frozen=True)
class AttnFwdConfig(AttnKernelConfig):
    """Base of the forward kernels' compile keys: the forward-only flags. ``has_seqused_q``:
    ``seqused_q`` given; ``page_rows`` > 0: paged K/V, loaded ``page_rows`` rows at a time
    (``gcd(page_size, tile_n)``: a chunk never straddles a page). ``one_step_loop`` (causal /
    local): the K blocks after a tile's first through one step body, the window mask a runtime
    branch in it, instead of separate loops over masked and free blocks (two causal, three local;
    a smaller kernel to compile; :func:`fa4.mask.walk_blocks`). ``fold_first`` (causal / local,
    separate loops): the tile's first K block runs as the first iteration of the loop over the
    blocks at the window's right edge (sm90, local tiles: both edges, Note [Edges first] in
    fa4/mask.py) instead of in its own copy of the step (Note [The first block in the masked
    loop] in fa4/fwd/sm90.py; one copy fewer to compile). ``has_sink``: a
    learnable sink logit per q head in the softmax (Note [Attention sinks in the softmax] in
    fa4/softmax.py)."""

    has_seqused_q: bool = False
    page_rows: int = 0
    one_step_loop: bool = False
    fold_first: bool = False
    has_sink: bool = False
    @staticmethod
    def fwd_flags(problem: AttnProblem) -> dict:
        return dict(AttnKernelConfig.problem_flags(problem), has_seqused_q=problem.has_seqused_q,
                    has_sink=problem.has_sink)
