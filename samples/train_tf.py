"""A small Keras CNN trained with `Model.fit` on TensorFlow: one process, or two workers of
MultiWorkerMirroredStrategy on this machine (ring all-reduce over gRPC, TF_CONFIG with
local ports). CPU by default, the GPU when TensorFlow sees one.

    python samples/train_tf.py                          # one process
    python samples/train_tf.py --workers 2              # two workers, MultiWorkerMirroredStrategy
    python samples/train_tf.py --profile-dir logs/      # TensorFlow's own profile of steps 5-9

The images are made by a tf.data pipeline (random pixels, a flip and a brightness change per
image, batched and prefetched), so no dataset is read from disk. Prints its throughput.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=30, help="training steps (one epoch)")
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--width", type=int, default=16, help="channels of the first convolution")
    p.add_argument("--fc-hidden", type=int, default=256, help="width of the dense layers")
    p.add_argument("--fc-layers", type=int, default=1, help="hidden dense layers")
    p.add_argument("--steps-per-execution", type=int, default=1)
    p.add_argument("--workers", type=int, default=1,
                   help="2: MultiWorkerMirroredStrategy with two local worker processes")
    p.add_argument("--pack-mb", type=float, default=0.5,
                   help="--workers: gradients all-reduced in packs of this size (MB); 0: one")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "gpu"])
    p.add_argument("--threads", type=int, default=0,
                   help="TensorFlow intra- and inter-op threads (0: TensorFlow's default)")
    p.add_argument("--profile-dir", metavar="DIR",
                   help="profile steps 5-9 with TensorFlow's profiler into DIR (what "
                        "keras.callbacks.TensorBoard(profile_batch=(5, 9)) writes)")
    p.add_argument("--times-json", help="write the first worker's step times (ns) and the "
                   "model's parameter count here")
    p.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ports", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def tf_config(ports: str, index: int) -> str:
    return json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports.split(",")]},
                       "task": {"type": "worker", "index": index}})


def launch(a: argparse.Namespace, argv: list[str]) -> int:
    """Start one process per worker with its TF_CONFIG; the exit code is the worst one."""
    ports = ",".join(str(p) for p in free_ports(a.workers))
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv,
                               "--worker-index", str(i), "--ports", ports],
                              env=dict(os.environ, TF_CONFIG=tf_config(ports, i)))
             for i in range(a.workers)]
    codes = [p.wait() for p in procs]
    return max(codes, key=abs)


class StepTimes:
    """Each step's own time (from one batch's begin to the next), for --times-json, and
    when fit runs the step function Keras made for it (`model.train_function`, called once
    per step between the batch's begin and end): what is left of a step is Keras's own
    per-step work (its loop, logs, callbacks)."""

    def __init__(self) -> None:
        import keras

        outer = self

        class Callback(keras.callbacks.Callback):
            def on_train_begin(self, logs: object = None) -> None:
                fn = getattr(self.model, "train_function", None)
                if fn is None:
                    return

                def timed(*args: object, **kwargs: object) -> object:
                    t0 = time.time_ns()
                    try:
                        return fn(*args, **kwargs)
                    finally:
                        outer.calls.append((t0, time.time_ns()))

                self.model.train_function = timed

            def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
                outer.begins.append(time.time_ns())

            def on_train_batch_end(self, batch: int, logs: object = None) -> None:
                outer.ends.append(time.time_ns())

        self.begins: list[int] = []
        self.ends: list[int] = []
        self.calls: list[tuple[int, int]] = []
        self.callback = Callback()


def custom_loop(strategy: object, model: object, optimizer: object, ds: object, steps: int,
                global_batch: int, callbacks: list[object]) -> None:
    """A distributed tf.function step (strategy.run, GradientTape, apply_gradients) per batch;
    the callbacks see each step as fit's would."""
    import keras
    import tensorflow as tf

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)

    def replica_step(x: tf.Tensor, y: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            per_example = loss_fn(y, model(x, training=True))
            loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        return loss

    @tf.function
    def train_step(it: object) -> tf.Tensor:
        x, y = next(it)
        losses = strategy.run(replica_step, args=(x, y))
        return strategy.reduce("SUM", losses, axis=None)

    batches = iter(strategy.experimental_distribute_dataset(ds))
    for cb in callbacks:
        cb.set_model(model)
    for step in range(steps):
        for cb in callbacks:
            cb.on_train_batch_begin(step)
        train_step(batches)
        for cb in callbacks:
            cb.on_train_batch_end(step)


def profile_steps(logdir: str, first: int, last: int) -> object:
    """TensorFlow's profiler from step `first` to `last` (logdir/plugins/profile/RUN/)."""
    import keras
    import tensorflow as tf

    class Profile(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            if batch == first:
                tf.profiler.experimental.start(logdir)

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            if batch == last:
                tf.profiler.experimental.stop()

    return Profile()


def train(a: argparse.Namespace) -> None:
    if a.ports:
        os.environ["TF_CONFIG"] = tf_config(a.ports, a.worker_index)
    if a.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
    import keras
    import tensorflow as tf

    if a.threads:
        tf.config.threading.set_intra_op_parallelism_threads(a.threads)
        tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    gpus = tf.config.list_physical_devices("GPU")
    if a.device == "gpu" and not gpus:
        sys.exit("--device gpu: TensorFlow sees no GPU")
    if a.ports:
        comm = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=int(a.pack_mb * 2**20),
            implementation=tf.distribute.experimental.CommunicationImplementation.NCCL
            if gpus else tf.distribute.experimental.CommunicationImplementation.RING)
        strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
    else:
        strategy = tf.distribute.get_strategy()
    workers = strategy.num_replicas_in_sync if a.ports else 1
    size = a.image_size

    def make(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        g = tf.random.stateless_uniform([size, size, 3], seed=tf.stack([i, 0]))
        g = tf.image.stateless_random_flip_left_right(g, seed=tf.stack([i, 1]))
        g = tf.image.adjust_brightness(g, 0.1)
        return g, i % 10

    global_batch = a.batch_size * workers
    ds = (tf.data.Dataset.range(a.steps * global_batch * 2).map(make)
          .batch(global_batch, drop_remainder=True).prefetch(2))
    opts = tf.data.Options()
    opts.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    ds = ds.with_options(opts)
    with strategy.scope():
        layers = [keras.Input((size, size, 3)),
                  keras.layers.Conv2D(a.width, 3, activation="relu", padding="same"),
                  keras.layers.MaxPooling2D(),
                  keras.layers.Conv2D(2 * a.width, 3, activation="relu", padding="same"),
                  keras.layers.MaxPooling2D(),
                  keras.layers.Flatten()]
        layers += [keras.layers.Dense(a.fc_hidden, activation="relu")
                   for _ in range(a.fc_layers)]
        model = keras.Sequential([*layers, keras.layers.Dense(10)])
        optimizer = keras.optimizers.SGD(0.01, momentum=0.9)
        model.compile(optimizer=optimizer,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      steps_per_execution=a.steps_per_execution)
    times = StepTimes()
    callbacks = [times.callback]
    if a.profile_dir:
        logdir = a.profile_dir if a.ports is None else \
            os.path.join(a.profile_dir, f"worker{a.worker_index}")
        callbacks.append(profile_steps(logdir, 5, 9))
    t0 = time.perf_counter()
    if a.ports:
        # Keras 3.15's fit fails under MultiWorkerMirroredStrategy (keras-team/keras#20585):
        # the same model and optimizer in TensorFlow's custom loop for it
        custom_loop(strategy, model, optimizer, ds, a.steps, global_batch, callbacks)
    else:
        model.fit(ds, epochs=1, steps_per_epoch=a.steps, verbose=0, callbacks=callbacks)
    dt = time.perf_counter() - t0
    first = a.worker_index in (None, 0)
    if first:
        where = "GPU" if gpus else "CPU"
        print(f"{a.steps} steps of {global_batch} images on {workers} worker(s), {where}: "
              f"{a.steps * global_batch / dt:.0f} images/s")
    if a.times_json and first:
        with open(a.times_json, "w") as f:
            json.dump({"begin_ns": times.begins, "end_ns": times.ends,
                       "call_ns": times.calls, "parameters": model.count_params()}, f)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    a = parse_args(argv)
    if a.workers > 1 and a.ports is None:
        return launch(a, argv)
    train(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
