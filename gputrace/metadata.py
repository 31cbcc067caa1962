"""What every shard says of the process that wrote it: host, rank and world size from the
launcher's environment (torchrun, mpirun, srun, TF_CONFIG), argv (redacted on request), the
allowlisted environment and the software's versions."""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Iterable
from typing import Any

# Environment variables a trace may keep; everything else stays out (secrets live there).
ENV_ALLOWLIST = (
    "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "WORLD_SIZE", "RANK", "LOCAL_RANK",
    "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_PORT",
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "PMI_RANK", "PMI_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_JOB_ID",
    "SLURM_NNODES", "SLURM_NODEID", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS", "GPUTRACE_HOST", "OMP_NUM_THREADS", "NCCL_ALGO", "NCCL_PROTO", "NCCL_IB_DISABLE",
    "NCCL_P2P_DISABLE", "NCCL_SOCKET_IFNAME", "NCCL_NET", "NCCL_DEBUG",
    "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG", "PYTORCH_CUDA_ALLOC_CONF",
)

RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
WORLD_VARS = ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
LOCAL_RANK_VARS = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                   "SLURM_LOCALID")


def hostname() -> str:
    """The node's name: GPUTRACE_HOST where a launcher or container gives each node its own
    (several containers on one host, or hosts whose names collide), else the host name."""
    return os.environ.get("GPUTRACE_HOST") or socket.gethostname()


def env_int(names: Iterable[str], default: int = -1) -> int:
    for n in names:
        v = os.environ.get(n)
        if v is not None:
            try:
                return int(v)
            except ValueError:
                continue
    return default


def tf_config_rank() -> tuple[int, int]:
    """(rank, world size) of a TensorFlow multi-worker job from TF_CONFIG (the chief first,
    then the workers, as MultiWorkerMirroredStrategy numbers its tasks), else (-1, -1)."""
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return -1, -1
    try:
        cfg = json.loads(raw)
        cluster, task = cfg["cluster"], cfg["task"]
        order = [t for t in ("chief", "worker") if t in cluster]
        world = sum(len(cluster[t]) for t in order)
        rank = sum(len(cluster[t]) for t in order[:order.index(task["type"])]) + \
            int(task["index"])
        return rank, world
    except (ValueError, KeyError, TypeError, AttributeError):
        return -1, -1


def redact_argv(argv: list[str]) -> list[str]:
    """Keep the program and flag names; replace every value with '<redacted>'."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if i == 0:
            out.append(a)
        elif a.startswith("-"):
            out.append(a.split("=", 1)[0] + ("=<redacted>" if "=" in a else ""))
        else:
            out.append("<redacted>")
    return out


def base_metadata(role: str, argv: list[str] | None = None, rank: int | None = None) -> dict[str, Any]:
    """Metadata every shard carries. Environment: only the allowlist, never the rest."""
    argv = list(sys.argv if argv is None else argv)
    if os.environ.get("GPUTRACE_REDACT_ARGV") == "1":
        argv = redact_argv(argv)
    try:
        import importlib.metadata as im
        version = im.version("gputrace")
    except Exception:  # running from a source tree without an install
        version = "0+unknown"
    tf_rank, tf_world = tf_config_rank() if rank is None else (-1, -1)
    return {
        "role": role,
        "host": hostname(),
        "pid": os.getpid(),
        "rank": env_int(RANK_VARS, tf_rank) if rank is None else rank,
        "world_size": env_int(WORLD_VARS, tf_world),
        "local_rank": env_int(LOCAL_RANK_VARS),
        "argv": argv,
        "cpus": os.cpu_count(),
        "env": {k: os.environ[k] for k in ENV_ALLOWLIST if k in os.environ},
        "software": {"gputrace": version, "python": sys.version.split()[0]},
        "collectors": {},
    }
