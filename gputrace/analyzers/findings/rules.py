"""Plain-language findings, each with the evidence behind it."""

from __future__ import annotations

from dataclasses import dataclass

from gputrace.analyzers.core.bandwidth import Bandwidth
from gputrace.analyzers.core.model import ModelResult
from gputrace.fmt import MB_SHOWN, mb, ranges, rate

INPUT_MODERATE = 0.05
INPUT_HIGH = 0.20


@dataclass(frozen=True)
class Finding:
    id: str
    severity: str   # "high", "moderate", "info"
    message: str


UNITS_NAMED = 8   # more exposed units than this are given as ranges of their indices
# what runs between the phases, and what feeds the data faster, in each framework's words
WORDS = {
    "pytorch": {"between": "loss, zero_grad, logging or Python between phases",
                "loader": "more DataLoader workers",
                "unpipelined": "use DataLoader workers"},
    "tensorflow": {"between": "the loss and metrics, the dispatch of tf.function or "
                              "strategy.run, logging or Python between phases",
                   "loader": "more parallel calls in tf.data (num_parallel_calls)",
                   "unpipelined": "use tf.data's map(num_parallel_calls=...) and prefetch"},
}


def framework_of(md: dict[str, object]) -> str:
    """The training framework the trace says the job used: "tensorflow" where TensorFlow's
    collector ran and torch's did not, or the trace is a TensorFlow profile; "pytorch"
    otherwise."""
    col = md.get("collectors")
    col = col if isinstance(col, dict) else {}

    def ok(name: str) -> bool:
        c = col.get(name)
        return isinstance(c, dict) and c.get("status") == "ok"

    imported = md.get("imported")
    tools = {s.get("tool") for s in imported if isinstance(s, dict)} \
        if isinstance(imported, list) else set()
    if (ok("tensorflow") and not ok("torch")) or tools == {"tensorflow"}:
        return "tensorflow"
    return "pytorch"


def _layers(layers: tuple[int, ...] | None) -> str:
    if not layers:
        return ""
    if len(layers) == 1:
        return f" (layer {layers[0]})"
    return f" (layers {min(layers)}-{max(layers)})"


def find(m: ModelResult, comm: dict[str, float], io: dict[str, float], bw: Bandwidth | None,
         extra: dict[str, object] | None = None) -> list[Finding]:
    out: list[Finding] = []
    t = m.terms
    t_iter = t["t_iter"]
    if t_iter <= 0:
        return out
    words = WORDS.get(str((extra or {}).get("framework")), WORDS["pytorch"])
    wait = t["t_io"]
    frac = round(wait / t_iter, 9)
    if frac >= INPUT_MODERATE:
        sev = "high" if frac >= INPUT_HIGH else "moderate"
        msg = (f"Input-bound ({sev}ly): {wait:.3f} s of {t_iter:.3f} s per iteration "
               f"({frac:.0%}) waits for data")
        if bw is not None:
            parts = []
            for link in bw.links:
                per = link.bytes / max(bw.window_s / t_iter, 1.0)
                if link.name in ("disk", "cache") and per >= MB_SHOWN:
                    parts.append(f"{mb(per)} per iteration from {'page cache' if link.name == 'cache' else 'disk'} "
                                 f"at {rate(link.bytes_per_s)}")
            if parts:
                msg += "; the loader reads " + " and ".join(parts)
        if m.io_pipelined and m.t_io_pipelined is not None:
            msg += (f"; each batch takes {m.t_io_pipelined:.3f} s of loader time per worker "
                    f"share: {words['loader']}, faster decode or a warm cache would help")
        else:
            msg += f"; loading is not pipelined: {words['unpipelined']}"
        out.append(Finding("input_bound", sev, msg + "."))
    exposed = comm.get("exposed_s", 0.0)
    # FSDP: findings_comm; no unit (comm of a few bytes only): nothing to say of units
    if comm.get("total_s", 0.0) > 0 and m.strategy != "fsdp" and m.units:
        exp_units = [u for u in m.units[:-1] if not u.hidden]
        if m.case == 2:
            names = ", ".join(f"#{u.index}" + _layers(u.layers) for u in exp_units) \
                if len(exp_units) <= UNITS_NAMED else \
                f"{ranges([u.index for u in exp_units])} ({len(exp_units)} of {len(m.units)})"
            out.append(Finding(
                "comm_exposed", "high" if exposed / t_iter >= 0.2 else "moderate",
                f"Gradient communication is exposed (Case 2, C = {m.C if m.C is not None else '?'}): "
                f"{exposed:.3f} s of {comm['total_s']:.3f} s comm per iteration is not hidden "
                f"under compute; units {names} are exposed (each ends after the next unit's "
                "gradients are ready, after the backward, or outside compute). "
                "The what-if replay shows what other bucket sizes or a faster link "
                "would change."))
        elif m.case == 1 and exposed / t_iter >= INPUT_MODERATE:
            out.append(Finding(
                "comm_tail", "moderate",
                f"Only the last gradient unit is exposed (Case 1), but it costs {exposed:.3f} s "
                f"per iteration ({exposed / t_iter:.0%}): a smaller last bucket would shorten it."))
        elif comm["total_s"] > 0 and comm.get("hidden_s", 0.0) < 0.5 * comm["total_s"]:
            out.append(Finding(
                "comm_not_overlapped", "moderate" if exposed / t_iter >= INPUT_MODERATE
                else "info",
                (f"Gradient communication runs after the backward pass: {exposed:.3f} s of "
                 f"{comm['total_s']:.3f} s comm per iteration runs outside compute."
                 if m.strategy == "sequential" and t.get("t_b", 0.0) > 0 else
                 f"{exposed:.3f} s of {comm['total_s']:.3f} s comm per iteration runs "
                 "outside compute (no backward phase was found, so no order relative to it "
                 "is told)."
                 if m.strategy == "sequential" else
                 f"Comm units do not queue behind each other, but {exposed:.3f} s of "
                 f"{comm['total_s']:.3f} s comm per iteration runs outside compute: it is "
                 "not overlapped with the backward pass.")))
        else:
            out.append(Finding(
                "comm_hidden", "info",
                f"Gradient communication is hidden (Case 1): {comm['hidden_s']:.3f} s of "
                f"{comm['total_s']:.3f} s runs under backward compute."))
    other = t.get("t_other", 0.0)
    if other / t_iter >= 0.10:
        out.append(Finding(
            "unattributed", "moderate",
            f"{other:.3f} s per iteration ({other / t_iter:.0%}) is in no phase: "
            f"{words['between']}."))
    fw = t.get("t_framework", 0.0)
    if fw / t_iter >= 0.05:
        out.append(_framework_finding(fw, t_iter))
    if t["t_u"] > 0 and (t["t_h2d"] + t["t_f"] + t["t_b"]) > 0:
        from gputrace.analyzers.core.model import r_u2g

        r = r_u2g(t["t_u"], t["t_h2d"], t["t_f"], t["t_b"])
        if r >= 0.1 and m.strategy == "wfbp_update_after":
            out.append(Finding(
                "update_heavy", "moderate",
                f"The update takes {r:.0%} of the compute (r_u2g); with the update after all "
                "comm (eq. 11) it does not overlap and limits scaling."))
    if abs(m.relative_error) > 0.10:
        out.append(Finding(
            "model_mismatch", "info",
            f"The model (eq. {m.equation}) predicts {m.predicted_t_iter:.3f} s against "
            f"{m.measured_t_iter:.3f} s measured ({m.relative_error:+.0%}): the run does "
            "not follow the model's assumptions closely (e.g. buckets all-reduced concurrently)."))
    if bw is not None:
        for link in bw.links:
            f = link.fraction_of_peak
            if f is None or f >= 0.5 or link.bytes < 1e6:
                continue
            why = ""
            if link.name in ("disk", "cache") and link.peak_bytes_per_s:
                busy = link.bytes / link.bytes_per_s
                why = (f": at the peak these reads would take {link.bytes / link.peak_bytes_per_s:.2f}"
                       f" s of the {busy:.2f} s the loader worked, so reading is not what "
                       "limits it (decode, small random reads or too few workers are)")
            out.append(Finding(
                f"low_bandwidth_{link.name}", "info",
                f"{link.name}: {rate(link.bytes_per_s)} achieved, {f:.0%} of the probed "
                f"peak {rate(link.peak_bytes_per_s or 0)}{why}."))
    for f in (extra or {}).get("findings", []) or []:
        out.append(f)  # type: ignore[arg-type]
    return out


def _framework_finding(fw: float, t_iter: float) -> Finding:
    """Keras's own per-step work (its loop, logs, callbacks between two runs of the step
    function), with what `steps_per_execution` would make of it: k steps per call pay it
    once, so an iteration would take t_iter - fw (1 - 1/k)."""
    whatif = ", ".join(f"{k}: {(t_iter - fw * (1 - 1 / k)) * 1e3:.1f} ms "
                       f"({t_iter / (t_iter - fw * (1 - 1 / k)):.2f}x)" for k in (4, 16))
    return Finding(
        "framework_overhead", "moderate" if fw / t_iter >= 0.10 else "info",
        f"Keras's own per-step work (its loop, logs and callbacks between steps) takes "
        f"{fw * 1e3:.1f} ms of {t_iter * 1e3:.1f} ms per iteration ({fw / t_iter:.0%}). "
        f"compile(steps_per_execution=k) runs k steps per call and pays it once per call; "
        f"replayed with that work divided by k, an iteration would take, for k = {whatif}.")

