"""A cupy-shaped fake (the calls gputrace's probe makes), backed by numpy, for CPU tests.

Device memory is numpy arrays registered by pointer, so copies really move bytes and a test
can check what went where. Peer access is tracked per ordered device pair."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import numpy as np


class CUDARuntimeError(RuntimeError):
    pass


class FakeCupy:
    uint8 = np.uint8

    def __init__(self, devices: int = 2, peer: bool = True, fail_count: bool = False) -> None:
        self.devices = devices
        self.peer = peer
        self.fail_count = fail_count
        self.current = 0
        self.memory: dict[int, tuple[int, np.ndarray]] = {}   # ptr -> (device, buffer)
        self.peer_enabled: set[tuple[int, int]] = set()
        self.copies: list[tuple[str, Any]] = []               # (kind, details), in order
        self._ptr = itertools.count(0x1000, 0x1000)
        fake = self

        class Device:
            def __init__(self, i: int) -> None:
                self.i = i

            def __enter__(self) -> Device:
                self.prev, fake.current = fake.current, self.i
                return self

            def __exit__(self, *exc: object) -> None:
                fake.current = self.prev

        class Stream:
            def __init__(self, non_blocking: bool = False) -> None:
                self.ptr = next(fake._ptr)
                self.device = fake.current

            def synchronize(self) -> None:
                pass

        self.cuda = SimpleNamespace(Device=Device, Stream=Stream, runtime=self._runtime())
        self.cupyx = SimpleNamespace(empty_pinned=lambda n, dtype: np.empty(n, dtype))

    # -- arrays --------------------------------------------------------------------------
    def empty(self, n: int, dtype: Any = np.uint8) -> _DevArray:
        return _DevArray(self, np.empty(n, dtype))

    def empty_like(self, a: _DevArray) -> _DevArray:
        return self.empty(a.buf.size, a.buf.dtype)

    def _runtime(self) -> SimpleNamespace:
        fake = self

        def count() -> int:
            if fake.fail_count:
                raise CUDARuntimeError("cudaErrorNoDevice: no CUDA-capable device is detected")
            return fake.devices

        def enable(peer: int) -> None:
            key = (fake.current, peer)
            if key in fake.peer_enabled:
                raise CUDARuntimeError("cudaErrorPeerAccessAlreadyEnabled")
            fake.peer_enabled.add(key)

        def disable(peer: int) -> None:
            key = (fake.current, peer)
            if key not in fake.peer_enabled:
                raise CUDARuntimeError("cudaErrorPeerAccessNotEnabled")
            fake.peer_enabled.discard(key)

        def memcpy(dst: int, src: int, n: int, kind: int, stream: int) -> None:
            fake.memory[dst][1][:n] = fake.memory[src][1][:n]
            fake.copies.append(("d2d", (fake.memory[src][0], fake.memory[dst][0], n, kind)))

        def memcpy_peer(dst: int, dst_dev: int, src: int, src_dev: int, n: int,
                        stream: int) -> None:
            assert fake.memory[dst][0] == dst_dev and fake.memory[src][0] == src_dev
            fake.memory[dst][1][:n] = fake.memory[src][1][:n]
            on = (src_dev, dst_dev) in fake.peer_enabled
            fake.copies.append(("p2p", (src_dev, dst_dev, n, on)))

        return SimpleNamespace(
            CUDARuntimeError=CUDARuntimeError, getDeviceCount=count,
            getDeviceProperties=lambda i: {"name": b"Fake GPU"},
            deviceCanAccessPeer=lambda a, b: int(fake.peer and a != b),
            deviceEnablePeerAccess=enable, deviceDisablePeerAccess=disable,
            memcpyAsync=memcpy, memcpyPeerAsync=memcpy_peer)


class _DevArray:
    def __init__(self, fake: FakeCupy, buf: np.ndarray) -> None:
        self.fake = fake
        self.buf = buf
        self.device = fake.current
        self.data = SimpleNamespace(ptr=next(fake._ptr))
        fake.memory[self.data.ptr] = (self.device, buf)

    def set(self, host: np.ndarray, stream: Any = None) -> None:
        self.buf[:] = host
        self.fake.copies.append(("h2d", (self.device, host.nbytes)))

    def get(self, stream: Any = None, out: np.ndarray | None = None) -> np.ndarray:
        out = np.empty_like(self.buf) if out is None else out
        out[:] = self.buf
        self.fake.copies.append(("d2h", (self.device, out.nbytes)))
        return out
