"""The paper's own worked numbers, reproduced from its inputs (Shi & Chu 2018, Sec. VI)."""

from __future__ import annotations

import pytest

from gputrace.analyzers.core import model as m

MB = 1024 * 1024  # the paper divides MB by 1024 to get GB


def test_eq8_cntk_alexnet_speedups():
    # Table V: t_gpu = 0.0527 + 0.1684 + 0.2918 + 0.0086 = 0.5215, t_io_1 = 0.223
    t_gpu = 0.5215
    assert m.eq8(2, 0.223, t_gpu, 0.45, 0.0359) == pytest.approx(1.478, abs=5e-4)
    assert m.eq8(4, 0.223, t_gpu, 0.72, 0.042) == pytest.approx(2.32, abs=5e-3)


def test_eq12_allreduce_efficiency_cntk():
    link = 7 * 1024 * MB  # 56 Gb/s = 7 GB/s
    assert m.eq12(63 * MB * 8, 0.0906, link) == pytest.approx(0.7761, abs=5e-4)
    assert m.eq12(63 * MB * 16, 0.236, link) == pytest.approx(0.5959, abs=5e-4)


def test_r_u2g_googlenet_and_resnet():
    assert m.r_u2g(0.0005, 0.016, 0.1129, 0.1856) == pytest.approx(0.0016, abs=5e-5)
    assert m.r_u2g(0.0015, 0.045, 0.0767, 0.1345) == pytest.approx(0.0059, abs=5e-5)


def test_t_io_from_page_cache_bandwidth():
    s_d = 1024 * 224 * 224 * 3 * 4  # one AlexNet batch of float32 images: 588 MB
    assert s_d / MB == pytest.approx(588, abs=0.5)
    assert m.t_io_from_bandwidth(588 * MB, 3.5 * 1024 * MB) == pytest.approx(0.164, abs=5e-4)


def test_equations_compose_as_written():
    assert m.eq2(1, 2, 3, 4, 5, 6) == 21
    assert m.eq4(0.5, 0.1, 0.7) == 0.7 and m.eq4(0.5, 0.3, 0.7) == 0.8
    assert m.eq6(0, 0.1, 0.2, 0.4, 0.05, 0.01) == pytest.approx(0.76)
    assert m.eq7(0, 0.1, 0.2, [0.3, 0.2], [0.05, 0.05], 0.05, 0.01) == pytest.approx(0.96)
    assert m.eq10(0.01, 0.1, 0.2, 0.4, 0.05, 0.02) == pytest.approx(0.78)
    # eq. 11 equals N * (t_io_1 + t_gpu) over eq. 10's iteration time
    s = m.eq11(4, 0.01, 0.72, 0.01, 0.1, 0.2, 0.4, 0.05, 0.02)
    assert s == pytest.approx(4 * 0.73 / 0.78)
    assert m.ring_factor(2) == 1.0 and m.ring_factor(8) == pytest.approx(1.75)
