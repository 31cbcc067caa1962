"""A small CNN trained on an on-disk image dataset: single process, or DDP under torchrun
(gloo on CPU, NCCL on CUDA). Made to show every case gputrace's analyzers recognize:

    python samples/train_cnn.py                                   # single process
    torchrun --standalone --nproc_per_node 2 samples/train_cnn.py --preset case1
    torchrun --standalone --nproc_per_node 2 samples/train_cnn.py --preset case2
    python samples/train_cnn.py --preset io

The dataset (uint8 images, one file each) is generated once into --data. Prints its own
throughput at the end.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

PRESETS: dict[str, dict[str, object]] = {
    # compute-heavy convolutions, small gradients in several buckets: comm hidden (Case 1)
    "case1": dict(width=48, fc_hidden=64, fc_layers=1, bucket_cap_mb=0.2, batch_size=48,
                  image_size=64, workers=2),
    # large fully-connected layers near the output, small buckets: comm exposed (Case 2)
    "case2": dict(width=8, fc_hidden=2048, fc_layers=2, bucket_cap_mb=1.0, batch_size=16,
                  image_size=64, workers=2),
    # few workers, cold page cache, heavy decode, light model: input-bound. One torch thread
    # in the loop: with two, a busy machine slows the loop's parallel regions far more than
    # the single-threaded loader (t_io fell from ~50 % to 1 % of an iteration beside a CPU
    # hog), and the run was no longer input-bound; with one, ~50-60 % busy or not
    "io": dict(width=4, fc_hidden=64, fc_layers=1, batch_size=32, image_size=128, workers=1,
               cold=True, decode_cost=20, threads=1),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), help="a configuration (flags override)")
    p.add_argument("--iterations", type=int, default=30)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--workers", type=int, help="DataLoader workers")
    p.add_argument("--width", type=int, help="channels of the first convolution")
    p.add_argument("--fc-hidden", type=int, help="width of the fully-connected layers")
    p.add_argument("--fc-layers", type=int, help="hidden fully-connected layers")
    p.add_argument("--bucket-cap-mb", type=float, help="DDP bucket size")
    p.add_argument("--image-size", type=int)
    p.add_argument("--samples", type=int, default=1024, help="images in the dataset")
    p.add_argument("--data", default=os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "gputrace", "samples"))
    p.add_argument("--cold", action="store_true",
                   help="drop each image from the page cache before reading it")
    p.add_argument("--decode-cost", type=int, help="extra decode work per image (blur passes)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--threads", type=int, help="torch threads per process")
    p.add_argument("--comm-hook", choices=["none", "allreduce", "fp16"], default="none",
                   help="register a DDP comm hook of the user's own")
    p.add_argument("--closure", action="store_true", help="use optimizer.step(closure)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--torch-profiler", action="store_true",
                   help="run under torch.profiler (a schedule, no shapes), for comparison")
    p.add_argument("--times-json", help="write rank 0's iteration times (s) to this file")
    p.add_argument("--waits-json", help="write rank 0's wait for each batch (s) to this file")
    p.add_argument("--steps-json", help="write rank 0's iterations as {start, end} "
                   "(time.time_ns: they tile the loop), with the CPU seconds the loop's "
                   "thread (main_cpu) and the process (cpu) used in each, to this file")
    a = p.parse_args(argv)
    defaults = dict(batch_size=32, workers=2, width=16, fc_hidden=128, fc_layers=1,
                    bucket_cap_mb=25.0, image_size=64, decode_cost=0)
    defaults.update(PRESETS.get(a.preset or "", {}))
    for k, v in defaults.items():
        if k == "cold":
            a.cold = a.cold or bool(v)
        elif getattr(a, k, None) is None:
            setattr(a, k, v)
    return a


# -- data --------------------------------------------------------------------------------
def ensure_dataset(root: str, n: int, size: int, classes: int = 10) -> str:
    """Generate n uint8 images of 3 x size x size once; race-safe across ranks."""
    final = os.path.join(root, f"cnn-{size}px-{n}")
    if os.path.exists(os.path.join(final, "labels.bin")):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".gen-", dir=root)
    g = torch.Generator().manual_seed(0)
    labels = torch.arange(n, dtype=torch.uint8) % classes
    yy, xx = torch.meshgrid(torch.arange(size), torch.arange(size), indexing="ij")
    for i in range(n):
        c = int(labels[i])
        # a class-dependent stripe pattern plus noise: learnable, not trivial
        base = ((xx * (c + 1) + yy * (classes - c)) % 64).float() * 3
        img = base.expand(3, size, size) + torch.randint(0, 64, (3, size, size), generator=g)
        with open(os.path.join(tmp, f"{i:06d}.u8"), "wb") as f:
            f.write(img.clamp(0, 255).to(torch.uint8).numpy().tobytes())
    with open(os.path.join(tmp, "labels.bin"), "wb") as f:
        f.write(labels.numpy().tobytes())
    os.sync()  # dirty pages cannot be dropped from the cache: --cold needs them on disk
    try:
        os.rename(tmp, final)
    except OSError:  # another rank finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return final


class ImageFiles(Dataset):
    def __init__(self, root: str, size: int, cold: bool, decode_cost: int) -> None:
        self.root = root
        self.size = size
        self.cold = cold
        self.decode_cost = decode_cost
        with open(os.path.join(root, "labels.bin"), "rb") as f:
            self.labels = list(f.read())
        self.kernel = torch.full((3, 1, 3, 3), 1 / 9)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path = os.path.join(self.root, f"{i:06d}.u8")
        fd = os.open(path, os.O_RDONLY)
        try:
            if self.cold:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            raw = b""
            while len(raw) < 3 * self.size * self.size:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                raw += chunk
        finally:
            os.close(fd)
        x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(3, self.size, self.size)
        x = x.float().div_(255.0)
        for _ in range(self.decode_cost):  # stands in for JPEG decoding and augmentation
            x = F.conv2d(x.unsqueeze(0), self.kernel, padding=1, groups=3).squeeze(0)
        return (x - 0.5) / 0.25, self.labels[i]


# -- model -------------------------------------------------------------------------------
def make_model(width: int, fc_hidden: int, fc_layers: int, classes: int = 10) -> nn.Module:
    w = width
    layers: list[nn.Module] = [
        nn.Conv2d(3, w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(w, 2 * w, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(2 * w, 4 * w, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
    ]
    n_in = 4 * w * 16
    for _ in range(fc_layers):
        layers += [nn.Linear(n_in, fc_hidden), nn.ReLU()]
        n_in = fc_hidden
    layers.append(nn.Linear(n_in, classes))
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    use_cuda = a.device == "cuda" or (a.device == "auto" and torch.cuda.is_available())
    if a.threads or world > 1:
        torch.set_num_threads(a.threads or max(1, (os.cpu_count() or 2) // world))
    if world > 1:
        if use_cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if use_cuda else "gloo")
    device = torch.device("cuda") if use_cuda else torch.device("cpu")
    torch.manual_seed(0)

    root = ensure_dataset(a.data, a.samples, a.image_size)
    ds = ImageFiles(root, a.image_size, a.cold, a.decode_cost)
    sampler = DistributedSampler(ds, seed=0) if world > 1 else None
    loader = DataLoader(ds, batch_size=a.batch_size, shuffle=sampler is None, sampler=sampler,
                        num_workers=a.workers, pin_memory=use_cuda, drop_last=True,
                        persistent_workers=a.workers > 0)
    model: nn.Module = make_model(a.width, a.fc_hidden, a.fc_layers).to(device)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, bucket_cap_mb=a.bucket_cap_mb)
        if a.comm_hook == "allreduce":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            calls = {"n": 0}

            def my_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks real annotations
                calls["n"] += 1
                return default_hooks.allreduce_hook(state, bucket)  # type: ignore[arg-type]

            model.register_comm_hook(None, my_hook)
        elif a.comm_hook == "fp16":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)

    done = 0
    t_start = time.perf_counter()
    losses: list[float] = []
    epoch = 0
    times: list[float] = []
    prof = None
    if a.torch_profiler:
        from torch.profiler import ProfilerActivity, profile, schedule

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if use_cuda else [])
        prof = profile(activities=acts, record_shapes=False,
                       schedule=schedule(wait=1, warmup=1, active=3, repeat=0),
                       on_trace_ready=lambda p: None)
        prof.start()
    t_last = time.perf_counter()
    waits: list[float] = []
    bounds = [time.time_ns()]   # iteration boundaries on the wall clock (--steps-json)
    cpus = [(time.thread_time(), time.process_time())]   # and the CPU used by then
    while done < a.iterations:
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            waits.append(time.perf_counter() - t_last)   # the loader's batch, waited for
            x = x.to(device, non_blocking=True)
            y = y.to(device, non_blocking=True)
            if a.closure:
                def closure(x: torch.Tensor = x, y: torch.Tensor = y) -> torch.Tensor:
                    opt.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    return loss

                loss = opt.step(closure)
            else:
                opt.zero_grad(set_to_none=True)
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
            losses.append(float(loss.detach()))
            if prof is not None:
                prof.step()
            now = time.perf_counter()
            times.append(now - t_last)
            bounds.append(time.time_ns())
            cpus.append((time.thread_time(), time.process_time()))
            t_last = now
            done += 1
            if done >= a.iterations:
                break
        epoch += 1
    if use_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t_start
    if prof is not None:
        prof.stop()
    if a.times_json and rank == 0:
        import json

        with open(a.times_json, "w") as f:
            json.dump(times, f)
    if a.waits_json and rank == 0:
        import json

        with open(a.waits_json, "w") as f:
            json.dump(waits, f)
    if a.steps_json and rank == 0:
        import json
        from itertools import pairwise

        with open(a.steps_json, "w") as f:
            json.dump([{"start": s, "end": e, "main_cpu": c1[0] - c0[0], "cpu": c1[1] - c0[1]}
                       for (s, e), (c0, c1) in zip(pairwise(bounds), pairwise(cpus),
                                                   strict=True)], f)
    if a.comm_hook == "allreduce" and world > 1:
        print(f"rank {rank}: user comm hook ran {calls['n']} times")
    if rank == 0:
        n = done * a.batch_size * world
        print(f"train_cnn: {done} iterations, {n} samples in {elapsed:.2f} s: "
              f"{n / elapsed:.1f} samples/s ({world} process{'es' if world > 1 else ''}, "
              f"{device.type}); loss {losses[0]:.3f} -> {losses[-1]:.3f}; median iteration "
              f"{1e3 * sorted(times[3:] or times)[len(times[3:] or times) // 2]:.1f} ms")
    if world > 1:
        # DDP's reducer keeps the last backward's all-reduce works, which hold a Python
        # object of torch's: freed here, on this thread, not by a gloo thread while the
        # interpreter exits (that aborts: "terminate called without an active exception")
        model = opt = loss = None
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
