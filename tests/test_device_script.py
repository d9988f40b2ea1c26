"""The pending steps of tools/device_run.sh (the ones written for the next GPU lease) name only
things that exist: a typo in a config field, an off-grid case, a test id or a sweep variant would
cost a device call to find (CPU: the script is read as text, nothing runs)."""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import subprocess

import pytest

from fa4 import offgrid
from fa4.bwd.sm80 import BwdSm80Config
from fa4.bwd.sm90 import BwdSm90Config
from fa4.fwd.sm80 import FwdSm80Config
from fa4.fwd.sm90 import FwdSm90Config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tools", "device_run.sh")
PENDING = re.compile(r"^(next30\w*|next35\w*|next36\w*|next37\w*|next38\w*|next39\w*|next4[0-9]\w*|next7[0-9]\w*|next8[0-9]\w*|next9[0-9]\w*)$")  # the steps the next leases run (RESULTS Next)
FIELDS = {"fwd": {f.name for f in dataclasses.fields(FwdSm90Config)},
          "bwd": {f.name for f in dataclasses.fields(BwdSm90Config)}}
# A step's --arch sm80 names the sm80 family's configs.
FIELDS_SM80 = {"fwd": {f.name for f in dataclasses.fields(FwdSm80Config)},
               "bwd": {f.name for f in dataclasses.fields(BwdSm80Config)}}


def _steps() -> dict[str, list[str]]:
    """Step name -> its body's command words (comments dropped, continuation lines joined)."""
    text = open(SCRIPT).read().replace("\\\n", " ")
    steps, name, body = {}, None, []
    for line in text.splitlines():
        m = re.match(r"if has (\w+); then", line.strip())
        if m:
            name, body = m.group(1), []
            continue
        if name and line.strip() == "fi":
            steps[name] = body
            name = None
            continue
        if name:
            code = line.split(" #")[0] if not line.strip().startswith("#") else ""
            body.extend(shlex.split(code, posix=True)) if code.strip() else None
    return steps


def test_script_parses():
    subprocess.run(["bash", "-n", SCRIPT], check=True)


def _pending():
    steps = {n: words for n, words in _steps().items() if PENDING.match(n)}
    assert steps, "no pending steps found"
    return steps


@pytest.mark.parametrize("name", sorted(_pending()))
def test_pending_step_names_what_exists(name):
    words = _pending()[name]
    fields = FIELDS_SM80 if any(w == "--arch" and n == "sm80" for w, n in zip(words, words[1:])) else FIELDS
    for i, w in enumerate(words):
        nxt = words[i + 1] if i + 1 < len(words) else ""
        if w in ("--variant", "--set"):
            over = offgrid.parse_items(nxt.split())
            for direction in ("fwd", "bwd"):
                unknown = set(over[direction]) - fields[direction]
                assert not unknown, f"{name}: {w} {nxt!r}: no {direction} config field {sorted(unknown)}"
        elif w == "--cases":
            unknown = [c for c in nxt.split(",") if c not in offgrid.CASES]
            assert not unknown, f"{name}: unknown off-grid cases {unknown}"
        elif re.match(r"^tests/\w+\.py(::\w+)?$", w):
            path, _, test = w.partition("::")
            assert os.path.exists(os.path.join(ROOT, path)), f"{name}: {path} does not exist"
            if test:
                assert re.search(rf"^def {test}\(", open(os.path.join(ROOT, path)).read(), re.M), \
                    f"{name}: no test {test} in {path}"
        elif re.match(r"^\w+:[\w,=./]+$", w) and "tools/sweep_fwd.py" in words:  # a sweep_fwd variant
            for item in w.partition(":")[2].split(","):
                field = item.partition("=")[0]
                assert field in FIELDS["fwd"] | {"hd", "causal"}, f"{name}: sweep variant {w}: no field {field}"
        elif w.startswith("tools/") and w.endswith(".py"):
            assert os.path.exists(os.path.join(ROOT, w)), f"{name}: {w} does not exist"


def _sweep_fwd_calls(words):
    """The ``tools/sweep_fwd.py`` invocations among a step's words: each one's arguments up to the
    next redirection or command."""
    calls = []
    for i, w in enumerate(words):
        if w == "tools/sweep_fwd.py":
            args = []
            for a in words[i + 1:]:
                if a.startswith(">") or a in ("2>&1", "python3", "timeout", "echo", "|", ";", "&&"):
                    break
                args.append(a)
            calls.append(args)
    return calls


@pytest.mark.parametrize("name", sorted(_pending()))
def test_pending_sweeps_time_something(name):
    """A pending step's forward sweeps select rows: without ``--any-pair`` only the targets grid's
    (head dim, seqlen) pairs run, and a sweep that matches none times nothing (session 57 lost a
    call that way; sweep_fwd.py now refuses it too)."""
    from fa4 import bench

    for args in _sweep_fwd_calls(_pending()[name]):
        if "--any-pair" in args:
            continue
        opt = {a: b for a, b in zip(args, args[1:]) if a in ("--hdim", "--seqlen", "--causal")}
        hd = bench._int_list(opt["--hdim"]) if "--hdim" in opt else None
        sl = bench._int_list(opt["--seqlen"]) if "--seqlen" in opt else None
        causal = opt.get("--causal", "both")
        assert bench.select_grid(hd, sl, causal), f"{name}: sweep_fwd.py {' '.join(args)} selects no grid row"
