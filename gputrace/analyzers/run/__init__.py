"""One analysis of a run: each rank's part (rank_part), the ranks together (ranks), read
and analyzed in parallel where worth it (reading), and `analyze` (analysis)."""
