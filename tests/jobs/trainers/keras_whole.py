"""A Keras fit with validation_data, timing itself: a small dense model, `--epochs` epochs of
`--steps` batches, validation of `--val-batches` batches after each. Its own callback notes
each batch's begin (`steps`) and each validation's begin and end with its batches
(`evals[]`: `start`, `end`, `batches`) on time.time_ns's clock (perf_counter, put on it
once), written to OUT.json.

    python keras_whole.py OUT.json [--epochs 3] [--steps 10] [--val-batches 5]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

_PC0, _WALL0 = time.perf_counter_ns(), time.time_ns()


def now() -> int:
    return _WALL0 + time.perf_counter_ns() - _PC0


class Clock(tf.keras.callbacks.Callback):
    def __init__(self) -> None:
        super().__init__()
        self.truth: dict = {"steps": 0, "evals": []}

    def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
        self.truth["steps"] += 1

    def on_test_begin(self, logs: object = None) -> None:
        self.truth["evals"].append({"start": now(), "batches": 0})

    def on_test_batch_end(self, batch: int, logs: object = None) -> None:
        self.truth["evals"][-1]["batches"] += 1

    def on_test_end(self, logs: object = None) -> None:
        self.truth["evals"][-1]["end"] = now()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--val-batches", type=int, default=5)
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
    model.fit(x, y, batch_size=batch, epochs=a.epochs, validation_data=(xv, yv),
              validation_batch_size=batch, callbacks=[clock], verbose=0)
    with open(a.out, "w") as f:
        json.dump(clock.truth, f)


if __name__ == "__main__":
    main()
