"""One room per parallelism a run can show: ddp (data parallel: the paper's model and DDP's
replay), sharded (FSDP and ZeRO), tp (tensor parallel), pp (pipeline parallel), ep (expert
parallel); classify gives each collective its dimension, registry picks the dimensions a
run shows and combines them, whatif_bands holds the what-ifs' measured error bands."""
