"""Run spin on ``model/lock.pml``: the protocol's checks and the mutations that must fail them.

Usage (from the repository root)::

    python model/check.py                 # the CI set: every check and every mutation, N=3
    python model/check.py --full          # larger bounds and N=4 where it fits (minutes)
    python model/check.py --list          # the names of every run, with what each checks
    python model/check.py --only safety_crash -D MAXTMO=1   # one run, a bound changed
    python model/check.py --json out.json # also write the figures as JSON

Each run is ``spin -a`` with the run's ``-D`` switches, ``gcc`` on the generated ``pan.c`` and
``./pan`` under a memory and time limit, in a private temporary directory (nothing is left in
the working tree). A check passes when pan reports 0 errors and a complete search; a mutation
passes when pan reports at least one error. Why a mutation list at all: a model that cannot fail
proves nothing, so each mutation removes one ingredient the protocol's correctness argument
uses, and the checker must notice.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "lock.pml")
MEMLIM_MB = 3500          # pan's own limit (-DMEMLIM); the address-space limit is a bit above
TIME_LIMIT_S = 600


@dataclass(frozen=True, kw_only=True)
class Run:
    """One spin run: what it checks, its switches, and whether it must find an error."""
    name: str
    what: str
    defines: tuple[str, ...] = ()
    progress: bool = False          # the LTL progress property under weak fairness
    expect_error: bool = False      # a mutation: the checker must fail
    pan_args: tuple[str, ...] = ()
    hash_bits: int = 21             # pan -w: 2M slots (chained under COLLAPSE: a size, not a cap)


@dataclass(kw_only=True)
class Result:
    name: str
    what: str
    defines: list[str]
    expect_error: bool
    errors: int | None = None
    complete: bool = False
    states: int | None = None
    transitions: int | None = None
    depth: int | None = None
    memory_mb: float | None = None
    seconds: float = 0.0
    first_error: str = ""
    ok: bool = False
    command: str = ""
    notes: list[str] = field(default_factory=list)


def bounds(*, n: int = 3, waiters: int = 2, cycles: int = 1, crash: int = 0, restart: int = 0,
           stall: int = 0, tmo: int = 0, impatient: int = 0) -> tuple[str, ...]:
    """The model's bounds as spin -D switches (see the head of lock.pml)."""
    return (f"N={n}", f"WAITERS={waiters}", f"CYCLES={cycles}", f"MAXCRASH={crash}",
            f"MAXRESTART={restart}", f"MAXSTALL={stall}", f"MAXTMO={tmo}",
            f"MAXIMPATIENT={impatient}")


# One fault kind per run: exhaustive runs of each fit the CI budget, all of them at once do not
# (N=3 with every fault enabled is beyond 60 M states). Three nodes are manager candidates;
# WAITERS of them take the lock.
FAULTS: dict[str, dict[str, int]] = {
    "elect": {"impatient": 1},                 # a second candidate campaigns concurrently
    "crash": {"crash": 1},                     # any node killed at any step
    "restart": {"crash": 1, "restart": 1, "waiters": 1},   # ... and rejoins with a new epoch
    "stall": {"stall": 1},                     # a node paused past the liveness timeout
    "timeout": {"tmo": 1},                     # LockTimeout withdrawals, retried
}

MUTATIONS: tuple[tuple[str, str, tuple[str, ...], bool], ...] = (
    # name, what breaks, switches (bounds included), progress run?
    ("mut_no_token_check", "the holder writes without check_token: a revoked holder's late "
     "write lands", bounds(stall=1) + ("MUT_NO_TOKEN_CHECK",), False),
    ("mut_no_recheck", "the manager notices a release only when the request line is idle "
     "(until slot == I): a release followed by a new request is never seen",
     bounds(cycles=2) + ("MUT_NO_RECHECK",), False),
    ("mut_no_cs_flush", "the holder releases before flushing its write: the next holder reads "
     "a stale line (lost update)", bounds() + ("MUT_NO_CS_FLUSH",), False),
    ("mut_no_rel_flush", "slots.release without flush + fence: the manager never sees the "
     "release", bounds() + ("MUT_NO_REL_FLUSH",), False),
    ("mut_no_state_flush", "slots.write_state without flush + fence: the grant is visible before "
     "the state line that names its token", bounds() + ("MUT_NO_STATE_FLUSH",), False),
    ("mut_no_term_check", "_still_manager does not re-read the MANAGER line: a deposed manager "
     "keeps granting", bounds(stall=1) + ("MUT_NO_TERM_CHECK",), False),
    ("mut_holder_first", "slots.write_state stores holder first (the order before #17): a torn "
     "line after a crash re-issues an old token", bounds(crash=1) + ("MUT_HOLDER_FIRST",), False),
    ("mut_no_revoke", "the manager never revokes a dead holder: the lock is held by nobody "
     "forever (progress)", bounds(crash=1) + ("MUT_NO_REVOKE",), True),
)


def ci_runs() -> list[Run]:
    """The runs the test suite makes (N=3): each check per fault kind, each mutation, and the
    two runs about the open findings (see model/README.md)."""
    runs = [Run(name=f"safety_{k}", what=f"safety under {k}", defines=bounds(**v))
            for k, v in FAULTS.items()]
    runs += [Run(name=f"progress_{k}", what=f"progress under {k}", defines=bounds(**v),
                 progress=True) for k, v in FAULTS.items() if k in ("elect", "crash")]
    runs.append(Run(name="residual_window", what="a stall inside a check -> store window "
                    "(the documented residual window) breaks the checks",
                    defines=bounds(stall=1) + ("RESIDUAL_WINDOW",), expect_error=True))
    runs.append(Run(name="open_stalls", what="pauses without assumptions A2/A3: the current code "
                    "fails (findings 2 and 3)", defines=bounds(stall=1) + ("OPEN_STALLS",),
                    expect_error=True))
    runs.append(Run(name="open_stalls_fixed", what="pauses without A2/A3, with the proposed fixes "
                    "FIX_HOLDER_LEASE and FIX_ELECTION_LAPSE", defines=bounds(stall=1) + (
                        "OPEN_STALLS", "FIX_HOLDER_LEASE", "FIX_ELECTION_LAPSE")))
    for name, what, defs, progress in MUTATIONS:
        runs.append(Run(name=name, what=what, defines=defs, expect_error=True, progress=progress))
    return runs


def full_runs() -> list[Run]:
    """Larger bounds for the README figures (minutes, not CI): three waiters at N=3, and N=4."""
    runs = []
    for k, v in FAULTS.items():
        v3 = {**v, "waiters": 3 if k != "restart" else 2}
        runs.append(Run(name=f"safety_n3w3_{k}", what=f"safety under {k}, three waiters",
                        defines=bounds(**v3), hash_bits=25))
    runs.append(Run(name="progress_stall", what="progress under stall",
                    defines=bounds(**FAULTS["stall"]), progress=True, hash_bits=24))
    for k in ("crash", "stall"):
        runs.append(Run(name=f"progress_n3w3_{k}", what=f"progress under {k}, three waiters",
                        defines=bounds(**{**FAULTS[k], "waiters": 3}), progress=True,
                        hash_bits=25))
    for k, v in FAULTS.items():
        runs.append(Run(name=f"safety_n4_{k}", what=f"safety under {k}, four nodes",
                        defines=bounds(n=4, **v), hash_bits=24))
    runs.append(Run(name="progress_n4_crash", what="progress under crash, four nodes",
                    defines=bounds(n=4, **FAULTS["crash"]), progress=True, hash_bits=24))
    runs.append(Run(name="open_stalls_fixed_elect", what="the proposed fixes, pauses and a "
                    "concurrent campaign", defines=bounds(stall=1, impatient=1) + (
                        "OPEN_STALLS", "FIX_HOLDER_LEASE", "FIX_ELECTION_LAPSE"), hash_bits=24))
    return runs


_NUM = r"([0-9.e+]+)"


def _parse(out: str, res: Result) -> None:
    m = re.search(r"errors: (\d+)", out)
    res.errors = int(m.group(1)) if m else None
    # pan prints large counts as %g (1.1e+08): read them as floats
    m = re.search(_NUM + r" states, stored", out)
    res.states = int(float(m.group(1))) if m else None
    m = re.search(_NUM + r" transitions \(= (?:stored|visited)\+matched\)", out)
    res.transitions = int(float(m.group(1))) if m else None
    m = re.search(r"depth reached (\d+)", out)
    res.depth = int(m.group(1)) if m else None
    m = re.search(_NUM + r"\s+total actual memory usage", out)
    res.memory_mb = float(m.group(1)) if m else None
    m = re.search(r"pan:\d*:?\s*(.*?)\s*\(at depth \d+\)", out)
    if m:
        res.first_error = m.group(1)
    elif "acceptance cycle" in out:
        res.first_error = "acceptance cycle (a lock attempt that never ends)"
    truncated = ("Search not completed" in out and res.errors == 0) or "out of memory" in out \
        or "max search depth too small" in out
    res.complete = res.errors is not None and not truncated
    if "max search depth too small" in out:
        res.notes.append("depth limit reached")
    if "out of memory" in out:
        res.notes.append("out of memory")


def run_one(run: Run, workdir: str, *, time_limit_s: int = TIME_LIMIT_S) -> Result:
    """Generate, compile and run pan for ``run`` in ``workdir``; parse its report."""
    res = Result(name=run.name, what=run.what, defines=list(run.defines),
                 expect_error=run.expect_error)
    dflags = [f"-D{d}" for d in run.defines] + (["-DPROGRESS"] if run.progress else [])
    t0 = time.monotonic()
    spin = subprocess.run(["spin", "-a", *dflags, MODEL], cwd=workdir, capture_output=True,
                          text=True)
    if spin.returncode != 0:
        res.notes.append("spin -a failed: " + (spin.stdout + spin.stderr)[-2000:])
        return res
    # -O1 compiles in a third of -O2's time, which is what the small CI runs spend most of; a
    # mutation's search stops at its first error (35-58k states), where even -O1's compile
    # (~2.5 s) is most of the run: -O0 compiles in ~0.7 s (the ten CI mutations, one core of the
    # 2-core VM: 35.0 -> 10.6 s). The complete searches keep -O1: pan at -O0 ran the progress
    # checks 1.5-2.2x slower (progress_elect 9.0 -> 20.3 s)
    opt = "-O2" if run.hash_bits >= 24 else "-O0" if run.expect_error else "-O1"
    cflags = [opt, "-w", f"-DMEMLIM={MEMLIM_MB}", "-DCOLLAPSE"]
    if run.progress:
        cflags.append("-DNFAIR=3")
    else:
        cflags.append("-DSAFETY")
    cc = subprocess.run(["gcc", *cflags, "-o", "pan", "pan.c"], cwd=workdir, capture_output=True,
                        text=True)
    if cc.returncode != 0:
        res.notes.append("gcc failed: " + cc.stderr[-2000:])
        return res
    pan = ["./pan", "-m20000", f"-w{run.hash_bits}"]
    if run.progress:
        pan += ["-a", "-f", "-N", "progress"]
    pan += list(run.pan_args)
    res.command = (f"spin -a {' '.join(dflags)} model/lock.pml && gcc {' '.join(cflags)} -o pan "
                   f"pan.c && {' '.join(pan)}")
    limit = f"ulimit -v {(MEMLIM_MB + 700) * 1024}; exec {' '.join(pan)}"
    try:
        p = subprocess.run(["bash", "-c", limit], cwd=workdir, capture_output=True, text=True,
                           timeout=time_limit_s)
        out = p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        res.notes.append(f"timed out after {time_limit_s} s")
    res.seconds = round(time.monotonic() - t0, 2)
    _parse(out, res)
    if run.expect_error:
        res.ok = bool(res.errors)
    else:
        res.ok = res.errors == 0 and res.complete
    return res


def with_defines(defines: tuple[str, ...], extra: list[str]) -> tuple[str, ...]:
    """``defines`` with each of ``extra`` added, replacing a switch of the same name."""
    names = {d.split("=", 1)[0] for d in extra}
    return tuple(d for d in defines if d.split("=", 1)[0] not in names) + tuple(extra)


def run_all(runs: list[Run], *, time_limit_s: int = TIME_LIMIT_S) -> list[Result]:
    out = []
    for run in runs:
        d = tempfile.mkdtemp(prefix="tract-spin-")
        try:
            out.append(run_one(run, d, time_limit_s=time_limit_s))
        finally:
            shutil.rmtree(d, ignore_errors=True)
    return out


def table(results: list[Result]) -> str:
    rows = ["| run | expect | errors | states stored | transitions | depth | MB | s | verdict |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {r.name} | {'error' if r.expect_error else '0 errors'} | {r.errors} | "
                    f"{r.states} | {r.transitions} | {r.depth} | {r.memory_mb} | {r.seconds} | "
                    f"{'ok' if r.ok else 'FAILED'}{' (' + r.first_error + ')' if r.first_error else ''}"
                    f"{' ' + '; '.join(r.notes) if r.notes else ''} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full", action="store_true", help="the larger bounds (minutes)")
    ap.add_argument("--only", action="append", default=[], help="run only these names")
    ap.add_argument("-D", dest="extra", action="append", default=[],
                    help="a spin -D switch for every run, replacing one of the same name "
                    "(e.g. -D N=4)")
    ap.add_argument("--list", action="store_true", help="list the runs and exit")
    ap.add_argument("--json", help="write the results as JSON to this file")
    ap.add_argument("--time-limit", type=int, default=TIME_LIMIT_S)
    args = ap.parse_args(argv)
    if shutil.which("spin") is None or shutil.which("gcc") is None:
        print("spin and gcc are needed (Debian: apt-get install -y spin gcc)", file=sys.stderr)
        return 2
    if args.list:
        for r in ci_runs() + full_runs():
            print(f"{r.name:28} {'must fail: ' if r.expect_error else ''}{r.what}")
        return 0
    runs = full_runs() if args.full else ci_runs()
    if args.only:
        pool = {r.name: r for r in ci_runs() + full_runs()}
        runs = [pool[n] for n in args.only]
    if args.extra:
        runs = [Run(**{**asdict(r), "defines": with_defines(r.defines, args.extra)}) for r in runs]
    results = run_all(runs, time_limit_s=args.time_limit)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=2)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
