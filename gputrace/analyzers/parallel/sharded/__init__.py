"""Sharded data parallelism: FSDP and DeepSpeed ZeRO, their inputs, settings, simulations
and what-ifs."""
