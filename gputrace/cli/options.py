"""The inputs and model options that `analyze`, `report` and `diff` share, and the
AnalysisOptions they stand for."""

from __future__ import annotations

import argparse

from gputrace.analysis.run import AnalysisOptions

INPUT_HELP = "trace file(s), a directory of shards, Kineto JSON or Nsight Systems SQLite"


def add_options(p: argparse.ArgumentParser, inputs: bool = True) -> None:
    """The options of one analysis (`diff` names its two inputs itself)."""
    if inputs:
        p.add_argument("trace", nargs="+", help=INPUT_HELP)
    p.add_argument("--rank", type=int, help="show this rank (default: the slowest)")
    p.add_argument("--skip", type=int, help="warm-up iterations to leave out "
                   "(default: the first 10%% or 3)")
    p.add_argument("--gpus", default="2,4,8,16", help="GPU counts for the speedup model")
    p.add_argument("--link-bandwidth", help="link bandwidth for eq. 12, e.g. 7GB/s")
    p.add_argument("--what-if", action="append", default=[], metavar="SPEC",
                   help="a replay scenario, e.g. gpus=16,bandwidth=2x,bucket_cap_mb=5 "
                   "(keys: gpus, bandwidth, bucket_cap_mb, bucket=BYTES|one); repeatable")
    p.add_argument("--shared-io", action="store_true",
                   help="one loader feeds all GPUs of a node (t_io grows with N)")
    p.add_argument("--jobs", "-j", type=int, metavar="N",
                   help="analyze ranks in N processes, this one and N - 1 workers (default: one "
                   "per core, for traces of 2e6 rows or more)")
    p.add_argument("--dask", metavar="ADDRESS", help="analyze ranks on a Dask distributed "
                   "cluster, e.g. tcp://scheduler:8786 (its workers read the trace files)")
    p.add_argument("--ray", metavar="ADDRESS", help="analyze ranks on a Ray cluster "
                   "(address, or 'auto'); its workers read the trace files")
    p.add_argument("--batch-size", type=int, metavar="N", help="samples each forward of the "
                   "model takes on a rank, where the trace does not tell (throughput)")
    p.add_argument("--tokens-per-sample", type=int, metavar="N",
                   help="tokens per sample, where the input is not token ids (throughput)")
    p.add_argument("--calibrate", metavar="OTHER", help="another run of the same pipeline "
                   "job at another microbatch count (a trace or shard directory): the "
                   "pipeline what-ifs fit each stage's compute per microbatch as fixed + "
                   "per-sample from the two runs; several, joined by commas: through the "
                   "two counts nearest each what-if's")
    p.add_argument("--no-align", action="store_true", help="take each host's clock as "
                   "recorded (offsets are still estimated and reported)")


def options_of(args: argparse.Namespace) -> AnalysisOptions:
    """The parsed command line's analysis options (an AnalysisError on a bad one)."""
    return AnalysisOptions.of(
        inputs=tuple(getattr(args, "trace", None) or ()), rank=args.rank, skip=args.skip,
        gpus=args.gpus, link_bandwidth=args.link_bandwidth, what_if=args.what_if,
        shared_io=args.shared_io, jobs=args.jobs, dask=args.dask, ray=args.ray,
        batch_size=args.batch_size, tokens_per_sample=args.tokens_per_sample,
        calibrate=args.calibrate, align=not args.no_align)
