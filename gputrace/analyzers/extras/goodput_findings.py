"""The findings of the run's time beyond its iterations: a badput category that takes a
large share of the run (an analyzers.extras.goodput.Goodput, taken as it comes: this module
imports nothing of the analysis, so none of its import circle), with its evidence and what
would help."""

from __future__ import annotations

from typing import Any

from gputrace.analyzers.findings.rules import Finding


def _probed(bytes_per_s: float | None) -> str:
    if bytes_per_s is None or not bytes_per_s > 0:
        return "a disk write bandwidth not probed (gputrace probe measures it)"
    return f"{bytes_per_s / 1e6:.0f} MB/s probed (disk write with fsync)"


STARTUP_PARTS = {"torch_import_s": "to torch's import (interpreter, imports, torch's own)",
                 "init_process_group_s": "init_process_group",
                 "loader_start_s": "the loaders' start",
                 "compile_s": "torch.compile's compilation"}

# a category's share of the run from which it is a finding
EVALUATION_LARGE = 0.10
CHECKPOINT_LARGE = 0.05
STALLS_LARGE = 0.05
STARTUP_LARGE = 0.25


def findings(g: Any, disk_write_bytes_per_s: float | None = None
             ) -> list[Finding]:
    """What the run's time beyond its iterations says, where a category is large; a save's
    rate beside the disk's probed write bandwidth (`gputrace probe`'s disk_write) where a
    probe came with the trace."""
    if g is None or not g.wall_s > 0:
        return []
    out = []
    ev, ck = g.evaluation, g.checkpoint
    sh = g.share("evaluation")
    if sh >= EVALUATION_LARGE and ev.get("passes"):
        out.append(Finding(
            "evaluation_large", "high" if sh >= 0.25 else "moderate",
            f"evaluation takes {sh:.0%} of the run ({g.badput_s['evaluation']:.2f} s of "
            f"{g.wall_s:.2f} s): {ev['passes']} passes of {ev['per_pass_s']:.2f} s, "
            + (f"{ev['batches']} batches of {ev['per_batch_s'] * 1e3:.0f} ms, "
               if ev.get("batches") else "")
            + f"beside {g.iterations} training steps; evaluating less often or on fewer batches "
            "gives the time back to training"))
    sh = g.share("checkpointing")
    if sh >= CHECKPOINT_LARGE and ck.get("count"):
        rate = ck.get("bytes_per_s", float("nan"))
        moved = (f", {ck['bytes'] / ck['count'] / 1e6:.1f} MB each at {rate / 1e6:.0f} MB/s"
                 f" against {_probed(disk_write_bytes_per_s)}" if rate == rate else "")
        out.append(Finding(
            "checkpoint_large", "high" if sh >= 0.20 else "moderate",
            f"checkpointing takes {sh:.0%} of the run: {ck['count']} saves or loads of "
            f"{ck['per_save_s']:.2f} s{moved}; " + (
                "saving less often (ModelCheckpoint's save_freq) or only the best "
                "(save_best_only) would give the time back to training" if g.keras_saves
                else "torch.distributed.checkpoint's async_save would take the writes off "
                "the training loop (only its staging blocks)")))
    sh = g.share("stalls")
    if sh >= STALLS_LARGE:
        out.append(Finding(
            "stalls_large", "moderate",
            f"{g.badput_s['stalls']:.2f} s ({sh:.0%} of the run) pass between training "
            "steps with nothing recorded at work: waits outside the recorded phases "
            "(a sleep, a lock, a peer, I/O the loop does itself)"
            + (f"; {g.after_step_stalls_s:.2f} s of them after a step's last phase, before "
               "its next batch (work after optimizer.step() that nothing records: a sleep, "
               "a synchronous write, logging)" if g.after_step_stalls_s >= 0.0005 else "")
            + (f"; {g.stalls_outside_window_s:.2f} s of them outside the recorded window, "
               "where a data wait or other work is not told apart"
               if g.stalls_outside_window_s > 0 else "")))
    sh = g.share("startup")
    if sh >= STARTUP_LARGE:
        parts = g.startup_parts_s
        seen = ", ".join(f"{STARTUP_PARTS.get(k, k)} {v:.2f} s"
                         for k, v in parts.items() if v > 0 and k != "other_s")
        rest = f" ({parts['other_s']:.2f} s)" if "other_s" in parts else ""
        out.append(Finding(
            "startup_large", "info",
            f"start-up takes {sh:.0%} of the run ({g.badput_s['startup']:.2f} s from the "
            "process's start to the first training step"
            + (" and torch.compile's compilations" if "compile_s" in parts else "")
            + f"{': ' + seen if seen else ''}; "
            f"the rest{rest} the "
            "job's other imports and set-up and the model's construction, not told apart): "
            "a longer run spreads it"))
    return out
