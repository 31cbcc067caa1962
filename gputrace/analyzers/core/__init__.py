"""The iteration core: a rank's spans as columns (frame), its iterations and phases
(steps), compute/comm overlap, comm units and collectives, the paper's model (model,
equations) and the frozen result types (results)."""
