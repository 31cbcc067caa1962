"""Shi & Chu's performance model, equations (1)-(12) and the ratios beside them, as plain
functions of their terms (seconds, bytes)."""

from __future__ import annotations

from collections.abc import Sequence


def eq1(t_io: float, t_h2d: float, t_f: float, t_b: float, t_u: float) -> float:
    return t_io + t_h2d + t_f + t_b + t_u


def eq2(t_io: float, t_h2d: float, t_f: float, t_b: float, t_u: float, t_comm: float) -> float:
    return t_io + t_h2d + t_f + t_b + t_u + t_comm


def eq4(t_gpu: float, t_comm: float, t_io: float) -> float:
    """Pipelined I/O: the mean iteration is the slower of the two pipelines."""
    return max(t_gpu + t_comm, t_io)


def eq5(t_io: float, t_h2d: float, t_f: float, t_b_first: float, comm_span: float,
        t_u: float) -> float:
    """Overlapped comm: backward of the first layer, then comm from its first start to its
    last end (tau_comm_e - tau_comm_s), then the update."""
    return t_io + t_h2d + t_f + t_b_first + comm_span + t_u


def eq6(t_io: float, t_h2d: float, t_f: float, t_b: float, t_comm_1: float,
        t_u_1: float) -> float:
    """Case 1 of layer-wise overlap: only the last layer's comm and update are exposed."""
    return t_io + t_h2d + t_f + t_b + t_comm_1 + t_u_1


def eq7(t_io: float, t_h2d: float, t_f: float, t_comm_exposed: Sequence[float],
        t_b_before_c: Sequence[float], t_comm_1: float, t_u_1: float) -> float:
    """Case 2: comm of layers C..L, backward of layers 1..C-1, then the last comm/update."""
    return t_io + t_h2d + t_f + sum(t_comm_exposed) + sum(t_b_before_c) + t_comm_1 + t_u_1


def eq8(n_g: int, t_io_1: float, t_gpu: float, t_io_ng: float, t_comm: float) -> float:
    """Speedup of S-SGD with comm after backward (weak scaling)."""
    return n_g * (t_io_1 + t_gpu) / (t_io_ng + t_gpu + t_comm)


def eq9(n_g: int, t_io_1: float, t_gpu: float, overlapped_t_iter_without_io: float,
        t_io_ng: float) -> float:
    """Speedup with layer-wise overlap (both cases): the denominator is eq. 6 or 7."""
    return n_g * (t_io_1 + t_gpu) / (t_io_ng + overlapped_t_iter_without_io)


def eq10(t_io: float, t_h2d: float, t_f: float, t_b: float, t_comm_1: float,
         t_u: float) -> float:
    """Overlap with the update after all comm (TensorFlow single node; PyTorch DDP)."""
    return t_io + t_h2d + t_f + t_b + t_comm_1 + t_u


def eq11(n_g: int, t_io_1: float, t_gpu: float, t_io_ng: float, t_h2d: float, t_f: float,
         t_b: float, t_comm_1: float, t_u: float) -> float:
    return n_g * (t_io_1 + t_gpu) / (t_io_ng + t_h2d + t_f + t_b + t_comm_1 + t_u)


def eq12(s_g_bytes: float, t_comm: float, link_bytes_per_s: float) -> float:
    """All-reduce efficiency: gradient bytes moved per second over the link's peak."""
    return s_g_bytes / (t_comm * link_bytes_per_s)


def r_u2g(t_u: float, t_h2d: float, t_f: float, t_b: float) -> float:
    """Update time relative to the GPU work; higher means eq. 11 scales worse."""
    return t_u / (t_h2d + t_f + t_b)


def t_io_from_bandwidth(batch_bytes: float, bytes_per_s: float) -> float:
    """The paper's t_io = S_d / B_cache (or B_disk): the least time to read one batch."""
    return batch_bytes / bytes_per_s


def ring_factor(n: int) -> float:
    """Bytes each rank sends in a ring all-reduce, per byte of gradient."""
    return 2.0 * (n - 1) / n if n > 1 else 0.0
