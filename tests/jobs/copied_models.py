"""A job that copies and pickles its model as people do: an EMA copy (copy.deepcopy), a
checkpoint of the whole model (torch.save(model)), and training resumed on the model loaded
back from it. Prints one line per stage; the last line is the step at which the loaded model
began training."""

import copy
import io
import sys

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
step = 0


def train(m: nn.Module, o: torch.optim.Optimizer, n: int) -> None:
    global step
    for _ in range(n):
        loss = m(torch.randn(8, 16)).pow(2).mean()
        loss.backward()
        o.step()
        o.zero_grad()
        step += 1


train(model, opt, 3)
ema = copy.deepcopy(model)                   # an EMA / teacher copy
with torch.no_grad():
    for pe, p in zip(ema.parameters(), model.parameters(), strict=True):
        pe.mul_(0.9).add_(p, alpha=0.1)
print("deepcopy ok", flush=True)
buf = io.BytesIO()
torch.save(model, buf)                       # a whole-model checkpoint
buf.seek(0)
loaded = torch.load(buf, weights_only=False)
print("pickle ok", flush=True)
first = step
train(loaded, torch.optim.SGD(loaded.parameters(), lr=0.01), int(sys.argv[1]))
print(f"loaded from step {first}", flush=True)
