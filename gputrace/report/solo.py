"""What the terminal leaves out, words or says once: a single process's empty communication
rows and tautological model line, the file reads a bandwidth line cannot show, and the advice
to run `gputrace probe`, which several figures would each give."""

from __future__ import annotations

from typing import Any

from gputrace.fmt import MB_SHOWN, mb, rate

# the job's file reads: bytes over the analyzed iterations, per second of data loading
READS = {"disk": "disk reads", "cache": "page-cache reads (files already in memory)"}

# the clauses that advise `gputrace probe`, as the analyzers word them, and what stands in
# for each once the advice has been given
PROBE_CLAUSES = (
    (": give the link's bandwidth (--link-bandwidth, or `gputrace probe` before recording)",
     " (as for the speedup: --link-bandwidth, or the probe above)"),
    ("no link bandwidth known (`gputrace probe` or", "no link bandwidth known (the probe above or"),
    # the report's captions of the bandwidth and FLOPs charts
    ("no probed peaks in this trace: run `gputrace probe` once on the host",
     "no probed peaks in this trace"),
    ("(no peak known: run gputrace probe on this machine)", "(no peak known)"),
)


def one_process(a: Any) -> bool:
    """One process, not distributed: no ranks to tell apart."""
    return bool(a.world_size <= 1 and len(a.ranks) == 1)


def solo(a: Any, ra: Any) -> bool:
    """One process and no collective measured: no communication to show."""
    return one_process(a) and not ra.comm["total_s"] > 0


def iterations_line(a: Any, ra: Any) -> str:
    """'rank 1 of 2 (slowest); 27 iterations analyzed, ...' ('one process' where there are
    no ranks to tell apart)."""
    who = "one process" if one_process(a) else \
        f"rank {ra.rank} of {a.world_size}" + \
        (" (slowest)" if len(a.ranks) > 1 and ra.rank == a.slowest_rank else "")
    n = ra.analyzed
    return (f"{who}; {n} iteration{'' if n == 1 else 's'} analyzed, first "
            f"{ra.warmup_skipped} skipped as warm-up")


class ProbeAdvice:
    """Gives the advice to run `gputrace probe` once: later lines lose it."""

    def __init__(self) -> None:
        self.given = False

    def __call__(self, text: str) -> str:
        if not self.given:
            self.given = "gputrace probe" in text
            return text
        return self.quiet(text)

    @staticmethod
    def quiet(text: str) -> str:
        """The text without the advice, where the terminal gives none there."""
        for clause, instead in PROBE_CLAUSES:
            text = text.replace(clause, instead)
        return text


def shown_links(links: list[Any]) -> list[Any]:
    """The links a line can show: more than 0.0 MB moved, and file reads faster than the
    0 MB/s that rate() would print (a job's few reads of its own files)."""
    return [x for x in links if x.bytes >= MB_SHOWN and
            (x.name not in READS or x.bytes_per_s >= 0.5e6)]


def link_text(link: Any) -> str:
    s = f"{READS.get(link.name, link.name)} {mb(link.bytes)} at {rate(link.bytes_per_s)}"
    if link.name in READS:
        s += " of loading"
    if link.fraction_of_peak is not None:
        s += f" ({link.fraction_of_peak:.0%} of the probed {rate(link.peak_bytes_per_s or 0)})"
    return s
