"""`gputrace probe`: measure this machine's bandwidths once; later traces carry the result."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from gputrace.cli import CommandError, parse_bytes
from gputrace.probe import STEP_NAMES

HELP = "measure this machine's disk, cache, memory, PCIe, P2P and all-reduce bandwidths"
MIN_SIZE = 1 << 20


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="small sizes, 3 repeats (the default; about 30 s)")
    mode.add_argument("--full", dest="mode", action="store_const", const="full",
                      help="1 GiB files, 10 repeats, an all-reduce size sweep")
    p.set_defaults(mode="quick")
    p.add_argument("--dir", default=".", help="where to write the disk test file (default: .); "
                   "give a directory on the filesystem your training data lives on")
    p.add_argument("--size", help="bytes per test, e.g. 64MiB (default: 256MiB quick, 1GiB full)")
    p.add_argument("--procs", type=int, help="processes for the all-reduce "
                   "(default: one per GPU, or 2 on the CPU)")
    p.add_argument("--only", metavar="STEPS", help="measure only these, comma-separated: "
                   + ", ".join(STEP_NAMES))
    p.add_argument("--no-save", action="store_true",
                   help="do not save the result for this host (later traces will not carry it)")


def run(args: argparse.Namespace) -> int:
    from gputrace import probe

    size = int(parse_bytes(args.size, "--size")) if args.size else None
    if size is not None and size < MIN_SIZE:
        raise CommandError(f"--size must be at least 1MiB, not {args.size!r}")
    if not os.path.isdir(args.dir):
        raise CommandError(f"--dir {args.dir}: no such directory")
    if not os.access(args.dir, os.W_OK):
        raise CommandError(f"--dir {args.dir}: not writable")
    if args.procs is not None and args.procs < 1:
        raise CommandError("--procs must be at least 1")
    only = tuple(x.strip() for x in (args.only or "").split(",") if x.strip())
    bad = [x for x in only if x not in STEP_NAMES]
    if bad:
        raise CommandError(f"--only {args.only}: not a step: {', '.join(bad)} (steps: "
                           f"{', '.join(STEP_NAMES)})")
    plan = probe.plan(args.mode, size)
    try:
        result = _run_with_progress(probe, plan, args.dir, args.procs, only)
    except OSError as e:  # a full disk, an I/O error
        raise CommandError(f"probe failed: {e}") from None
    saved = None
    if not args.no_save:
        try:
            saved = probe.save(result)
        except OSError as e:
            print(f"gputrace: warning: could not save the probe: {e}", file=sys.stderr)
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        render(result, saved)
    return 0


def _run_with_progress(probe: Any, plan: Any, directory: str, procs: int | None,
                       only: tuple[str, ...] = ()) -> dict[str, Any]:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    con = Console(stderr=True)
    if not con.is_terminal:
        return dict(probe.run(plan, directory, procs, lambda label, i, n: print(
            f"gputrace probe: {label} ({i + 1}/{n})", file=sys.stderr, flush=True), only))
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=con, transient=True) as bar:
        task = bar.add_task("probe", total=len(probe.steps(plan, directory, procs, only)))

        def step(label: str, i: int, n: int) -> None:
            bar.update(task, description=f"measuring {label}", completed=i)

        out = dict(probe.run(plan, directory, procs, step, only))
        bar.update(task, completed=bar.tasks[0].total)
    return out


_LABELS = {"disk_read": "disk read (page cache dropped)", "disk_write": "disk write + fsync",
           "cache_read": "page-cache read", "memcpy": "host memory copy",
           "h2d_pageable": "H2D from pageable", "h2d_pinned": "H2D from pinned",
           "d2h_pageable": "D2H to pageable", "d2h_pinned": "D2H to pinned",
           "d2d": "device to device", "p2p": "GPU to GPU (P2P)",
           "h2d_latency": "H2D latency, 8 B", "d2h_latency": "D2H latency, 8 B",
           "allreduce_bus": "all-reduce bus bandwidth", "ib": "InfiniBand (nominal)",
           "nic": "network interface (nominal)", "matmul_cpu_fp32": "CPU matmul fp32",
           "matmul_gpu_fp32": "GPU matmul fp32", "matmul_gpu_tf32": "GPU matmul tf32",
           "matmul_gpu_bf16": "GPU matmul bf16", "matmul_gpu_fp16": "GPU matmul fp16"}


def _size(n: int) -> str:
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB" if n >= 2**20 else \
        f"{n} B"


def render(result: dict[str, Any], saved: str | None) -> None:
    from rich.markup import escape
    from rich.table import Table

    from gputrace.fmt import rate
    from gputrace.report import console

    con = console()
    t = Table(title=f"Bandwidths of {result['host']} ({result['mode']} probe, "
              f"{result['duration_s']:.0f} s; medians over repeats)", title_justify="left",
              box=None, padding=(0, 2))
    for c in ("", "median", "min - max", "size"):
        t.add_column(c, justify="right" if c else "left")
    missing: dict[str, list[str]] = {}
    for key, r in result["results"].items():
        label = _LABELS.get(key, key)
        if r.get("status") != "ok":
            missing.setdefault(str(r.get("status", "")), []).append(label)
        elif "flops_per_s" in r:
            t.add_row(label, f"{r['flops_per_s'] / 1e12:.4g} TFLOP/s (best)",
                      f"{r['min_flops_per_s'] / 1e12:.4g} - {r['flops_per_s'] / 1e12:.4g}",
                      f"{r['n']}x{r['n']}")
        elif "seconds" in r:
            t.add_row(label, f"{r['seconds'] * 1e6:.1f} µs",
                      f"{r['min_s'] * 1e6:.1f} - {r['max_s'] * 1e6:.1f} µs", _size(r["bytes"]))
        else:
            spread = "" if not r["repeats"] else \
                f"{rate(r['min_bytes_per_s'])} - {rate(r['max_bytes_per_s'])}"
            t.add_row(label, rate(r["bytes_per_s"]), spread,
                      _size(r["bytes"]) if r["bytes"] else "")
    con.print(t)
    for why, labels in missing.items():
        con.print(f"[dim]not measured: {escape(', '.join(labels))}: "
                  f"{escape(why.removeprefix('unavailable: '))}[/]")
    con.print("[dim]how each figure was measured: gputrace probe --json (method)[/]")
    if saved:
        con.print(f"[dim]saved to {escape(saved)}; traces recorded on this host from now on "
                  "carry it, and analyze compares achieved bandwidth with it[/]")
