"""FLOPs per iteration and per layer, achieved FLOP/s, MFU and HFU, from the `flops` row a
PyTorch recording writes for the iteration it counted (collectors.torch.flops).

Per rank: model FLOPs (forward + backward, recomputation left out) over the rank's mean
t_iter is its achieved FLOP/s; over a peak, its MFU. The peaks: the vendor's dense figure
for the GPU and the dtype the matmuls ran in (analyzers.peaks), and the one `gputrace
probe` measured on this machine (`matmul_<cpu|gpu>_<dtype>`): both are given, labelled.
HFU counts the recomputed forward too, where there is one. Per layer: its FLOPs over its
measured forward (backward) time per iteration."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.peaks import vendor_peak

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


def rank_flops(args: dict[str, Any], t_iter_s: float, pk: dict[str, Any]) -> dict[str, Any]:
    """One rank's totals, FLOP/s, MFU (and HFU) against each peak."""
    model = float(args.get("model_flops", 0))
    hw = float(args.get("hardware_flops", model))
    rate = _div(model, t_iter_s)
    out = {"flops_f": args.get("flops_f"), "flops_b": args.get("flops_b"),
           "flops_recompute": args.get("flops_recompute", 0),
           "model_flops_per_iteration": model, "hardware_flops_per_iteration": hw,
           "t_iter_s": t_iter_s, "achieved_flops_per_s": rate,
           "mfu": {k: _div(rate, (v or {}).get("flops_per_s")) for k, v in pk.items()},
           "hfu": None}
    if hw > model:
        hrate = _div(hw, t_iter_s)
        out["hfu"] = {k: _div(hrate, (v or {}).get("flops_per_s")) for k, v in pk.items()}
    return out


def layers(args: dict[str, Any], times: dict[int, tuple[float | None, float | None]],
           t_iter_s: float, peak: float | None) -> list[dict[str, Any]]:
    """Each counted layer with its measured forward and backward time per iteration
    (`times`: layer -> (t_f_s, t_b_s), None where not timed), achieved FLOP/s and its share
    of `peak` and of the iteration."""
    out = []
    for ly in args.get("layers") or []:
        f, b = float(ly["flops_f"]), float(ly["flops_b"])
        r = float(ly.get("flops_recompute", 0))
        tf, tb = times.get(int(ly["layer"]), (None, None))
        af, ab = _div(f, tf), _div(b - r, tb)
        t = (tf or 0.0) + (tb or 0.0)
        known = (f if tf else 0.0) + (b - r if tb else 0.0)
        rate = _div(known, t) if known else None
        out.append({"layer": ly["layer"], "name": ly["name"], "module": ly.get("module"),
                    "flops_f": f, "flops_b": b - r, "flops_recompute": r,
                    "t_f_s": tf, "t_b_s": tb, "achieved_flops_per_s_f": af,
                    "achieved_flops_per_s_b": ab, "achieved_flops_per_s": rate,
                    "share_of_peak": _div(rate, peak),
                    "share_of_iteration": _div(t, t_iter_s) if t else None})
    return out


def finding(rows: list[dict[str, Any]], peak_source: str | None) -> str | None:
    """The layers far below the peak that take a share of the iteration worth naming."""
    low = [r for r in rows if r["share_of_peak"] is not None and r["share_of_peak"] < FAR_BELOW
           and (r["share_of_iteration"] or 0) >= MIN_SHARE_OF_ITERATION]
    if not low or not peak_source:
        return None
    low.sort(key=lambda r: -(r["share_of_iteration"] or 0))
    named = "; ".join(f"layer {r['layer']} {r['name']}: {r['achieved_flops_per_s'] / 1e12:.3g} "
                      f"TFLOP/s ({r['share_of_peak']:.0%} of the peak), "
                      f"{r['share_of_iteration']:.0%} of the iteration" for r in low[:5])
    more = f" and {len(low) - 5} more" if len(low) > 5 else ""
    total = sum(r["share_of_iteration"] or 0 for r in low)
    return (f"Layers far below the {peak_source} peak take {total:.0%} of the iteration: "
            f"{named}{more}")


def line(d: dict[str, Any]) -> str:
    """The terminal's line: FLOPs per iteration, FLOP/s, MFU of each peak; where there is
    no count, why (none for a trace that could not hold one: an older or imported one)."""
    if not d.get("counted"):
        why = str(d.get("unavailable") or "")
        return "" if not why or "holds no FLOP count" in why else why
    r = d["ranks"].get(str(d["rank"])) or {}
    out = (f"FLOPs: {r['model_flops_per_iteration'] / 1e9:,.4g} GFLOP/iter, "
           f"{(r['achieved_flops_per_s'] or 0) / 1e12:.3g} TFLOP/s")
    for k in ("vendor", "probed"):
        p = d["peaks"].get(k)
        if p is not None and r["mfu"].get(k) is not None:
            out += f", MFU {r['mfu'][k]:.1%} of {p['source']} {p['flops_per_s'] / 1e12:.4g} " \
                   "TFLOP/s"
            if r.get("hfu") and r["hfu"].get(k) is not None:
                out += f" (HFU {r['hfu'][k]:.1%})"
    if all(d["peaks"].get(k) is None for k in ("vendor", "probed")):
        out += " (no peak known: run gputrace probe on this machine)"
    return out
