"""One analyzer module per parallelism a run can show: classify (which dimension each
collective serves), tp (tensor parallel), pp and pipesim (pipeline parallel), ep (expert
parallel); registry picks the dimensions a run shows and combines them. Data parallelism
keeps the paper's model (analyzers.steps, model, replay) and FSDP its sharded one
(analyzers.sharded)."""
