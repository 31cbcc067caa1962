"""FLOPs per iteration and per layer, achieved FLOP/s, MFU and HFU, from the `flops` row a
PyTorch recording writes for the iteration it counted (collectors.torch.flops).

Per rank: model FLOPs (forward + backward, recomputation left out) over the rank's mean
t_iter is its achieved FLOP/s; over a peak, its MFU. The peaks: the vendor's dense figure
for the GPU and the dtype the matmuls ran in (analyzers.extras.peaks), and the one `gputrace
probe` measured on this machine (`matmul_<cpu|gpu>_<dtype>`): both are given, labelled.
HFU counts the recomputed forward too, where there is one. Per layer: its FLOPs over its
measured forward (backward) time per iteration.

No share of a peak over 100 % is given: a FLOP/s above the peak means that the FLOPs, the
time they are divided by, or the peak (a probe run on a busy machine) is wrong, so that
share is withheld (null) and the reason said beside it (`share_of_peak_withheld`,
`mfu_withheld`)."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.core.layer_names import named
from gputrace.analyzers.extras.peaks import vendor_peak

FAR_BELOW = 0.25          # a layer under this share of the peak is far below it
MIN_SHARE_OF_ITERATION = 0.02


def not_counted(why: str) -> dict[str, Any]:
    return {"counted": False, "unavailable": f"FLOPs not counted: {why}", "ranks": {},
            "layers": []}


def peaks(args: dict[str, Any], probe: dict[str, Any] | None,
          gpu_names: list[str]) -> dict[str, Any]:
    """The vendor's and the probed peak for the counted iteration's device and dtype."""
    dtype = args.get("dtype")
    device = "gpu" if args.get("device") == "cuda" else "cpu"
    out: dict[str, Any] = {"vendor": None, "probed": None}
    if device == "gpu":
        name = args.get("device_name") or (gpu_names[0] if gpu_names else None)
        v = vendor_peak(name, dtype)
        if v is not None:
            out["vendor"] = {"flops_per_s": v[1], "dtype": dtype, "device": v[0],
                             "source": f"{v[0]} {dtype} dense (vendor)"}
    res = (probe or {}).get("results") or {}
    p = res.get(f"matmul_{device}_{dtype}")
    if isinstance(p, dict) and p.get("status") == "ok" and p.get("flops_per_s"):
        out["probed"] = {"flops_per_s": float(p["flops_per_s"]), "dtype": dtype,
                         "device": device, "source": f"probed {dtype} matmul ({device})"}
    return out


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _tflops(x: float) -> str:
    return f"{x / 1e12:.3g} TFLOP/s"


def above_peak(what: str, rates: dict[str, float | None], peak: float | None,
               source: str | None) -> str | None:
    """Why a share of `peak` is withheld where one of `rates` (by what it is of) is above it;
    None where none is."""
    over = [(k, r) for k, r in rates.items() if r is not None and peak and r > peak]
    if not over:
        return None
    said = ", ".join((f"{k} at " if k else "") + _tflops(r) for k, r in over)
    return (f"{what}: {said}, above the {source or 'known'} peak of {_tflops(peak or 0)}: "
            "the FLOPs, the time measured or the peak is wrong")


def rank_flops(args: dict[str, Any], t_iter_s: float, pk: dict[str, Any]) -> dict[str, Any]:
    """One rank's totals, FLOP/s, MFU (and HFU) against each peak."""
    model = float(args.get("model_flops", 0))
    hw = float(args.get("hardware_flops", model))
    rate = _div(model, t_iter_s)
    hrate = _div(hw, t_iter_s) if hw > model else None
    out = {"flops_f": args.get("flops_f"), "flops_b": args.get("flops_b"),
           "flops_recompute": args.get("flops_recompute", 0),
           "model_flops_per_iteration": model, "hardware_flops_per_iteration": hw,
           "t_iter_s": t_iter_s, "achieved_flops_per_s": rate, "mfu": {}, "hfu": None,
           "mfu_withheld": None}
    why = []
    for k, v in pk.items():
        peak, source = (v or {}).get("flops_per_s"), (v or {}).get("source")
        w = above_peak("MFU withheld", {"": rate}, peak, source)
        out["mfu"][k] = None if w else _div(rate, peak)
        if hrate:
            wh = above_peak("HFU withheld", {"with the recomputation": hrate},
                            peak, source)
            out["hfu"] = {**(out["hfu"] or {}), k: None if wh else _div(hrate, peak)}
            w = w if w or not wh else wh
        if w:
            why.append(w)
    out["mfu_withheld"] = "; ".join(why) or None
    return out


def layers(args: dict[str, Any], times: dict[int, tuple[float | None, float | None]],
           t_iter_s: float, peak: float | None, source: str | None = None
           ) -> list[dict[str, Any]]:
    """Each counted layer with its measured forward and backward time per iteration
    (`times`: layer -> (t_f_s, t_b_s), None where not timed), achieved FLOP/s and its share
    of `peak` (`source`: the peak's label) and of the iteration; the share withheld, and
    why, where its forward, its backward or both together ran above the peak."""
    out = []
    for ly in args.get("layers") or []:
        f, b = float(ly["flops_f"]), float(ly["flops_b"])
        r = float(ly.get("flops_recompute", 0))
        tf, tb = times.get(int(ly["layer"]), (None, None))
        af, ab = _div(f, tf), _div(b - r, tb)
        t = (tf or 0.0) + (tb or 0.0)
        known = (f if tf else 0.0) + (b - r if tb else 0.0)
        rate = _div(known, t) if known else None
        why = above_peak(f"layer {named(ly)}",
                         {"forward": af, "backward": ab, "both": rate}, peak, source)
        out.append({"layer": ly["layer"], "name": ly["name"], "module": ly.get("module"),
                    "flops_f": f, "flops_b": b - r, "flops_recompute": r,
                    "t_f_s": tf, "t_b_s": tb, "achieved_flops_per_s_f": af,
                    "achieved_flops_per_s_b": ab, "achieved_flops_per_s": rate,
                    "share_of_peak": None if why else _div(rate, peak),
                    "share_of_iteration": _div(t, t_iter_s) if t else None,
                    "share_of_peak_withheld": why})
    return out


def finding(rows: list[dict[str, Any]], peak_source: str | None) -> str | None:
    """The layers far below the peak that take a share of the iteration worth naming."""
    low = [r for r in rows if r["share_of_peak"] is not None and r["share_of_peak"] < FAR_BELOW
           and (r["share_of_iteration"] or 0) >= MIN_SHARE_OF_ITERATION]
    if not low or not peak_source:
        return None
    low.sort(key=lambda r: -(r["share_of_iteration"] or 0))
    said = "; ".join(f"layer {named(r)}: {r['achieved_flops_per_s'] / 1e12:.3g} "
                      f"TFLOP/s ({r['share_of_peak']:.0%} of the peak), "
                      f"{r['share_of_iteration']:.0%} of the iteration" for r in low[:5])
    more = f" and {len(low) - 5} more" if len(low) > 5 else ""
    total = sum(r["share_of_iteration"] or 0 for r in low)
    return (f"Layers far below the {peak_source} peak take {total:.0%} of the iteration: "
            f"{said}{more}")


def line(d: dict[str, Any], advise_probe: bool = True) -> str:
    """The terminal's line: FLOPs per iteration, FLOP/s, MFU of each peak; where there is
    no count, why (none for a trace that could not hold one: an older or imported one).
    `advise_probe`: False where the output has advised running `gputrace probe` already."""
    if not d.get("counted"):
        why = str(d.get("unavailable") or "")
        return "" if not why or "holds no FLOP count" in why else why
    r = d["ranks"].get(str(d["rank"])) or {}
    rate = r["achieved_flops_per_s"] or 0.0     # a CPU's 0.86 GFLOP/s, not 0.000858 TFLOP/s
    out = (f"FLOPs: {r['model_flops_per_iteration'] / 1e9:,.4g} GFLOP/iter, "
           + (f"{rate / 1e12:.3g} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:.3g} GFLOP/s"))
    for k in ("vendor", "probed"):
        p = d["peaks"].get(k)
        if p is not None and r["mfu"].get(k) is not None:
            out += f", MFU {r['mfu'][k]:.1%} of {p['source']} {p['flops_per_s'] / 1e12:.4g} " \
                   "TFLOP/s"
            if r.get("hfu") and r["hfu"].get(k) is not None:
                out += f" (HFU {r['hfu'][k]:.1%})"
    if all(d["peaks"].get(k) is None for k in ("vendor", "probed")):
        out += " (no peak known: run gputrace probe on this machine)" if advise_probe else \
            " (no peak known)"
    if r.get("mfu_withheld"):
        out += f"\n  {r['mfu_withheld']}"
    held = withheld_line(d.get("layers") or [])
    return out + (f"\n  {held}" if held else "")


def withheld_line(rows: list[dict[str, Any]]) -> str | None:
    """The layers whose share of the peak is withheld, in one line: which, and why (the
    fastest one's reason)."""
    held = [r for r in rows if r.get("share_of_peak_withheld")]
    if not held:
        return None
    nums = ", ".join(str(r["layer"]) for r in held[:12]) + (", ..." if len(held) > 12 else "")
    top = max(held, key=lambda r: max(x or 0 for x in (
        r["achieved_flops_per_s_f"], r["achieved_flops_per_s_b"], r["achieved_flops_per_s"])))
    return (f"Share of the peak left out for {len(held)} of {len(rows)} layers ({nums}): "
            f"{top['share_of_peak_withheld']}")
