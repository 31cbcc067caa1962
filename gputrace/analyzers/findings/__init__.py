"""What the analysis tells the reader (rules, and per concern: comm, memory) and what it
checks before it speaks (invariants, sanity)."""
