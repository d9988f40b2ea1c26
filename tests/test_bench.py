"""CPU tests of fa4.bench's pure-Python parts: FLOPs, grid selection, running with injected
implementations and timings, the table / CSV / JSON writers, and the no-GPU exit."""

from __future__ import annotations

import contextlib
import csv
import itertools
import json
import math
import subprocess
import sys

import pytest
import torch

import fa4
from fa4 import bench
from fa4.bench import Impl, Prepared, Record, Shape
from fa4.testing import attention_ref

SMALL = Shape(batch=2, seqlen_q=37, seqlen_k=37, heads=4, hdim=16, causal=True)


# ---------------------------------------------------------------- FLOPs and grid


def test_flops_of_a_grid_row():
    shape = bench.grid_shape(128, 8192, causal=False)
    assert (shape.batch, shape.heads) == (2, 16)
    fwd = 4 * 2 * 16 * 8192 * 8192 * 128
    assert bench.flops(shape, "fwd") == fwd
    assert bench.flops(shape, "bwd") == 2.5 * fwd
    causal = bench.grid_shape(128, 8192, causal=True)
    assert bench.flops(causal, "fwd") == fwd / 2
    assert bench.flops(causal, "bwd") == 2.5 * fwd / 2
    assert bench.tflops(shape, "fwd", 10.0) == pytest.approx(fwd / 1e-2 / 1e12)


def test_flops_with_unequal_seqlens():
    shape = Shape(8, 1, 512, 32, 128)
    assert bench.flops(shape, "fwd") == 4 * 8 * 32 * 1 * 512 * 128


def test_full_grid_matches_targets_table():
    shapes = bench.select_grid()
    assert len(shapes) == 12
    assert [(s.hdim, s.seqlen_q, s.causal) for s in shapes[:4]] == [
        (64, 8192, False),
        (64, 8192, True),
        (128, 1024, False),
        (128, 1024, True),
    ]
    for s in shapes:
        assert s.batch * s.seqlen_q == 16384 and s.heads * s.hdim == 2048 and s.seqlen_q == s.seqlen_k


@pytest.mark.parametrize(
    "argv,expected",
    [
        ([], 12),
        (["--hdim", "64"], 2),
        (["--hdim", "64,128", "--seqlen", "1024,8192"], 6),
        (["--seqlen", "8192", "--causal", "yes"], 3),
        (["--hdim", "256", "--causal", "no"], 1),
        (["--hdim", "64", "--seqlen", "1024"], 0),  # not a row of the targets table
    ],
)
def test_grid_selection_from_cli(argv, expected):
    shapes, directions = bench.plan(bench.parse_args(argv))
    assert len(shapes) == expected and directions == ("fwd", "bwd")
    args = bench.parse_args(argv)
    for s in shapes:
        assert args.hdim is None or s.hdim in args.hdim
        assert args.seqlen is None or s.seqlen_q in args.seqlen
        assert args.causal != "yes" or s.causal


@pytest.mark.parametrize("mode,directions", [("fwd", ("fwd",)), ("bwd", ("bwd",)), ("both", ("fwd", "bwd"))])
def test_mode_selects_directions(mode, directions):
    assert bench.plan(bench.parse_args(["--mode", mode]))[1] == directions


def test_latency_mode_uses_latency_shapes():
    shapes, directions = bench.plan(bench.parse_args(["--latency", "--hdim", "64"]))
    assert [(s.batch, s.seqlen_q, s.seqlen_k, s.heads, s.hdim) for s in shapes] == [
        (1, 128, 512, 16, 128),
        (8, 1, 512, 32, 128),
    ]
    assert directions == ("fwd",)


def test_bad_cli_values_exit_2():
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--hdim", "sixty-four"])
    assert info.value.code == 2
    with pytest.raises(SystemExit):
        bench.parse_args(["--arch", "sm70"])


def test_kernel_options_from_cli():
    args = bench.parse_args(["--arch", "sm80", "--exp2-emu-frac", "0.25", "--rescale-threshold", "8"])
    kwargs = bench.kernel_option_kwargs(args)
    assert kwargs == {"arch": "sm80", "exp2_emu_frac": 0.25, "rescale_threshold": 8.0}
    assert bench.kernel_option_kwargs(bench.parse_args([])) == {}
    if hasattr(fa4, "KernelOptions"):  # the names must be fields of fa4's options
        options = fa4.KernelOptions(**kwargs)
        assert (options.arch, options.exp2_emu_frac, options.rescale_threshold) == ("sm80", 0.25, 8.0)


# ---------------------------------------------------------------- running with fake implementations


def _attention(q, k, v, causal, scale=1.0):
    """Differentiable attention in the inputs' dtype, (b, s, h, d)."""
    return attention_ref(q, k, v, causal=causal, upcast=False)[0] * scale


def fake_impl(name: str, *, bhsd: bool = False, scale: float = 1.0, error: Exception | None = None) -> Impl:
    """A CPU implementation: correct attention (times ``scale``), in either layout, or raising ``error``."""

    def setup(q, k, v, causal, requires_grad):
        if error is not None:
            raise error
        leaves = bench._leaves((q, k, v), requires_grad, bhsd)

        def run():
            args = [t.transpose(1, 2) for t in leaves] if bhsd else leaves
            out = _attention(*args, causal, scale)
            return out.transpose(1, 2) if bhsd else out

        return Prepared(run, leaves, bhsd)

    return Impl(name, setup)


def _fixed_timer(ms_values):
    """A timer that calls fn once (so it must work) and returns the next of ``ms_values``."""
    values = itertools.cycle(ms_values)

    def timer(fn):
        fn()
        return next(values)

    return timer


def _run_fakes(directions=("fwd", "bwd")):
    impls = [
        fake_impl("peer-bshd"),
        fake_impl("peer-bhsd", bhsd=True),
        fake_impl("wrong", scale=2.0),
        fake_impl("unsupported", error=NotImplementedError("no kernel for hdim 16")),
        fake_impl("crashing", error=RuntimeError("illegal memory access\nsecond line")),
        fake_impl("fa4"),
    ]
    logged = []
    records = bench.run_grid(
        [SMALL],
        impls,
        timer=_fixed_timer([4.0, 2.0, 3.0, 1.0]),
        directions=directions,
        reference=fake_impl("ref", bhsd=True),
        device="cpu",
        log=logged.append,
    )
    return records, logged


def test_run_grid_records_and_checks():
    records, logged = _run_fakes()
    assert len(records) == 12 and len(logged) == 12
    by = {(r.impl, r.direction): r for r in records}
    for direction in ("fwd", "bwd"):
        for name in ("peer-bshd", "peer-bhsd", "fa4"):
            rec = by[name, direction]
            assert rec.status == "ok" and rec.maxdiff == pytest.approx(0.0, abs=1e-6)
        assert by["wrong", direction].maxdiff > 0.1  # a fast but wrong kernel is visible
        assert by["unsupported", direction].status == "n/a"
        assert by["unsupported", direction].reason == "NotImplementedError: no kernel for hdim 16"
        assert by["crashing", direction].status == "error"
        assert by["crashing", direction].reason == "RuntimeError: illegal memory access"
    # Timings come from the injected timer, in the order the implementations run.
    assert [by[n, "fwd"].ms for n in ("peer-bshd", "peer-bhsd", "wrong", "fa4")] == [4.0, 2.0, 3.0, 1.0]
    assert by["fa4", "fwd"].tflops == pytest.approx(bench.flops(SMALL, "fwd") / 1e-3 / 1e12)
    assert by["fa4", "bwd"].tflops == pytest.approx(2.5 * bench.flops(SMALL, "fwd") / 1e-3 / 1e12)


def test_run_grid_without_reference_or_with_failing_reference():
    impl = fake_impl("fa4")
    records = bench.run_grid(
        [SMALL], [impl], timer=_fixed_timer([1.0]), directions=("fwd",), device="cpu", log=lambda _: None
    )
    assert records[0].status == "ok" and records[0].maxdiff is None
    logged = []
    broken = fake_impl("ref", error=RuntimeError("boom"))
    records = bench.run_grid(
        [SMALL],
        [impl],
        timer=_fixed_timer([1.0]),
        directions=("fwd",),
        device="cpu",
        reference=broken,
        log=logged.append,
    )
    assert records[0].status == "ok" and records[0].maxdiff is None
    assert any("reference ref failed" in line and "boom" in line for line in logged)


def test_timer_failure_keeps_maxdiff():
    def timer(fn):
        raise RuntimeError("timing broke")

    (rec,) = bench.run_grid(
        [SMALL],
        [fake_impl("fa4")],
        timer=timer,
        directions=("fwd",),
        device="cpu",
        reference=fake_impl("ref"),
        log=lambda _: None,
    )
    assert rec.status == "error" and rec.maxdiff == pytest.approx(0.0, abs=1e-6) and "timing broke" in rec.reason


def test_nan_output_shows_as_nan_diff():
    def setup(q, k, v, causal, requires_grad):
        return Prepared(lambda: torch.full_like(q, float("nan")), (q, k, v), False)

    (rec,) = bench.run_grid(
        [SMALL],
        [Impl("fa4", setup)],
        timer=_fixed_timer([1.0]),
        directions=("fwd",),
        device="cpu",
        reference=fake_impl("ref"),
        log=lambda _: None,
    )
    assert math.isnan(rec.maxdiff)
    assert bench._diff_cell(rec) == "nan"


def test_fa4_impl_passes_options_and_flags(monkeypatch):
    calls = []

    def fake_flash_attn_func(q, k, v, **kwargs):
        calls.append(kwargs)
        return _attention(q, k, v, kwargs["causal"]), None

    monkeypatch.setattr(fa4, "flash_attn_func", fake_flash_attn_func, raising=False)
    impl = bench.fa4_impl({"arch": "sm80", "rescale_threshold": 8.0}, deterministic=True)
    (rec,) = bench.run_grid(
        [SMALL],
        [impl],
        timer=_fixed_timer([1.0]),
        directions=("bwd",),
        device="cpu",
        reference=fake_impl("ref"),
        log=lambda _: None,
    )
    assert rec.status == "ok" and rec.maxdiff == pytest.approx(0.0, abs=1e-6)
    kwargs = calls[0]
    assert kwargs["causal"] is True and kwargs["deterministic"] is True
    assert kwargs["kernel_options"] == fa4.KernelOptions(arch="sm80", rescale_threshold=8.0)


def test_fa4_impl_without_api_is_not_available(monkeypatch):
    monkeypatch.delattr(fa4, "flash_attn_func", raising=False)
    (rec,) = bench.run_grid(
        [SMALL],
        [bench.fa4_impl({}, False)],
        timer=_fixed_timer([1.0]),
        directions=("fwd",),
        device="cpu",
        log=lambda _: None,
    )
    assert rec.status == "n/a" and "flash_attn_func" in rec.reason


def test_sdpa_flash_on_cpu_matches_reference_in_both_directions():
    impl = bench.sdpa_impl("sdpa-flash", "FLASH_ATTENTION")
    records = bench.run_grid(
        [SMALL], [impl], timer=_fixed_timer([1.0]), device="cpu", reference=fake_impl("ref"), log=lambda _: None
    )
    for rec in records:
        assert rec.status == "ok", rec.reason
        assert rec.maxdiff < 0.05


def test_context_is_entered_around_check_and_timing():
    state = {"inside": False}

    @contextlib.contextmanager
    def context():
        state["inside"] = True
        yield
        state["inside"] = False

    def setup(q, k, v, causal, requires_grad):
        def run():
            assert state["inside"]
            return _attention(q, k, v, causal)

        return Prepared(run, (q, k, v), False, context=context)

    def timer(fn):
        assert state["inside"]
        fn()
        return 1.0

    (rec,) = bench.run_grid(
        [SMALL], [Impl("fa4", setup)], timer=timer, directions=("fwd",), device="cpu", log=lambda _: None
    )
    assert rec.status == "ok" and not state["inside"]


def test_missing_flash_attn4_is_not_available():
    try:
        import flash_attn.cute  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("flash-attn-4 is installed here")
    (rec,) = bench.run_grid(
        [SMALL],
        [bench.flash_attn4_impl(False)],
        timer=_fixed_timer([1.0]),
        directions=("fwd",),
        device="cpu",
        log=lambda _: None,
    )
    assert rec.status == "n/a" and "flash_attn" in rec.reason


def test_sdpa_impl_rejects_unaligned_causal():
    shape = Shape(1, 3, 5, 1, 16, causal=True)
    (rec,) = bench.run_grid(
        [shape],
        [bench.sdpa_impl("sdpa-flash", "FLASH_ATTENTION")],
        timer=_fixed_timer([1.0]),
        directions=("fwd",),
        device="cpu",
        log=lambda _: None,
    )
    assert rec.status == "n/a" and "top-left" in rec.reason


def test_host_timer_and_repeats():
    count = []
    ms = bench.host_timer(lambda: count.append(1), calls=50, warmup=3, sync=lambda: None)
    assert len(count) == 53 and 0 <= ms < 10
    values = iter([5.0, 1.0, 3.0])
    assert bench.repeated(lambda fn: next(values), 3)(lambda: None) == 3.0
    single = bench.repeated(lambda fn: 7.0, 1)
    assert single(lambda: None) == 7.0


def test_rounds_interleave_the_implementations_and_report_medians():
    """``--repeats N``: each row times its implementations in turn, N times over, and reports each
    one's median; a failure in a later round is what the row reports (not a median over fewer)."""
    order = []
    times = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 4.0, 6.0])}

    def timer(fn):
        name = fn()
        order.append(name)
        return next(times[name])

    def impl(name, fail_on=None):
        calls = []

        def setup(q, k, v, causal, requires_grad):
            calls.append(1)
            if fail_on is not None and len(calls) == fail_on:
                raise RuntimeError("lost the device")
            return Prepared(lambda: name, bench._leaves((q, k, v), requires_grad, False), False)

        return Impl(name, setup)

    records = bench.run_grid([SMALL], [impl("a"), impl("b")], timer=timer, directions=("fwd",), device="cpu",
                             log=lambda _: None, rounds=3)
    assert order == ["a", "b"] * 3  # round-robin, not a a a b b b
    assert [(r.impl, r.ms) for r in records] == [("a", 3.0), ("b", 4.0)]
    order.clear()
    times = {"a": iter([5.0, 1.0, 3.0]), "b": iter([2.0, 4.0, 6.0])}
    records = bench.run_grid([SMALL], [impl("a"), impl("b", fail_on=2)], timer=timer, directions=("fwd",),
                             device="cpu", log=lambda _: None, rounds=3)
    assert order == ["a", "b", "a", "a"]  # b failed in round 2 and is not retried
    assert records[0].ms == 3.0 and records[1].status == "error" and "lost the device" in records[1].reason
    assert bench.parse_args(["--repeats", "3"]).repeats == 3
    assert bench._worst_diff([0.1, 0.3, None]) == 0.3 and bench._worst_diff([None]) is None
    assert math.isnan(bench._worst_diff([0.1, float("nan")]))  # a later round's NaN is not hidden


# ---------------------------------------------------------------- reporting


def _records(latency: bool = False):
    shape = SMALL if not latency else Shape(1, 128, 512, 16, 128)
    return [
        Record("sdpa-flash", "fwd", shape, "ok", ms=2.0, maxdiff=0.0),
        Record("sdpa-cudnn", "fwd", shape, "ok", ms=1.5, maxdiff=3e-3),
        Record("flash-attn-4", "fwd", shape, "n/a", reason="ModuleNotFoundError: No module named 'flash_attn'"),
        Record("fa4", "fwd", shape, "ok", ms=1.0, maxdiff=float("nan")),
        Record("sdpa-flash", "bwd", shape, "ok", ms=4.0, maxdiff=0.0),
        Record("sdpa-cudnn", "bwd", shape, "error", reason="RuntimeError: cudnn"),
        Record("flash-attn-4", "bwd", shape, "n/a", reason="ModuleNotFoundError: No module named 'flash_attn'"),
        Record("fa4", "bwd", shape, "n/a", reason="NotImplementedError: no backward"),
    ]


def test_summary_table():
    records = _records()
    columns, rows = bench.summarize(records, latency=False)
    assert columns[7] == "fa4 TFLOP/s" and "fa4/best" in columns and columns[-1] == "diff flash-attn-4"
    fwd, bwd = rows
    assert fwd["dir"] == "fwd" and fwd["causal"] == "yes" and fwd["sq"] == "37"
    assert fwd["fa4 TFLOP/s"] == f"{records[3].tflops:.1f}"
    assert fwd["fa4/best"] == "1.50x"  # the fastest peer (cuDNN) takes 1.5 ms, fa4 1.0 ms
    assert fwd["flash-attn-4 TFLOP/s"] == "n/a" and fwd["diff fa4"] == "nan" and fwd["diff sdpa-cudnn"] == "3.0e-03"
    assert bwd["fa4 TFLOP/s"] == "n/a" and bwd["sdpa-cudnn TFLOP/s"] == "ERR" and bwd["fa4/best"] == "-"
    table = bench.format_table(columns, rows)
    lines = table.splitlines()
    assert len(lines) == 4 and len({len(line) for line in lines}) == 1  # aligned
    assert "1.50x" in lines[2]


def test_bar_column():
    """fa4/bar: fa4's speed over min(1.05x the best peer, 0.95x the run's matmul rate); the cap binds where
    1.05x the best peer would pass it; no column without a matmul rate or in latency mode."""
    shape = SMALL
    records = [
        Record("sdpa-cudnn", "fwd", shape, "ok", ms=2.0, maxdiff=0.0),
        Record("flash-attn-4", "fwd", shape, "ok", ms=1.0, maxdiff=0.0),
        Record(bench.FA4_NONDET, "fwd", shape, "ok", ms=0.1, maxdiff=0.0),  # fa4's own column: not a peer
        Record("sdpa-flash", "fwd", shape, "n/a", ms=0.1, reason="x"),  # did not run: not a peer
        Record("fa4", "fwd", shape, "ok", ms=1.0, maxdiff=0.0),
        Record("sdpa-cudnn", "bwd", shape, "ok", ms=2.0, maxdiff=0.0),
        Record("fa4", "bwd", shape, "error", reason="RuntimeError: x"),
    ]
    best = records[1].tflops
    columns, rows = bench.summarize(records, latency=False, matmul_tflops=10 * best)
    assert rows[0]["fa4/best"] == "1.00x"  # the cap is far above
    assert columns.index("fa4/bar") == columns.index("fa4/best") + 1
    assert rows[0]["fa4/bar"] == f"{1 / 1.05:.2f}x" == "0.95x" and rows[0]["fa4/best"] == "1.00x"
    assert rows[1]["fa4/bar"] == "-"  # fa4 failed
    _, rows = bench.summarize(records, latency=False, matmul_tflops=best)  # 0.95x the matmul rate binds
    assert rows[0]["fa4/bar"] == f"{1 / 0.95:.2f}x" == "1.05x"
    assert bench.bar_tflops({"fa4": records[3]}, best) is None  # no peer ran
    assert "fa4/bar" not in bench.summarize(records, latency=False)[0]
    assert "fa4/bar" not in bench.summarize(records, latency=True, matmul_tflops=best)[0]


def test_bar_summary():
    """The lines under the table: per direction, rows that meet the bar and the lowest one; nothing
    without the column (no matmul rate) or without a measured fa4."""
    shape, other = SMALL, Shape(batch=1, seqlen_q=64, seqlen_k=64, heads=4, hdim=16, causal=False)
    records = [
        Record("sdpa-cudnn", "fwd", shape, "ok", ms=1.0, maxdiff=0.0),
        Record("fa4", "fwd", shape, "ok", ms=0.5, maxdiff=0.0),  # 2x the peer: meets it
        Record("sdpa-cudnn", "fwd", other, "ok", ms=1.0, maxdiff=0.0),
        Record("fa4", "fwd", other, "ok", ms=1.0, maxdiff=0.0),  # 1/1.05 of the bar
        Record("sdpa-cudnn", "bwd", shape, "ok", ms=1.0, maxdiff=0.0),
        Record("fa4", "bwd", shape, "error", reason="RuntimeError: x"),
    ]
    assert bench.bar_summary(records, 1e9) == "# fwd: fa4 meets the bar on 1 of 2 rows; lowest 0.952x (d16 s64)"
    assert bench.bar_summary(records, None) == ""
    # Unrounded: 0.999x of the bar is not met, though its table cell reads 1.00x.
    close = [Record("sdpa-cudnn", "fwd", shape, "ok", ms=1.0, maxdiff=0.0),
             Record("fa4", "fwd", shape, "ok", ms=1.0 / 1.05 / 0.999, maxdiff=0.0)]
    assert bench.summarize(close, latency=False, matmul_tflops=1e9)[1][0]["fa4/bar"] == "1.00x"
    assert bench.bar_summary(close, 1e9).startswith("# fwd: fa4 meets the bar on 0 of 1 rows; lowest 0.999x")


def test_matmul_rate():
    calls = []

    def timer(fn):
        fn()
        calls.append(1)
        return 2.0

    assert bench.matmul_rate(timer, n=64, device="cpu") == pytest.approx(2 * 64 ** 3 / 2e-3 / 1e12)
    assert calls == [1]


def test_nondet_column_is_not_a_peer():
    """With --deterministic, fa4's own non-deterministic run shares the row but fa4/best compares
    the deterministic fa4 with the peers only."""
    shape = SMALL
    records = [
        Record("sdpa-flash", "bwd", shape, "ok", ms=2.0, maxdiff=0.0),
        Record(bench.FA4_NONDET, "bwd", shape, "ok", ms=0.5, maxdiff=0.0),
        Record("fa4", "bwd", shape, "ok", ms=1.0, maxdiff=0.0),
    ]
    columns, rows = bench.summarize(records, latency=False)
    assert f"{bench.FA4_NONDET} TFLOP/s" in columns
    assert rows[0]["fa4/best"] == "2.00x"


def test_latency_table_in_microseconds():
    columns, rows = bench.summarize(_records(latency=True), latency=True)
    assert "fa4 us" in columns
    assert rows[0]["fa4 us"] == "1000.0" and rows[0]["sdpa-flash us"] == "2000.0"
    assert rows[0]["fa4/best"] == "1.50x"


def test_notes_group_failures():
    notes = bench.format_notes(_records()).splitlines()
    assert notes == [
        "flash-attn-4: n/a in 2 row(s): ModuleNotFoundError: No module named 'flash_attn'",
        "sdpa-cudnn: error in 1 row(s): RuntimeError: cudnn",
        "fa4: n/a in 1 row(s): NotImplementedError: no backward",
    ]


def test_header_has_versions():
    header = bench.collect_header(["--hdim", "128"])
    for key in ("date", "gpu", "torch", "triton", "nvidia-cutlass-dsl", "fa4", "flash-attn-4"):
        assert header[key]
    assert header["fa4"] == fa4.__version__
    assert header["command"] == "python -m fa4.bench --hdim 128"


def test_write_outputs(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    header = {"date": "2026-11-30T00:00:00", "gpu": "fake", "fa4": "0"}
    records = _records()
    paths = bench.write_outputs(tmp_path / "res", header, records, latency=False)
    assert [p.suffix for p in paths] == [".csv", ".json"]
    assert "no PNG" in capsys.readouterr().err

    lines = paths[0].read_text().splitlines()
    assert lines[:3] == ["# date: 2026-11-30T00:00:00", "# gpu: fake", "# fa4: 0"]
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    assert len(rows) == len(records)
    assert rows[3]["impl"] == "fa4" and float(rows[3]["ms"]) == 1.0 and rows[3]["maxdiff"] == "nan"
    assert float(rows[3]["tflops"]) == pytest.approx(records[3].tflops)
    assert rows[7]["status"] == "n/a" and rows[7]["tflops"] == ""

    payload = json.loads(paths[1].read_text())
    assert payload["header"] == header
    assert payload["records"][0]["seqlen_q"] == 37 and payload["records"][0]["causal"] is True
    assert payload["records"][3]["maxdiff"] == "nan"
    assert payload["summary"][0]["fa4/best"] == "1.50x" and "fa4/bar" not in payload["summary"][0]
    # With the run's matmul rate the summary carries fa4/bar (here 1.05x the best peer binds: 1.5 / 1.05).
    paths = bench.write_outputs(tmp_path / "bar", header, records, latency=False, matmul_tflops=1e6)
    assert json.loads(paths[1].read_text())["summary"][0]["fa4/bar"] == f"{1.5 / 1.05:.2f}x" == "1.43x"


def test_write_plot_when_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    header = {"date": "d", "gpu": "fake", "fa4": "0"}
    assert bench.write_plot(tmp_path / "p.png", header, _records(), latency=False)
    assert (tmp_path / "p.png").stat().st_size > 0


# ---------------------------------------------------------------- no GPU


def test_main_without_gpu_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main(["--hdim", "128", "--seqlen", "1024"]) == bench.EXIT_NO_GPU == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err


def test_main_with_empty_selection_exits_2(capsys):
    assert bench.main(["--hdim", "64", "--seqlen", "1024"]) == 2
    assert "no grid row" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the process exit code on a machine without a GPU")
def test_module_entry_point_without_gpu():
    proc = subprocess.run(
        [sys.executable, "-m", "fa4.bench", "--mode", "fwd"], capture_output=True, text=True, check=False, timeout=120
    )
    assert proc.returncode == 2 and "no CUDA GPU" in proc.stderr


def test_decode_mode_shapes_and_table():
    """--decode: the issue's GQA decode shapes; the table gives us (TB/s of K + V), fa4/best and
    fa4's K + V bandwidth over the copy bandwidth of the run."""
    shapes, directions = bench.plan(bench.parse_args(["--decode"]))
    assert [(s.batch, s.seqlen_q, s.seqlen_k, s.heads, s.hk, s.hdim) for s in shapes] == [
        (64, 1, 8192, 32, 8, 128), (8, 1, 32768, 32, 8, 128)]
    assert directions == ("fwd",)
    shape = shapes[0]
    assert shape.kv_bytes == 2 * 2 * 64 * 8192 * 8 * 128
    records = [Record("sdpa-cudnn", "fwd", shape, "ok", ms=0.5, maxdiff=0.0),
               Record("fa4", "fwd", shape, "ok", ms=0.25, maxdiff=1e-3)]
    columns, rows = bench.summarize_decode(records, copy_tbs=4.0)
    row = rows[0]
    tbs = shape.kv_bytes / 0.25e-3 / 1e12
    assert row["fa4 us (TB/s)"] == f"250.0 ({tbs:.2f})"
    assert row["fa4/best"] == "2.00x" and row["fa4/copy"] == f"{tbs / 4.0:.2f}" and row["hk"] == "8"
    assert "hk8" in bench.shape_label(shape)
    records.append(Record(bench.FA4_PAGED, "fwd", shape, "ok", ms=1.0, maxdiff=1e-3))
    columns, rows = bench.summarize_decode(records, copy_tbs=4.0)
    assert rows[0]["paged/best"] == "0.50x" and rows[0]["fa4/best"] == "2.00x"  # fa4's own columns are no peers
    assert "paged/peer" not in columns  # no peer on the paged cache in this run
    # flash-attn-4 on the same paged cache: compared with fa4's paged column only, never in fa4/best
    records.append(Record(bench.PEER_PAGED, "fwd", shape, "ok", ms=0.125, maxdiff=1e-3))
    columns, rows = bench.summarize_decode(records, copy_tbs=4.0)
    assert rows[0]["paged/peer"] == "0.12x" and rows[0]["fa4/best"] == "2.00x" and rows[0]["paged/best"] == "0.50x"
    # The KV cache step on the same paged cache: its time over the paged call's, never a peer.
    assert "kvcache/paged" not in columns
    records.append(Record(bench.FA4_KVCACHE, "fwd", shape, "ok", ms=1.25, maxdiff=1e-3))
    columns, rows = bench.summarize_decode(records, copy_tbs=4.0)
    assert rows[0]["kvcache/paged"] == "1.25" and rows[0]["paged/peer"] == "0.12x"
    assert rows[0]["fa4/best"] == "2.00x" and rows[0]["paged/best"] == "0.50x"


def test_offgrid_cases_and_flops():
    """`python -m fa4.bench --offgrid` (fa4/offgrid.py): the mixed varlen lengths, the exact pair
    counts (bottom-right causal), the option parsing and the exit code without a GPU."""
    from fa4 import offgrid
    from fa4.config import AttnProblem

    lens = offgrid.mixed_lengths()
    assert sum(lens) == 16384 and all(1 <= n <= 4096 for n in lens) and len(set(lens)) > 1
    assert offgrid.pairs(4, 4, False) == 16 and offgrid.pairs(4, 4, True) == 10
    assert offgrid.pairs(2, 5, True) == 4 + 5  # query i sees keys up to i + sk - sq
    q, k, v, lq, lk, causal, varlen, flops = offgrid.build(("mixed", None, 4, 2, 64, True, True), device="cpu")
    assert varlen and causal and q.shape == (sum(lq), 4, 64) and k.shape == (sum(lk), 2, 64)
    assert flops == 4 * 4 * 64 * sum(n * (n + 1) // 2 for n in lq)
    for name, case in offgrid.CASES.items():  # every case's shape is consistent (no tensors built)
        assert case[2] % case[3] == 0, name
    assert offgrid.parse_items(["fwd.l2_section_mb=0", "bwd.section=4", "bwd.kv_split=2"]) == {
        "fwd": {"l2_section_mb": 0}, "bwd": {"kv_split": 2}, "section": 4}
    with pytest.raises(SystemExit):
        offgrid.parse_items(["l2_section_mb=0"])
    # Only fa4's cells take a variant's name (v0.28: rounds 2-3 had labelled the peers as variants).
    assert offgrid.cell_label("flash-attn-4", "fwd.l2_section_mb=0") == "flash-attn-4"
    assert offgrid.cell_label("fa4", "fwd.l2_section_mb=0") == "fa4[fwd.l2_section_mb=0]"
    assert offgrid.cell_label("fa4", "") == "fa4"
    # The overrides patch the family's make_config and the launch sections, and undo them.
    hooks = offgrid.Overrides("sm90")
    try:
        from fa4.bwd import sm90 as bwd90
        from fa4.fwd import sm90 as fwd90

        p = AttnProblem("bf16", 2, 4096, 4096, 8, 8, 128, 128, 128 ** -0.5, causal=True)
        assert fwd90.make_config(p, None, "sm_90a", True).l2_section_mb == 16
        hooks.use(offgrid.parse_items(["fwd.l2_section_mb=0", "bwd.section=4"]))
        assert fwd90.make_config(p, None, "sm_90a", True).l2_section_mb == 0
        assert bwd90.LAUNCH_ORDER.section == bwd90.LAUNCH_ORDER.det_section == 4
        hooks.use(offgrid.parse_items([]))
        assert fwd90.make_config(p, None, "sm_90a", True).l2_section_mb == 16
        assert bwd90.LAUNCH_ORDER.section is None
    finally:
        hooks.restore()
    if not torch.cuda.is_available():
        assert bench.main(["--offgrid", "--cases", "varlen-d128"]) == bench.EXIT_NO_GPU


def test_kvcache_bench_step_equals_the_paged_call(monkeypatch):
    """--decode's fa4-kvcache16 appends each sequence's last token again at its own position, so
    the cache and the output stay the paged call's (the kernel emulated here, on the CPU)."""
    from fa4 import interface, validate
    from fa4.testing import attention_ref

    def emulate(q, k, v, seqused_k=None, page_table=None, causal=False, **kw):
        outs = []
        for b in range(q.shape[0]):
            keys, vals = k[page_table[b].long()].flatten(0, 1), v[page_table[b].long()].flatten(0, 1)
            n = int(seqused_k[b])
            outs.append(attention_ref(q[b:b + 1], keys[None, :n], vals[None, :n], causal=causal)[0].to(q.dtype))
        return torch.cat(outs), None

    monkeypatch.setattr(interface, "flash_attn_varlen_func", emulate)
    monkeypatch.setattr(fa4, "flash_attn_varlen_func", emulate)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*s, generator=gen).to(torch.bfloat16) for s in ((2, 1, 4, 64), (2, 40, 2, 64), (2, 40, 2, 64)))
    with validate.allow_any_device():
        step = bench.fa4_kvcache_impl().setup(q, k, v, True, False)
        plain = bench.fa4_paged_impl().setup(q, k, v, True, False)
        first = step.run()
        assert torch.equal(first, plain.run()) and torch.equal(step.run(), first)
