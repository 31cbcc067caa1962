"""How far each kind of what-if was measured from the runs it predicts (bench/README.md,
"Every what-if kind against the runs it predicts"): one entry per kind with the bench that
measured it. A kind measured beyond 10 % carries its band, lowest and highest of
predicted / measured - 1, and every prediction of that kind is shown with it; a kind
measured within 10 % carries none; a kind no bench validates says so.

Where a bench recorded |error| only (bench/whatif.py), the band is symmetric."""

from __future__ import annotations

import math
from dataclasses import dataclass

WITHIN = 0.10   # an error band is shown where a kind was measured off by more than this


@dataclass(frozen=True)
class Measured:
    """One kind's measured error: (lowest, highest) of predicted / measured - 1, or None
    where no bench records the run it predicts; the bench; what was measured, in words."""

    band: tuple[float, float] | None
    bench: str
    where: str

    @property
    def shown(self) -> tuple[float, float] | None:
        """The band to print beside a prediction: None within 10 % or not validated."""
        b = self.band
        return b if b is not None and max(-b[0], b[1]) > WITHIN else None


_WHATIF = ("2-rank gloo DDP, 2 models, on a 2-CPU machine whose runs of one configuration "
           "moved up to 16 %")
_PP = "GPipe, 1F1B and Interleaved1F1B, 4 <-> 8 <-> 16 microbatches, 2 ranks over gloo"
PP_RUNS = _PP   # the pipeline microbatch benches' runs, which their kinds' texts begin with
_DS = "2-rank DeepSpeed over gloo on a 2-CPU machine whose unchanged pairs moved up to 9 %"
# the kinds, by the key analyzers give their what-ifs (kind_of_scenario, kind_of_label)
KINDS: dict[str, Measured] = {
    # the suite's case2 job (tests/test_e2e_torch.py, its runs in CI): one bucket replayed
    # at 1 MiB predicted +27.5 to +36 % over the 1 MiB run at one load (3 runs: the replay
    # gives small buckets less than they save where the ranks' comm and backward share the
    # CPU); |error| only, so symmetric
    "ddp_buckets": Measured((-0.36, 0.36), "bench/whatif.py",
                            f"bucket_cap_mb 1, 5, 25, one bucket, 48 predictions, |error| "
                            f"median 5.3 %, at most 19.8 % ({_WHATIF}); one bucket -> 1 MiB "
                            f"in the suite's 4-layer job, 3 runs: +27.5 to +36 %"),
    "ddp_link": Measured((-0.187, 0.187), "bench/whatif.py",
                         f"a veth link at 917 and 238 MB/s, 16 predictions, |error| median "
                         f"7.3 %, at most 18.7 % ({_WHATIF})"),
    "ddp_buckets_link": Measured((-0.283, 0.283), "bench/whatif.py",
                                 f"buckets and link both changed, 48 predictions, |error| "
                                 f"median 7.9 %, at most 28.3 % ({_WHATIF})"),
    "gpu_count": Measured((-0.335, 0.335), "bench/whatif.py",
                          "1 process -> 2 ranks sharing 2 CPUs, |error| 24.5 and 33.5 % "
                          "(more ranks than that not measured)"),
    "zero_reduce_bucket_size": Measured((-0.078, 0.114), "bench/whatif_ds.py",
                                        f"reduce_bucket_size 5e8 <-> 2.64e5, ZeRO-1 and 2, "
                                        f"12 predictions ({_DS})"),
    "zero_overlap_comm": Measured((-0.114, 0.129), "bench/whatif_ds.py",
                                  f"overlap_comm off <-> on, ZeRO-1 and 2, 12 predictions "
                                  f"({_DS})"),
    "zero_allgather_bucket_size": Measured((-0.084, 0.092), "bench/whatif_ds.py",
                                           f"allgather_bucket_size 5e8 <-> a quarter, 12 "
                                           f"predictions ({_DS})"),
    "zero3_prefetch": Measured((-0.157, 0.246), "bench/whatif_ds.py --stages 3",
                               "stage3_prefetch_bucket_size 5e7 / a layer / 0, "
                               "stage3_max_live_parameters a layer, the 14 predictions "
                               "between runs at one speed, median |error| 4.1 % (2-rank "
                               "DeepSpeed over gloo, 2 CPUs)"),
    "fsdp_reshard": Measured((-0.352, 0.640), "bench/whatif_fsdp.py",
                             "reshard_after_forward True <-> False, 2-rank FSDP2 over gloo "
                             "on a loaded 2-CPU machine: no pair of runs at one machine speed, "
                             "so this holds the machine's drift (forward compute 0.61-2.56x "
                             "between the pair's runs)"),
    "fsdp_forward_prefetch": Measured((-0.340, 0.516), "bench/whatif_kinds.py",
                                      "forward prefetch 0 <-> 1, 2-rank FSDP2 over gloo, 6 "
                                      "predictions over 3 interleaved rounds, median +0.6 %, "
                                      "on a loaded 2-CPU machine whose runs of one "
                                      "configuration moved up to 103 %; on it quiet, median "
                                      "+0.1 %, -34.0 .. +51.6 % (one round's runs 50 and "
                                      "76 ms)"),
    "fsdp_backward_prefetch": Measured((-0.519, 1.078), "bench/whatif_kinds.py",
                                       "backward prefetch FSDP2's default (1) <-> 2, 2-rank "
                                       "FSDP2 over gloo, 6 predictions over 3 interleaved "
                                       "rounds, median +1.7 %, on a loaded 2-CPU machine "
                                       "whose runs of one configuration moved up to 195 %; "
                                       "on it quiet, prefetch 2 ran 11-45 % slower than the "
                                       "default in each of 3 rounds where no change is "
                                       "predicted"),
    "sharded_link": Measured((-0.149, 0.246), "bench/whatif_kinds.py",
                             "a veth link as it is <-> throttled by tc tbf with a 64 KB "
                             "bucket (0.44x of its all-reduce bus bandwidth), 2-rank FSDP2 "
                             "over gloo, 10 predictions over 5 interleaved rounds on a quiet "
                             "2-CPU machine, median +2.3 %, whose runs of one configuration "
                             "moved up to 15 %; each collective's fixed part (~1 ms a call) "
                             "left as it is (fitted: without it -25.5 .. +47.4 %)"),
    # TP degree: on 2 CPU ranks only 2 -> 1 can be run (bench/whatif_kinds.py)
    "tp_fewer": Measured((-0.044, 0.855), "bench/whatif_kinds.py",
                         "TP degree 2 on 2 ranks -> 1 (one process), 3 predictions over 3 "
                         "interleaved rounds, median +1.4 %, on a loaded 2-CPU machine whose "
                         "one-process runs moved up to 143 % (a lower degree than the "
                         "measured; only 1 and 2 can be run on 2 CPU ranks); on it quiet, "
                         "+40.9 .. +62.5 %, the one process faster than predicted in every "
                         "round"),
    "tp_more": Measured(None, "", "a TP degree above the measured one"),
    # the pipeline's microbatch what-ifs: of one run to fewer microbatches and to more
    # (bench/whatif_pp_inside.py), and fitted with a calibrating run (bench/whatif_pp.py's
    # microbatch pairs, and whatif_pp_inside.py's with the window of a recording at a third
    # count, the schedule's own work and transfer fitted through the runs too: the wider)
    "pp_fewer": Measured((-0.036, 0.749), "bench/whatif_pp_inside.py",
                         f"{_PP} on a loaded 2-CPU machine; on it quiet, 12 predictions, "
                         "+18.3 .. +49.1 %"),
    "pp_more": Measured((-0.353, 0.660), "bench/whatif_pp_inside.py",
                        f"{_PP} on a loaded 2-CPU machine; on it quiet, 12 predictions, "
                        "-32.2 .. -14.5 %"),
    "pp_fitted": Measured((-0.402, 0.778), "bench/whatif_pp.py, bench/whatif_pp_inside.py",
                          f"{_PP} on a loaded 2-CPU machine; on it quiet, 24 predictions, "
                          "-14.9 .. +10.8 %, 18 within 10 %"),
    # the microbatch what-ifs of one run whose stages the job timed at half and twice the
    # microbatch's rows (record --pp-probe: pp_probed), against the runs they predict
    "pp_probed": Measured((-0.274, 0.320), "bench/whatif_pp_inside.py --probe",
                          "GPipe, 1F1B and Interleaved1F1B, 4 <-> 8 <-> 16 microbatches "
                          "inside one recording, 2 ranks over gloo, 48 predictions in 4 "
                          "rounds on a 2-CPU machine, median |error| 9.8 %, 25 within 10 % "
                          "(the same recordings' proportional what-ifs -45.4 .. +73.2 %, "
                          "2 within 10 %); the job's own iterations at one configuration "
                          "moved -25.2 .. +23.6 % inside one recording"),
    # a schedule what-if at the recorded microbatch count and stages per rank, both
    # schedules fused or both split (GPipe <-> 1F1B; ZBVZeroBubble <-> InterleavedZeroBubble)
    "pp_schedule": Measured((-0.099, 0.110), "bench/whatif_pp.py",
                            "GPipe <-> 1F1B at 4 and 8 microbatches and ZBVZeroBubble <-> "
                            "InterleavedZeroBubble at 8, 2 ranks over gloo, 22 predictions "
                            "on a quiet 2-CPU machine, 21 within 10 %"),
    # one at the recorded count between 1 and 2 stages a rank, both fused (GPipe, 1F1B <->
    # Interleaved1F1B)
    "pp_stages": Measured((-0.206, 0.661), "bench/whatif_pp.py",
                          "GPipe and 1F1B <-> Interleaved1F1B (1 <-> 2 stages a rank) at 4 "
                          "and 8 microbatches, 2 ranks over gloo, 22 predictions on a quiet "
                          "2-CPU machine, 18 within 10 % (the misses where a run of one "
                          "configuration itself moved 15-17 % between rounds); then 1F1B "
                          "and Interleaved1F1B at 2 and at 4 stages a rank, 8 microbatches, "
                          "each predicting the others, 18 predictions in 3 rounds, 8 within "
                          "10 %: 2 -> 4 stages a rank -17.2 .. +3.0 %, 4 -> 2 -1.7 .. "
                          "+14.0 %, 1 <-> 2 -20.6 .. +44.0 %, 1 <-> 4 -20.5 .. +66.1 % (the "
                          "widest from a 1F1B run of 274 ms where the other rounds' took "
                          "208-209)"),
    # the layers balanced across stages (one stage a rank), against the run of the model
    # cut so (bench/whatif_pp_balance.py)
    "pp_layers": Measured((-0.250, 0.077), "bench/whatif_pp_balance.py",
                          "GPipe and 1F1B, 8 Linear(1024) blocks cut 6 + 2 and 2 + 6 "
                          "predicting the run cut 4 + 4, at 4 and 8 microbatches, 2 ranks "
                          "over gloo, 12 predictions on a quiet 2-CPU machine, 11 within "
                          "10 % (the uneven runs' own iterations 10-30 % off the even "
                          "run's); 6 Linear(512) blocks cut 5 + 1 predicting 3 + 3: -25.0 % "
                          "(the even cut ran slower than the uneven one)"),
    # a schedule what-if between a fused backward and one split into its input and weight
    # parts (zero bubble), at the recorded microbatch count: the split's own cost is not
    # predicted (bench/whatif_pp.py, GPipe, 1F1B and Interleaved1F1B <-> ZBVZeroBubble and
    # InterleavedZeroBubble at 8 microbatches)
    "pp_split": Measured((-0.310, 0.426), "bench/whatif_pp.py",
                         "GPipe, 1F1B and Interleaved1F1B <-> ZBVZeroBubble and "
                         "InterleavedZeroBubble at 8 microbatches, 2 ranks over gloo, 36 "
                         "predictions in 5 rounds on a quiet 2-CPU machine: from a fused "
                         "backward -31.0 .. -1.8 %, from a split one +10.2 .. +42.6 % "
                         "(torch's split backward took 1.16-1.44 times the fused one per "
                         "microbatch there)"),
    # the same, the split's cost per stage from the job's probe (record --pp-probe: torch's
    # split backward timed beside the fused one at the recorded rows)
    "pp_split_probed": Measured((-0.210, 0.262), "bench/whatif_pp.py --probe",
                                "1F1B and Interleaved1F1B <-> ZBVZeroBubble and "
                                "InterleavedZeroBubble at 8 microbatches, 2 ranks over gloo, "
                                "24 predictions in 3 rounds on a quiet 2-CPU machine, median "
                                "|error| 7.7 %, 14 within 10 % (the same recordings without "
                                "the probe's split -25.9 .. +42.4 %, median 14.5 %, 9 within "
                                "10 %)"),
    # expert-parallel balanced routing, against iterations of the same job routed without
    # the bias in one recording: each round's median, the hand-written layout's 5 rounds
    # and torchtitan's 4
    "ep_balanced": Measured((-0.111, 0.221), "bench/whatif_ep.py --alternate",
                            "iterations of the same job routed without the bias (a "
                            "hand-written MoE and torchtitan's layout), on a 2-CPU "
                            "machine, loaded and quiet (single iterations -49 to +179 %, "
                            "where predicting no change was off by -12.9 to +21.5 %)"),
}


def kind_of_scenario(gpus: int, world: int, bandwidth_x: float,
                     bucket_bytes: float | None) -> str | None:
    """The kind of a replayed DDP scenario (None: the measured configuration itself)."""
    if gpus != max(world, 1):
        return "gpu_count"
    link, buckets = bandwidth_x != 1, bucket_bytes is not None
    return ("ddp_buckets_link" if link and buckets else "ddp_link" if link
            else "ddp_buckets" if buckets else None)


def kind_of_degree(degree: int, measured: int) -> str | None:
    """The kind of a TP-degree what-if (None: the measured degree itself)."""
    return None if degree == measured else "tp_fewer" if degree < measured else "tp_more"


def kind_of_label(label: str) -> str | None:
    """The kind of a sharded (FSDP, ZeRO) what-if from its label (None: not known here)."""
    for prefix, kind in (("reshard_after_forward", "fsdp_reshard"),
                         ("forward prefetch", "fsdp_forward_prefetch"),
                         ("backward prefetch", "fsdp_backward_prefetch"),
                         ("link x", "sharded_link"),
                         ("reduce_bucket_size", "zero_reduce_bucket_size"),
                         ("overlap_comm", "zero_overlap_comm"),
                         ("allgather_bucket_size", "zero_allgather_bucket_size"),
                         ("stage3_", "zero3_prefetch")):
        if label.startswith(prefix):
            return kind
    return None


def band(kind: str | None) -> tuple[float, float] | None:
    """The band to show beside a prediction of this kind (None: within 10 %, or none
    measured: see `source`)."""
    m = KINDS.get(kind or "")
    return m.shown if m is not None else None


def source(kind: str | None) -> str | None:
    """The bench that measured this kind's error (None: no bench validates it)."""
    m = KINDS.get(kind or "")
    return m.bench if m is not None and m.band is not None else None


def text(b: tuple[float, float] | None) -> str:
    """'-7.8 .. +11.4 %', '±19.8 %' where symmetric; '' without a band."""
    if b is None:
        return ""
    if math.isclose(-b[0], b[1]):
        return f"±{b[1] * 100:.1f} %"
    return f"{b[0] * 100:+.1f} .. {b[1] * 100:+.1f} %"


def cell(kind: str | None) -> str:
    """A table's `measured error` cell: the band, 'not validated', or '' (within 10 %)."""
    if kind is None:
        return ""
    b = band(kind)
    return text(b) if b is not None else ("" if source(kind) else "not validated")


def note(kinds: list[str | None]) -> list[str]:
    """One line per kind shown with a band: its band, what measured it and where."""
    out = []
    for k in dict.fromkeys(kinds):
        b = band(k)
        if b is not None and k is not None:
            m = KINDS[k]
            out.append(f"measured error {text(b)} ({m.bench}, bench/README.md): {m.where}")
    if any(k is not None and source(k) is None for k in kinds):
        out.append("not validated: no bench has recorded the run such a what-if predicts")
    return out


def band_keys(kind: str | None) -> dict[str, object]:
    """A what-if row's `band` ([lowest, highest] of predicted / measured - 1, shown beside
    it; null within 10 % or not validated) and `band_source` (the bench that measured it;
    null where none did, or the run's own configuration) in --json."""
    b = band(kind)
    return {"band": list(b) if b is not None else None, "band_source": source(kind)}


def said(kind: str | None) -> str:
    """A finding's words for a prediction's band, or that no bench validates its kind (''
    within 10 %)."""
    b = band(kind)
    if b is not None:
        return f"; such a what-if was measured off by {text(b)} ({KINDS[kind or ''].bench})"
    return "; no bench has validated such a what-if" if kind is not None and \
        source(kind) is None else ""
