"""Pipeline parallelism: each rank's stages, the schedule's replay (pipesim, pporders),
the bubble, the model and its what-ifs."""
