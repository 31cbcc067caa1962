"""The recorder's side: what runs inside the job beside the collectors. `core` (the
process's recorder: rows, flushes, shards), `session` (the Python API's Session), `clock`,
`loop` (iterations), `ring` (`record --max-size`), `capture` (`gputrace capture`'s answer
inside the job)."""
