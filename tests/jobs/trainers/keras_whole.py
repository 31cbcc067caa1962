"""A Keras fit with validation_data, timing itself: a small dense model, `--epochs` epochs of
`--steps` batches, validation of `--val-batches` batches after each. Its own callback notes
each batch's begin (`steps`, and `step_times[]`: each batch's begin and end) and each
validation's begin and end with its batches (`evals[]`: `start`, `end`, `batches`) on
time.time_ns's clock (perf_counter, put on it once), written to OUT.json with the process's
start from the kernel (`process_start`) and the end of main's fit (`end`). With
`--checkpoint DIR`, two ModelCheckpoints: the model each epoch (`DIR/model-{epoch}.keras`,
`Model.save`) and its weights every `--save-every` batches (`DIR/weights-{batch}.weights.h5`,
`save_weights`); each timed around its save by the job itself (`saves[]`: `start`, `end`,
`path`, `bytes` the file's size after the fit).

    python keras_whole.py OUT.json [--epochs 3] [--steps 10] [--val-batches 5]
        [--checkpoint DIR] [--save-every 7]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def process_start_ns() -> int:
    """This process's start on time.time_ns's clock, from the kernel's count of ticks since
    boot (CLOCK_BOOTTIME)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    boot, wall = time.clock_gettime_ns(time.CLOCK_BOOTTIME), time.time_ns()
    return wall - (boot - ticks * 10**9 // os.sysconf("SC_CLK_TCK"))


T0_PROCESS = process_start_ns()
_PC0, _WALL0 = time.perf_counter_ns(), time.time_ns()


def now() -> int:
    return _WALL0 + time.perf_counter_ns() - _PC0


class Clock(tf.keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.truth: dict = {"steps": 0, "evals": [], "step_times": [],
                            "process_start": T0_PROCESS}

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        self.truth["steps"] += 1
        self.truth["step_times"].append([now(), 0])

    def on_train_batch_end(self, batch: int, logs: object = None) -> None:
        self.truth["step_times"][-1][1] = now()

    def on_test_begin(self, logs: object = None) -> None:
        self.truth["evals"].append({"start": now(), "batches": 0})

    def on_test_batch_end(self, batch: int, logs: object = None) -> None:
        self.truth["evals"][-1]["batches"] += 1

    def on_test_end(self, logs: object = None) -> None:
        self.truth["evals"][-1]["end"] = now()


def timed(cls: type, truth: dict) -> tf.keras.callbacks.Callback:
    """A ModelCheckpoint whose saves the job times itself: the file it names before the
    save, when the save made or changed it."""
    class Timed(cls):
        def _timed(self, call: object, *args: object) -> None:
            before = {p: os.stat(p).st_mtime_ns for p in self._own()}
            t0 = now()
            call(*args)
            t1 = now()
            for p in self._own():
                if before.get(p) != os.stat(p).st_mtime_ns:
                    truth["saves"].append({"start": t0, "end": t1, "path": p})

        def _own(self) -> list[str]:
            d = os.path.dirname(self.filepath)
            stem = os.path.basename(self.filepath).split("{")[0]
            return [os.path.join(d, f) for f in os.listdir(d) if f.startswith(stem)]

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            self._timed(super().on_train_batch_end, batch, logs)

        def on_epoch_end(self, epoch: int, logs: object = None) -> None:
            self._timed(super().on_epoch_end, epoch, logs)

    return Timed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--val-batches", type=int, default=5)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--save-every", type=int, default=7)
    a = p.parse_args()
    rng = np.random.default_rng(0)
    batch = 32
    x = rng.standard_normal((batch * a.steps, 64)).astype("float32")
    y = rng.integers(0, 10, batch * a.steps)
    xv = rng.standard_normal((batch * a.val_batches, 64)).astype("float32")
    yv = rng.integers(0, 10, batch * a.val_batches)
    model = tf.keras.Sequential([tf.keras.Input((64,)), tf.keras.layers.Dense(128, "relu"),
                                 tf.keras.layers.Dense(10)])
    model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    clock = Clock()
    callbacks: list = [clock]
    if a.checkpoint:
        clock.truth["saves"] = []
        cls = timed(tf.keras.callbacks.ModelCheckpoint, clock.truth)
        os.makedirs(a.checkpoint, exist_ok=True)
        callbacks += [
            cls(os.path.join(a.checkpoint, "model-{epoch}.keras")),
            cls(os.path.join(a.checkpoint, "weights-{batch}.weights.h5"),
                save_weights_only=True, save_freq=a.save_every)]
    model.fit(x, y, batch_size=batch, epochs=a.epochs, validation_data=(xv, yv),
              validation_batch_size=batch, callbacks=callbacks, verbose=0)
    for s in clock.truth.get("saves", []):
        s["bytes"] = os.path.getsize(s["path"])
    clock.truth["end"] = now()
    with open(a.out, "w") as f:
        json.dump(clock.truth, f)


if __name__ == "__main__":
    main()
