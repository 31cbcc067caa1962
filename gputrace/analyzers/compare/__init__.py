"""Two runs or two sets of runs side by side: the terms, goodput, noise and parts that
changed."""
