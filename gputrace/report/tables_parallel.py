"""The parallelisms beyond data parallelism as tables, built from the `analyze --json`
document's `parallelism` sections (docs/parallelism.md) so they say what `--json` says:

- `tp_layers`: every rank's tensor-parallel collectives per layer and phase;
- `tp_what_if`: every rank's TP-degree what-if;
- `pipeline_stages`: the pipeline's stages, one row each;
- `pipeline_what_if`: the pipeline's replayed what-ifs;
- `expert_parallel`: every rank's expert-parallel all-to-alls, with its bytes to each peer.

A run without the dimension gives the table with its columns and no rows."""

from __future__ import annotations

from typing import Any

from gputrace.report.tables import Table, _table

TP_LAYER_COLUMNS = ("rank", "layer", "name", "phase", "count", "bytes", "exposed_s")
TP_WHAT_IF_COLUMNS = ("rank", "degree", "measured", "t_iter", "speedup", "compute_s", "comm_s")
STAGE_COLUMNS = ("stage", "rank", "slowest", "schedule", "microbatches", "num_stages",
                 "forward_s", "backward_s", "loss_s", "busy_s", "step_s", "bubble_s",
                 "bubble_share", "waits_s", "p2p_count", "p2p_bytes", "t_iter")
PIPELINE_WHAT_IF_COLUMNS = ("what", "schedule", "microbatches", "t_iter", "bubble", "band")
EP_COLUMNS = ("rank", "degree", "moe_layers", "count", "bytes", "time_s", "exposed_s",
              "dispatch_count", "dispatch_bytes", "dispatch_exposed_s", "combine_count",
              "combine_bytes", "combine_exposed_s", "peer_bytes", "bytes_over_mean",
              "most_loaded", "wait_s")
TABLES = ("tp_layers", "tp_what_if", "pipeline_stages", "pipeline_what_if",
          "expert_parallel")


def _sections(doc: dict[str, Any], key: str) -> list[tuple[int, dict[str, Any]]]:
    """(rank, its `parallelism[key]`) of every rank that has one, in rank order."""
    out = []
    for r, rd in sorted(doc["ranks"].items(), key=lambda kv: int(kv[0])):
        sec = (rd.get("parallelism") or {}).get(key)
        if sec:
            out.append((int(r), sec))
    return out


def _pipeline(doc: dict[str, Any]) -> dict[str, Any] | None:
    """The run's pipeline (the same in every rank's section; the shown rank's first)."""
    for d in (doc, *doc["ranks"].values()):
        pl = (d.get("parallelism") or {}).get("pipeline")
        if pl:
            return pl
    return None


def tp_layers(doc: dict[str, Any]) -> Table:
    """Per rank, layer (1..L from the input side; -1: in no layer's span) and phase, the
    tensor-parallel collectives per iteration: count, bytes, the time the job stood in
    them."""
    rows = [{"rank": r, "layer": x["layer"], "name": x["name"], "phase": x["phase"],
             "count": x["count"], "bytes": x["bytes"], "exposed_s": x["exposed_s"]}
            for r, tp in _sections(doc, "tensor_parallel") for x in tp["layers"]]
    return _table("tp_layers", rows, TP_LAYER_COLUMNS)


def tp_what_if(doc: dict[str, Any]) -> Table:
    """Per rank, the iteration predicted at each TP degree (`measured`: the run's degree)."""
    rows = [{"rank": r, "degree": w["degree"], "measured": w["degree"] == tp["degree"],
             **{k: w[k] for k in ("t_iter", "speedup", "compute_s", "comm_s")}}
            for r, tp in _sections(doc, "tensor_parallel") for w in tp["what_if"]]
    return _table("tp_what_if", rows, TP_WHAT_IF_COLUMNS)


def pipeline_stages(doc: dict[str, Any]) -> Table:
    """One row per pipeline stage: its rank, per-microbatch forward, backward and loss,
    its busy time, schedule step and bubble per iteration (`bubble_share`: of its
    iteration), its waits for its neighbours and p2p transfers."""
    pl = _pipeline(doc)
    rows = []
    for s in (pl or {}).get("stages", []):
        row = {k: s.get(k) for k in STAGE_COLUMNS if k in s}
        row["slowest"] = s["stage"] == pl["slowest_stage"]
        row["bubble_share"] = s["bubble_s"] / s["t_iter"] if s.get("t_iter") else None
        rows.append(row)
    return _table("pipeline_stages", rows, STAGE_COLUMNS)


def pipeline_what_if(doc: dict[str, Any]) -> Table:
    """The pipeline's what-ifs (pipesim's replay): the change, the schedule and microbatch
    count replayed, the predicted iteration, the replayed bubble's share of the step."""
    pl = _pipeline(doc)
    return _table("pipeline_what_if", list((pl or {}).get("what_if", [])),
                  PIPELINE_WHAT_IF_COLUMNS)


def expert_parallel(doc: dict[str, Any]) -> Table:
    """Per rank, its expert-parallel all-to-alls per iteration: count, bytes, time, the time
    it stood in them, its dispatches and combines (forward), its bytes to each peer of the
    group (`peer_bytes`, rank 0 of the group first; () when not recorded) and its bytes over
    the mean rank's (`bytes_over_mean`; `most_loaded`: the imbalance's most-loaded rank),
    its wait per iteration for its group's last rank to enter the all-to-alls (`wait_s`,
    None where not known)."""
    rows = []
    for r, ep in _sections(doc, "expert_parallel"):
        imb = ep.get("imbalance") or {}
        by = {int(k): v for k, v in (imb.get("bytes_by_rank") or {}).items()}
        mean = sum(by.values()) / len(by) if by else 0.0
        row = {"rank": r, "degree": ep["degree"], "moe_layers": ep["moe_layers"],
               "count": ep["count"], "bytes": ep["bytes"], "time_s": ep["time_s"],
               "exposed_s": ep["exposed_s"]}
        for role in ("dispatch", "combine"):
            x = ep["roles"].get(role) or {}
            row.update({f"{role}_count": x.get("count", 0.0),
                        f"{role}_bytes": x.get("bytes", 0.0),
                        f"{role}_exposed_s": x.get("exposed_s", 0.0)})
        waits = next((g.get("wait_s") or {} for g in imb.get("groups") or ()
                      if r in g.get("ranks", ())), {})
        row.update(peer_bytes=tuple(ep.get("peers") or ()),
                   bytes_over_mean=by[r] / mean if r in by and mean > 0 else None,
                   most_loaded=imb.get("most_loaded_rank") == r if imb else None,
                   wait_s=waits.get(str(r)))
        rows.append(row)
    return _table("expert_parallel", rows, EP_COLUMNS)
