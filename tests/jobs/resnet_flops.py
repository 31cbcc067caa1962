"""A small ResNet (torchvision's BasicBlock shape: two 3x3 convolutions and a residual add,
a 1x1 strided convolution on the shortcut where the shape changes) that counts its own
FLOPs and times its own iterations:

    python resnet_flops.py OUT [--steps N]

Every convolution's FLOPs are counted here analytically, 2 * N * Cout * Hout * Wout * Cin *
k * k (no bias), the classifier's 2 * N * in * out; a backward computes the gradient of the
weight (as much as the forward) and of the input (as much again), except for the stem's
input, which needs none; batch norm, ReLU, the residual add and the pooling count none
(FlopCounterMode counts none of them). Each convolution and the classifier is counted
alone too, by torch.utils.flop_counter.FlopCounterMode around that module's forward and the
backward of its output, after the loop. The backward of each of them (its output's autograd
node, from its pre-hook to its hook) is timed with perf_counter in every step.

Writes OUT as JSON: {"layers": {module path: {"flops_f", "flops_b", "counted_f",
"counted_b" (analytic, and FlopCounterMode's on the module alone), "backward_s": [its
node's seconds per step]}}, "flops_f", "flops_b", "iterations": [seconds per step],
"step_ends": [perf_counter after each optimizer step]}.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

BATCH, SIDE = 8, 32


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.layers = nn.Sequential(BasicBlock(16, 16, 1), BasicBlock(16, 32, 2),
                                    BasicBlock(32, 64, 2))
        self.fc = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = self.layers(x)
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def analytic(model: nn.Module, x: torch.Tensor) -> dict[str, dict[str, int]]:
    """Each convolution's and the classifier's FLOPs from its shapes (seen by a forward)."""
    shapes: dict[str, tuple[torch.Size, torch.Size]] = {}
    handles = [m.register_forward_hook(
        lambda m, i, o, name=name: shapes.__setitem__(name, (i[0].shape, o.shape)))
        for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    out = {}
    mods = dict(model.named_modules())
    for name, (i, o) in shapes.items():
        m = mods[name]
        if isinstance(m, nn.Conv2d):
            k = m.kernel_size[0] * m.kernel_size[1]
            f = 2 * o[0] * o[1] * o[2] * o[3] * m.in_channels * k
        else:
            f = 2 * i[0] * m.in_features * m.out_features
        # the stem's input needs no gradient: its backward is the weight's alone
        out[name] = {"flops_f": f, "flops_b": f if name == "conv1" else 2 * f}
    return out


def counted_alone(model: nn.Module, x: torch.Tensor) -> dict[str, tuple[int, int]]:
    """FlopCounterMode's count of each convolution and the classifier run alone: its
    forward on its own input (captured from a forward of the model), then the backward of
    its output."""
    inputs: dict[str, torch.Tensor] = {}
    handles = [m.register_forward_hook(
        lambda m, i, o, name=name: inputs.__setitem__(name, i[0].detach()))
        for name, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(x)
    for h in handles:
        h.remove()
    mods = dict(model.named_modules())
    out = {}
    for name, inp in inputs.items():
        inp = inp.clone().requires_grad_(name != "conv1")
        with FlopCounterMode(display=False) as fwd:
            y = mods[name](inp)
        with FlopCounterMode(display=False) as bwd:
            y.backward(torch.ones_like(y))
        out[name] = (fwd.get_total_flops(), bwd.get_total_flops())
    model.zero_grad()
    return out


def time_backward(model: nn.Module, steps: int, step: list[int]
                  ) -> tuple[dict[str, list[float]], list[object]]:
    """Each convolution's and the classifier's backward node timed in every step: a forward
    hook puts a pre-hook and a hook on the node its output came from."""
    own: dict[str, list[float]] = {}
    handles = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.Conv2d, nn.Linear)):
            continue
        own[name] = [0.0] * steps

        def hook(m, i, o, name=name) -> None:  # noqa: ANN001
            if o.grad_fn is None:
                return
            t0: list[float] = []
            o.grad_fn.register_prehook(lambda g: t0.append(time.perf_counter()))

            def done(gi, go) -> None:  # noqa: ANN001
                own[name][step[0]] += time.perf_counter() - t0.pop()
            o.grad_fn.register_hook(done)
        handles.append(m.register_forward_hook(hook))
    return own, handles


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=7)
    a = ap.parse_args()
    torch.manual_seed(0)
    model = ResNet()
    x, y = torch.randn(BATCH, 3, SIDE, SIDE), torch.randint(0, 10, (BATCH,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    its, ends = [], []
    step = [0]
    own_b, handles = time_backward(model, a.steps, step)
    for s in range(a.steps):
        step[0] = s
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        ends.append(time.perf_counter())
        its.append(ends[-1] - t0)
    for h in handles:
        h.remove()
    layers = analytic(model, x)
    for name, (f, b) in counted_alone(model, x).items():
        layers[name].update(counted_f=f, counted_b=b, backward_s=own_b[name])
    with open(a.out, "w") as fh:
        json.dump({"layers": layers, "flops_f": sum(v["flops_f"] for v in layers.values()),
                   "flops_b": sum(v["flops_b"] for v in layers.values()),
                   "iterations": its, "step_ends": ends}, fh)


if __name__ == "__main__":
    main()
