"""Run-level analyses beside the iteration model: FLOPs, memory, throughput, goodput and
the whole run outside the window, recomputation, the stall after a step, hangs."""
