"""Whether a recording is one node's of a job across several, as its launcher tells, and the
file name such a node writes."""

from __future__ import annotations

import os


def _int_env(name: str) -> int:
    try:
        return int(os.environ.get(name, ""))
    except ValueError:
        return 0


def _nnodes(command: list[str]) -> str | None:
    """torchrun's --nnodes in a command (`torchrun`, `python -m torch.distributed.run`)."""
    if not any(os.path.basename(a) == "torchrun" or a in ("torch.distributed.run",
                                                          "torch.distributed.launch")
               for a in command[:4]):
        return None
    for i, a in enumerate(command):
        if a == "--nnodes" and i + 1 < len(command):
            return command[i + 1]
        if a.startswith("--nnodes="):
            return a.split("=", 1)[1]
    return None


def spans_nodes(command: list[str]) -> bool:
    """Whether this recording is one of several, one per node, of a job across nodes, as its
    launcher tells: torchrun's --nnodes, Slurm's node count, or an MPI world larger than
    this node's share of it."""
    nn = _nnodes(command)
    if nn is not None and nn.strip() not in ("1", "1:1"):
        return True
    if max(_int_env("SLURM_NNODES"), _int_env("SLURM_JOB_NUM_NODES")) > 1:
        return True
    for world, local in (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"),
                         ("PMI_SIZE", "MPI_LOCALNRANKS")):
        if _int_env(local) and _int_env(world) > _int_env(local):
            return True
    return False


def node_output(path: str, host: str) -> str:
    """`run.arrow` -> `run.HOST.arrow`: the file of one node, beside the others; a launcher
    that starts one `record` per task (srun, mpirun) also puts the task's rank in it."""
    stem, ext = os.path.splitext(path)
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in host) or "host"
    task = next((os.environ[v] for v in ("SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
                 if os.environ.get(v, "").isdigit()), None)
    per_task = task is not None and max(_int_env("SLURM_NTASKS_PER_NODE"),
                                        _int_env("OMPI_COMM_WORLD_LOCAL_SIZE"),
                                        _int_env("MPI_LOCALNRANKS")) > 1
    return f"{stem}.{safe}{f'.{task}' if per_task else ''}{ext or '.arrow'}"
