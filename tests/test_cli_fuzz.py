"""No traceback anywhere a user can reach: generated command lines for every subcommand, with
missing, empty, unreadable, truncated, hostile and enormous inputs, wrong option values and
outputs that are directories, missing or unwritable. Bad input: exit 2 and one line saying
what is wrong; good input: exit 0 and something said; never a traceback, never a silent
success. Most run in-process through `gputrace.cli.main`; a sample runs as real processes."""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import random
import shutil
import sqlite3
import subprocess
from collections import Counter
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pytest

from gputrace.cli import main
from tests.conftest import GPUTRACE
from tests.test_reliability import _seeds

IN_PROCESS = 1200
SUBPROCESSES = 24
DIFFS = 80


@dataclass
class Case:
    argv: list[str]
    expect: str        # ok | error | either | help | job:N (record: the job's exit code)
    untraced: bool = False   # record: the output cannot be written, the job runs untraced


class Corpus:
    """Files the generated command lines name, made once."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.n = 0
        arrow, kineto, nsys = _seeds(root, None)
        self.arrow = self._file("seed.arrow", arrow)
        self.kineto = self._file("seed.json", kineto)
        self.nsys = self._file("seed.sqlite", nsys)
        rng = random.Random(0)
        self.truncated = [self._file(f"cut{n}.arrow", arrow[:n])
                          for n in (9, 64, len(arrow) // 3, len(arrow) // 2, len(arrow) - 7)]
        d = root / "empty-dir"
        d.mkdir()
        through = root / "a-file"
        through.write_text("x")
        dangling = root / "dangling.arrow"
        dangling.symlink_to(root / "nowhere")
        unreadable = self._file("unreadable.arrow", arrow)
        unreadable.chmod(0)
        enormous = root / "enormous.arrow"
        with open(enormous, "wb") as f:     # 4 GiB, sparse: zeros all the way
            f.truncate(4 << 30)
        enormous_json = root / "enormous.json"
        with open(enormous_json, "wb") as f:
            f.truncate(1 << 30)
        rand = bytes(rng.randrange(256) for _ in range(4096))
        other = root / "other-schema.arrow"
        t = pa.table({"x": [1, 2, 3], "kind": ["a", "b", "c"]})
        with pa.ipc.new_file(other, t.schema) as w:
            w.write_table(t)
        bad_types = root / "bad-types.arrow"
        t = pa.table({"kind": [1], "start_ns": ["soon"]}).replace_schema_metadata(
            {"gputrace": json.dumps({"format": "gputrace-trace", "version": 1})})
        with pa.ipc.new_file(bad_types, t.schema) as w:
            w.write_table(t)
        newer = root / "newer.arrow"
        t = t.replace_schema_metadata({"gputrace": json.dumps({"format": "gputrace-trace",
                                                               "version": 99})})
        with pa.ipc.new_file(newer, t.schema) as w:
            w.write_table(t)
        db = root / "not-nsys.sqlite"
        con = sqlite3.connect(db)
        con.execute("CREATE TABLE people (name TEXT)")
        con.commit()
        con.close()
        self.bad_inputs = [
            str(root / "missing.arrow"), str(self._file("empty.arrow", b"")),
            str(self._file("empty.json", b"")), str(self._file("empty.sqlite", b"")),
            str(self._file("empty", b"")), str(d), str(through / "x.arrow"), str(dangling),
            str(enormous), str(enormous_json), str(self._file("random.arrow", rand)),
            str(self._file("random.json", rand)), str(self._file("random.bin", rand)),
            str(self._file("random.json.gz", rand)),
            str(self._file("garbage.json.gz", gzip.compress(rand))),
            str(self._file("list.json", b"[1, 2, 3]")), str(self._file("null.json", b"null")),
            str(self._file("object.json", b'{"a": {"b": [1, 2]}}')),
            str(self._file("events-not-list.json", b'{"traceEvents": 5}')),
            str(self._file("events-junk.json", b'{"traceEvents": [1, "x", null, []]}')),
            str(self._file("deep.json", b"[" * 2000 + b"]" * 2000)),
            str(self._file("half.json", kineto[: len(kineto) // 2])),
            str(db), str(other), str(bad_types), str(newer), str(root / ("x" * 5000)),
            str(root / "new\nline.arrow"), str(root / "bell\x07.json"),
        ]
        self.unreadable = str(unreadable)   # root reads it all the same: either outcome
        # well-formed, but odd: any outcome, said properly
        from gputrace.trace import write_trace

        write_trace(root / "no-rows.arrow", {"host": "h"})
        odd_nsys = root / "odd-nsys.sqlite"
        odd_nsys.write_bytes(nsys)
        con = sqlite3.connect(odd_nsys)
        con.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES "
                    "('soon', NULL, 'gpu', -1, 'x', 0, 99, 99)")
        con.execute("INSERT INTO NVTX_EVENTS VALUES (5, 1, 59, NULL, 77, NULL, 0)")
        con.commit()
        con.close()
        self.odd_inputs = [
            str(root / "no-rows.arrow"), str(odd_nsys),
            str(self._file("odd-values.json", json.dumps({"traceEvents": [
                {"ph": "X", "ts": "abc", "dur": -5, "name": None, "pid": [], "tid": {}},
                {"ph": "X", "cat": "kernel", "ts": 1e300, "dur": 1e300, "name": "k",
                 "args": {"correlation": "x", "device": -1}},
                {"ph": "X", "cat": "gpu_memcpy", "ts": 5, "dur": 1, "name": "Memcpy HtoD",
                 "args": {"bytes": -1e30}},
                {"ph": "B", "ts": 1, "name": "ProfilerStep#x"}]}).encode())),
            str(self._file("samples-only.json", json.dumps({"traceEvents": [
                {"ph": "C", "ts": 1, "name": "mem", "pid": 1, "args": {"v": 1}}]}).encode())),
        ]
        self.shard_template = self._file("shard.arrow", arrow)
        # TensorFlow profiles: a real run's log directory and trace-viewer JSON (reading the
        # XPlane needs TensorFlow's schema: without it, the log directory is bad input),
        # copied here since export's default output lands beside its input
        tf_data = Path(__file__).resolve().parent / "data" / "tf"
        self.tf_logdir = str(shutil.copytree(tf_data / "logdir", root / "tf-logdir"))
        self.tf_json = str(shutil.copy(tf_data / "vm.trace.json.gz", root / "vm.trace.json.gz"))
        self.tf_logdir_ok = importlib.util.find_spec("tensorflow") is not None
        (xplane,) = Path(self.tf_logdir).rglob("*.xplane.pb")
        xp = xplane.read_bytes()
        bad_logdir = root / "bad-logdir" / "plugins" / "profile" / "run"
        bad_logdir.mkdir(parents=True)
        (bad_logdir / "h.xplane.pb").write_bytes(rand)
        self.bad_inputs += [
            str(self._file("random.xplane.pb", rand)), str(self._file("empty.xplane.pb", b"")),
            str(self._file("half.xplane.pb", xp[: len(xp) // 2])), str(root / "bad-logdir"),
            str(self._file("tf-junk.trace.json", json.dumps({"traceEvents": [
                {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
                {"ph": "X", "pid": 1, "tid": 1, "ts": "soon", "name": "MatMul"}]}).encode())),
        ]
        self.odd_inputs.append(str(self._file("tf-odd.trace.json", json.dumps({
            "stackFrames": {"1": {"name": 5}}, "traceEvents": [
                {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
                {"ph": "M", "name": "thread_name", "pid": 1, "tid": [], "args": None},
                {"ph": "X", "pid": 1, "tid": [], "ts": 1e300, "dur": -1, "name": None,
                 "sf": 1, "args": {"tf_function_call": 1}},
                {"ph": "X", "pid": 1, "tid": 2, "ts": 5, "dur": 1, "name": "a/b:Mul"}]}
        ).encode())))

    def foreign(self, rng: random.Random) -> tuple[str, str]:
        """Another tool's trace and what reading it gives."""
        pick = rng.choice([self.kineto, self.nsys, self.tf_json, self.tf_logdir])
        if pick == self.tf_logdir and not self.tf_logdir_ok:
            return pick, "error"
        return str(pick), "ok"

    def _file(self, name: str, data: bytes) -> Path:
        p = self.root / name
        p.write_bytes(data)
        return p

    def fresh(self, suffix: str) -> str:
        self.n += 1
        return str(self.root / "out" / f"o{self.n}{suffix}")

    def bad_outputs(self, suffix: str) -> list[str]:
        return [str(self.root / "empty-dir"), str(self.root / "no-such-dir" / f"x{suffix}"),
                f"/proc/x{suffix}", str(self.root / "a-file" / f"x{suffix}")]

    def unclosed(self) -> str:
        """A trace path whose recording left its shards behind (recoverable)."""
        self.n += 1
        d = self.root / f".u{self.n}.arrow.abcdefgh.shards"
        d.mkdir()
        shutil.copy(self.shard_template, d / "process-1.arrow")
        return str(self.root / f"u{self.n}.arrow")


class Gen:
    def __init__(self, rng: random.Random, c: Corpus) -> None:
        self.rng, self.c = rng, c

    def pick(self, good: list[str], bad: list[str], p_bad: float = 0.3) -> tuple[str, bool]:
        if bad and self.rng.random() < p_bad:
            return self.rng.choice(bad), True
        return self.rng.choice(good), False

    def options(self, spec: dict[str, tuple[list[str], list[str]]], p: float = 0.3
                ) -> tuple[list[str], bool]:
        """Some of the options in `spec` (flag: no values), each with a good or bad value."""
        out: list[str] = []
        bad = False
        for name, (good, wrong) in spec.items():
            if self.rng.random() >= p:
                continue
            if not good and not wrong:
                out.append(name)
                continue
            value, b = self.pick(good, wrong)
            bad |= b
            out += [name, value] if self.rng.random() < 0.8 else [f"{name}={value}"]
        if self.rng.random() < 0.04:
            out.append(self.rng.choice(["--bogus", "-Z", "--json=yes"]))
            bad = True
        return out, bad

    def traces(self, foreign_ok: bool = True) -> tuple[list[str], str]:
        """1-2 trace arguments and what to expect of them alone."""
        r = self.rng
        picks = []
        for _ in range(1 if r.random() < 0.8 else 2):
            x = r.random()
            if x < 0.35:
                picks.append((str(self.c.arrow), "ok", "gputrace"))
            elif x < 0.5:
                path, expect = self.c.foreign(r)
                picks.append((path, expect, "foreign" if expect == "ok" else "bad"))
            elif x < 0.8:
                picks.append((r.choice(self.c.bad_inputs), "error", "bad"))
            elif x < 0.85:
                odd = r.choice(self.c.odd_inputs)
                picks.append((odd, "either", "gputrace" if odd.endswith(".arrow") else
                              "foreign"))
            elif x < 0.95:
                picks.append((str(r.choice(self.c.truncated)), "either", "gputrace"))
            else:
                picks.append((self.c.unreadable, "either", "gputrace"))
        paths = [p for p, _, _ in picks]
        kinds = {k for _, _, k in picks}
        if "bad" in kinds:
            return paths, "error"
        if kinds == {"gputrace", "foreign"}:
            return paths, "error"          # mixing: import the others first
        if len(picks) > 1 or any(e == "either" for _, e, _ in picks):
            return paths, "either"
        return paths, "ok"

    def shuffle(self, opts: list[str], positional: list[str]) -> list[str]:
        return opts + positional if self.rng.random() < 0.5 else positional + opts

    def analyze(self) -> Case:
        paths, expect = self.traces()
        opts, bad = self.options({
            "--json": ([], []), "--shared-io": ([], []),
            "--rank": (["0"], ["x", "-1", "7", "99999999999999999999", ""]),
            "--skip": (["0", "1", "100"], ["-1", "x", "1.5"]),
            "--gpus": (["2,4", "8", "1,2,3"], ["0", "x,2", "", "-4", "1e3", "2,,0"]),
            "--link-bandwidth": (["7GB/s", "56Gb/s", "12.5e9", "100MiB/s"],
                                 ["fast", "0GB/s", "-1", "7XB/s", "1e999"]),
            "--what-if": (["gpus=4", "bandwidth=2x", "bucket_cap_mb=5", "bucket=one",
                           "gpus=4,bandwidth=0.5x", "bucket=1MiB"],
                          ["gpus=0", "foo=1", "bandwidth=x", "bucket=abc", "gpus=",
                           "bandwidth=-2x", "bucket_cap_mb=nan", "gpus=1e3"]),
        })
        return Case(["analyze", *self.shuffle(opts, paths)], "error" if bad else expect)

    def diff(self) -> Case:
        """Two inputs of one trace each, analyze's options and --fail-if-slower (a limit no
        diff of the corpus's traces passes: exit 1 is for a run that got slower)."""
        sides = []
        while len(sides) < 2:
            paths, expect = self.traces()
            if len(paths) == 1:
                sides.append((paths[0], expect))
        expects = {e for _, e in sides}
        expect = "error" if "error" in expects else "either" if "either" in expects else "ok"
        opts, bad = self.options({
            "--json": ([], []),
            "--rank": (["0"], ["x", "-1", "7"]),
            "--skip": (["0", "1"], ["-1", "x"]),
            "--gpus": (["2,4", "8"], ["0", "x,2", ""]),
            "--fail-if-slower": (["1e9", "1e6"], ["x", "-1", "nan", ""]),
        })
        return Case(["diff", *self.shuffle(opts, [p for p, _ in sides])],
                    "error" if bad else expect)

    def info(self) -> Case:
        paths, expect = self.traces()
        opts, bad = self.options({"--json": ([], [])}, p=0.5)
        return Case(["info", *self.shuffle(opts, paths)], "error" if bad else expect)

    def export(self) -> Case:
        paths, expect = self.traces()
        fmt = "perfetto" if self.rng.random() < 0.2 else "chrome"
        opts, bad = self.options({"--format": ([fmt], ["svg", "", "Chrome"])}, p=0.8)
        if self.rng.random() < 0.8:
            out, b = self.pick([self.c.fresh(".json")], self.c.bad_outputs(".json"))
            opts += ["-o", out]
            bad |= b
        return Case(["export", *self.shuffle(opts, paths)], "error" if bad else expect)

    def import_(self) -> Case:
        r = self.rng
        x = r.random()
        if x < 0.5:
            path, expect = self.c.foreign(r)
            paths = [path]
        elif x < 0.6:
            paths, expect = [str(self.c.arrow)], "error"     # a gputrace trace already
        else:
            paths, expect = [r.choice(self.c.bad_inputs)], "error"
        out, bad = self.pick([self.c.fresh(".arrow")], self.c.bad_outputs(".arrow"))
        return Case(["import", *self.shuffle(["-o", out], paths)], "error" if bad else expect)

    def probe(self) -> Case:
        """Always with one wrong value: a probe that runs takes seconds (test_probe runs it)."""
        opts, _ = self.options({"--json": ([], []), "--no-save": ([], []),
                                "--size": (["64MiB"], []), "--procs": (["2"], [])}, p=0.3)
        wrong = self.rng.choice([
            ["--size", "1KB"], ["--size", "abc"], ["--size", "-5MiB"], ["--size", "0"],
            ["--procs", "0"], ["--procs", "-1"], ["--procs", "x"],
            ["--dir", str(self.c.root / "no-such-dir")], ["--dir", str(self.c.arrow)],
            ["--quick", "--full"], ["--bogus"], ["stray-argument"]])
        return Case(["probe", *opts, *wrong], "error")

    def recover(self) -> Case:
        r = self.rng
        x = r.random()
        if x < 0.35:
            trace, expect = self.c.unclosed(), "ok"
        elif x < 0.5:
            trace, expect = str(self.c.arrow), "error"                  # closed
        elif x < 0.6:
            trace, expect = str(self.c.root / "empty-dir"), "error"     # not a shard dir
        else:
            trace, expect = r.choice(self.c.bad_inputs), "error"
        opts: list[str] = []
        if r.random() < 0.5:
            out, bad = self.pick([self.c.fresh(".arrow")],
                                 [*self.c.bad_outputs(".arrow"), str(self.c.arrow)])
            opts += ["-o", out]
            expect = "error" if bad else expect
        if r.random() < 0.05:
            opts.append("--bogus")
            expect = "error"
        return Case(["recover", *self.shuffle(opts, [trace])], expect)

    def record(self) -> Case:
        r = self.rng
        opts, bad = self.options({
            "-q": ([], []), "--redact-argv": ([], []),
            "--hz": (["50", "200"], ["0", "-1", "x", "nan", "inf", "1e400", "20000"]),
            "--collectors": (["host", "host,torch", "torch", ","], ["foo", "host,foo"]),
            "--gpu-timeline": (["auto", "kineto"], ["x", ""]),
            "--kill-after": (["5"], ["0", "-1", "x", "nan", "inf"]),
            "--tf-steps": (["5:10", "all", "off", "0:1"], ["x", "5", "-1:2", "3:0", "", "a:b"]),
        })
        untraced = False
        if r.random() < 0.7:
            x = r.random()
            if x < 0.6:
                opts += ["-o", self.c.fresh(".arrow")]
            elif x < 0.8:   # a directory, or a trace that exists without -f: refused
                opts += ["-o", r.choice([str(self.c.root / "empty-dir"), str(self.c.arrow)])]
                bad = True
            else:           # cannot be written: the job runs untraced
                opts += ["-o", r.choice(self.c.bad_outputs(".arrow")[1:])]
                untraced = True
        else:
            opts += ["-o", self.c.fresh(".arrow")]
        jobs = [(["true"], "job:0"), (["false"], "job:1"), (["no-such-program-xyz"], "job:127"),
                ([str(self.c.root / "empty-dir")], "job:126"), ([], "error")]
        cmd, expect = r.choice(jobs)
        if not bad and expect != "error" and r.random() < 0.7:
            bad = True      # most generated records stop at an option: a run costs ~0.2 s
            opts += r.choice([["--hz", "0"], ["--collectors", "nope"], ["--kill-after", "-3"]])
        return Case(["record", *opts, "--", *cmd], "error" if bad else expect,
                    untraced=untraced and not bad and expect != "error")

    def top(self) -> Case:
        argv, expect = self.rng.choice([
            ([], "usage"), (["--version"], "help"), (["--help"], "help"),
            (["nosuch"], "error"), (["--bogus"], "error"), (["analyze"], "error"),
            (["info"], "error"), (["export"], "error"), (["import"], "error"),
            (["recover"], "error"), (["record"], "error"),
            ([self.rng.choice(["analyze", "info", "export", "import", "probe", "recover",
                               "record"]), "--help"], "help")])
        return Case(argv, expect)

    def case(self) -> Case:
        return self.rng.choice([self.analyze, self.analyze, self.info, self.export,
                                self.import_, self.probe, self.recover, self.record,
                                self.top])()


def check(case: Case, rc: int, out: str, err: str) -> None:
    where = f"gputrace {case.argv!r} -> {rc}\nstdout: {out[-2000:]}\nstderr: {err[-2000:]}"
    assert "Traceback" not in out + err, where
    said = [ln for ln in err.splitlines() if ln.strip()]
    if case.expect == "help":
        assert rc == 0 and out.strip(), where
        return
    if case.expect == "usage":
        assert rc == 2 and "usage" in out, where
        return
    if case.expect.startswith("job:"):
        assert rc == int(case.expect[4:]), where
        if case.untraced:
            assert sum("the job runs untraced" in ln for ln in said) == 1, where
        return
    assert rc in (0, 2), where
    if case.expect != "either":
        assert rc == (2 if case.expect == "error" else 0), where
    if rc == 2:
        errors = [ln for ln in said if ln.startswith("gputrace: error: ")]
        assert len(errors) == 1 and len(errors[0]) > 25, where
        assert all(ln.startswith("gputrace: ") for ln in said), where
        assert not out, where
    else:
        assert out.strip() or said, where   # never a silent success


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)               # default outputs land here, never in the repo
    monkeypatch.setenv("COLUMNS", "100")
    data = Path(__file__).resolve().parent / "data"
    before = sorted(data.rglob("*"))
    yield Corpus(tmp_path)
    assert sorted(data.rglob("*")) == before, "a command wrote into tests/data"


def _in_process(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:             # argparse's --help and --version
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def test_generated_command_lines_never_give_a_traceback(corpus):
    gen = Gen(random.Random(19), corpus)
    seen: Counter[tuple[str, str]] = Counter()
    for _ in range(IN_PROCESS):
        case = gen.case()
        try:
            rc, out, err = _in_process(case.argv)
        except Exception as e:  # noqa: BLE001
            pytest.fail(f"gputrace {case.argv!r} raised {type(e).__name__}: {e}")
        check(case, rc, out, err)
        seen[(case.argv[0] if case.argv else "", str(rc))] += 1
    commands = {c for c, _ in seen}
    assert commands >= {"analyze", "info", "export", "import", "probe", "recover", "record"}
    for c in commands - {"probe", "", "--version", "--help", "nosuch", "--bogus"}:
        assert seen[(c, "0")] and seen[(c, "2")], (c, seen)   # both outcomes were exercised
    print(f"{IN_PROCESS} generated command lines in-process: {dict(sorted(seen.items()))}")


def test_generated_diff_command_lines_never_give_a_traceback(corpus):
    """`diff` on its own stream of cases (the other commands' stay as they were)."""
    gen = Gen(random.Random(23), corpus)
    seen: Counter[str] = Counter()
    cases = [Case(["diff"], "error"), Case(["diff", str(corpus.arrow)], "error"),
             Case(["diff", "--help"], "help")] + [gen.diff() for _ in range(DIFFS)]
    for case in cases:
        rc, out, err = _in_process(case.argv)
        check(case, rc, out, err)
        seen[str(rc)] += 1
    assert seen["0"] and seen["2"], seen


def test_diff_help_after_the_runs(corpus):
    """`--help` written after the runs (`diff a.arrow b.arrow --help`, or after `--`) prints
    diff's help and exits 0, as it does before them."""
    a = str(corpus.arrow)
    for argv in (["diff", a, a, "--help"], ["diff", a, "--", a, "-h"], ["diff", "--help"]):
        rc, out, err = _in_process(argv)
        assert rc == 0 and not err, (argv, rc, err)
        assert out.startswith("usage: gputrace diff") and "--fail-if-slower" in out, argv


@pytest.mark.slow
def test_generated_command_lines_as_real_processes(corpus):
    gen = Gen(random.Random(1919), corpus)
    env = dict(os.environ, COLUMNS="100")
    for _ in range(SUBPROCESSES):
        case = gen.case()
        p = subprocess.run([*GPUTRACE, *case.argv], capture_output=True, text=True,
                           timeout=120, env=env, cwd=corpus.root)
        check(case, p.returncode, p.stdout, p.stderr)


def test_a_reader_that_goes_away_is_not_a_traceback(corpus):
    """`gputrace analyze trace | head -c1`: the pipe closes under the writer. Nothing on
    stderr; the exit code is 0 or rich's 1 for a broken pipe, depending on who notices."""
    for cmd in ("info", "analyze", "analyze --json"):
        p = subprocess.run(f"{' '.join(GPUTRACE)} {cmd} {corpus.arrow} | head -c1 >/dev/null;"
                           " exit ${PIPESTATUS[0]}", shell=True, executable="/bin/bash",
                           capture_output=True, text=True, timeout=60)
        assert p.returncode in (0, 1) and not p.stderr, (cmd, p.stderr)


def test_generated_window_and_capture_command_lines_never_give_a_traceback(corpus,
                                                                          monkeypatch):
    """The recording window's options and `capture`, on their own stream of cases: each
    good combination runs its job, each bad value or clash is one line and exit 2."""
    monkeypatch.setenv("GPUTRACE_RUN_DIR", str(corpus.root / "run"))   # no one else's job
    gen = Gen(random.Random(29), corpus)
    r = gen.rng
    values = {"--steps": (["0:3", "1000:20"], ["abc", "5:0", "-1:3", "", "1:x"]),
              "--delay": (["0", "2.5"], ["-2", "nan", "x"]),
              "--duration": (["1", "0.5"], ["0", "-1", "nan"]),
              "--capture-steps": (["5"], ["0", "-3", "x"]),
              "--on-demand": ([], [])}
    cases = [Case(["capture"], "error"), Case(["capture", "--all"], "error"),
             Case(["capture", "999999999"], "error"), Case(["capture", "1", "--all"], "error"),
             Case(["capture", "--all", "--steps", "0"], "error"), Case(["capture", "x"], "error"),
             Case(["capture", "--help"], "help"), Case(["record", "--on-demand"], "error")]
    for _ in range(20):
        names = r.sample(sorted(values), r.choice([1, 1, 2, 3]))
        opts, bad = [], False
        for n in names:
            if not values[n][0]:
                opts.append(n)
                continue
            v, b = gen.pick(*values[n])
            opts += [n, v] if r.random() < 0.8 else [f"{n}={v}"]
            bad |= b
        timed = "--delay" in names or "--duration" in names
        bad |= ("--steps" in names and timed) or \
            ("--on-demand" in names and ("--steps" in names or timed))
        cases.append(Case(["record", "-q", "-o", corpus.fresh(".arrow"), *opts, "--", "true"],
                          "error" if bad else "job:0"))
    seen: Counter[str] = Counter()
    for case in cases:
        rc, out, err = _in_process(case.argv)
        check(case, rc, out, err)
        seen[str(rc)] += 1
    assert seen["0"] and seen["2"], seen
