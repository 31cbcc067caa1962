"""A TensorFlow training loop (Keras model, tf.GradientTape, the optimizer's apply_gradients
or apply) that times itself with perf_counter: the ground truth the TensorFlow tests compare
gputrace's analysis with.

    python tf_timed_loop.py OUT.json [--steps N] [--batch B] [--optimizers Adam,SGD,...]
                            [--tf-first] [--legacy] [--mode eager|function|strategy]
                            [--eval-every N --eval-batches B]

`--tf-first`: `import tensorflow as tf` before anything else, and Keras only as `tf.keras`
(how most TensorFlow code begins); `--legacy`: the optimizers and model of `tf_keras`
(Keras 2). One segment of `--steps` steps per optimizer, in order, the odd ones calling
`optimizer.apply(grads, vars)` (where the optimizer has it), the others `apply_gradients`.

`--mode eager` (default): per step the loop's own times (seconds; time.time_ns for
boundaries): `io` (the wait for the next batch of a tf.data pipeline whose map runs in the
loop's own thread), `forward` (the model and the loss under the tape, synced with
`.numpy()`), `backward` (`tape.gradient`, synced), `update` (the optimizer, synced), `other`
(a logging `.numpy()` and a sleep for the loop's bookkeeping). `function`: the step is one
`tf.function` (batch, tape, gradient, update); `strategy`: that function calls
`strategy.run` (a one-device MirroredStrategy) for the replica's step. A compiled step is
timed whole (`step`, its phases are inside the graph). Always `start`/`end`: iterations tile
the loop, the next one begins where this one ended; `segment`: the optimizer's index.

`--eval-every N`: after every N-th step (not after the last) a validation pass over B
batches of a tf.data pipeline of its own, `for x, y in val:` each batch the model called
with `training=False` (eagerly in `eager` mode, else in a `tf.function` of its own), its
result read; the loop's own clock around the pass (`OUT.evals.json`: `start`, `end` ns on
time.time_ns, `s` perf_counter seconds), and the next step begins after it (steps then tile
the loop but for the passes).
"""

from __future__ import annotations

import argparse
import importlib
import json
import time
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--optimizers", default="SGD")
    p.add_argument("--tf-first", action="store_true")
    p.add_argument("--legacy", action="store_true")
    p.add_argument("--mode", choices=("eager", "function", "strategy"), default="eager")
    p.add_argument("--eval-every", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=4)
    a = p.parse_args()
    if a.tf_first:
        import tensorflow as tf
        keras = tf.keras
    else:
        import keras
        import tensorflow as tf
    if a.legacy:   # Keras 2, as code written for TF_USE_LEGACY_KERAS has it
        keras = importlib.import_module("tf_keras")

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.random.set_seed(0)
    w = tf.random.stateless_normal([256, 256], seed=[1, 2])

    def decode(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        x = tf.random.stateless_normal([a.batch, 256], seed=tf.stack([i, 0]))
        for _ in range(40):                      # the batch's decoding: real work to wait for
            x = tf.tanh(tf.matmul(x, w))
        return x, tf.cast(i % 10, tf.int64) * tf.ones([a.batch], tf.int64)

    ds = tf.data.Dataset.range(100_000).map(decode)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"]) if a.mode == "strategy" else \
        tf.distribute.get_strategy()
    batches = iter(strategy.experimental_distribute_dataset(ds) if a.mode == "strategy"
                   else ds)
    val = tf.data.Dataset.range(1_000_000, 1_000_000 + a.eval_batches).map(decode)
    now = time.perf_counter
    steps: list[dict[str, float]] = []
    evals: list[dict[str, float]] = []

    def validate(forward: Any) -> int:
        t_start, t0 = time.time_ns(), now()
        for xv, _yv in val:
            forward(xv).numpy()
        evals.append({"start": t_start, "s": now() - t0, "end": time.time_ns()})
        return evals[-1]["end"]
    t_prev = time.time_ns()
    for seg, name in enumerate(a.optimizers.split(",")):
        with strategy.scope():
            model = keras.Sequential([keras.Input((256,)),
                                      keras.layers.Dense(1024, activation="relu"),
                                      keras.layers.Dense(1024, activation="relu"),
                                      keras.layers.Dense(10)])
            opt = getattr(keras.optimizers, name)(0.001)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        use_apply = seg % 2 == 1 and hasattr(opt, "apply") and not a.legacy

        def update(grads: list, opt=opt, model=model, use_apply=use_apply) -> None:
            if use_apply:
                opt.apply(grads, model.trainable_variables)
            else:
                opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))

        def replica(x: tf.Tensor, y: tf.Tensor, model=model, loss_fn=loss_fn,
                    update=update) -> tf.Tensor:
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            update(tape.gradient(loss, model.trainable_variables))
            return loss

        def infer(x: tf.Tensor, model=model) -> tf.Tensor:
            return model(x, training=False)

        forward = infer if a.mode == "eager" else tf.function(infer)

        @tf.function
        def compiled(it, replica=replica) -> tf.Tensor:
            x, y = next(it)
            if a.mode == "strategy":
                return strategy.reduce("SUM", strategy.run(replica, args=(x, y)), axis=None)
            return replica(x, y)

        for k in range(a.steps):
            if a.eval_every and k and k % a.eval_every == 0:
                t_prev = validate(forward)
            if a.mode != "eager":
                t0 = now()
                loss = compiled(batches)
                float(loss.numpy())
                t4 = now()
                time.sleep(0.002)                   # bookkeeping
                t5 = now()
                t_end = time.time_ns()
                steps.append({"step": t4 - t0, "other": t5 - t4, "start": t_prev,
                              "end": t_end, "segment": seg})
                t_prev = t_end
                continue
            t0 = now()
            x, y = next(batches)
            t1 = now()
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            loss.numpy()
            t2 = now()
            grads = tape.gradient(loss, model.trainable_variables)
            grads[-1].numpy()
            t3 = now()
            update(grads)
            opt.iterations.numpy()
            t4 = now()
            float(loss.numpy())                     # logging
            time.sleep(0.002)                       # bookkeeping
            t5 = now()
            t_end = time.time_ns()
            steps.append({"io": t1 - t0, "forward": t2 - t1, "backward": t3 - t2,
                          "update": t4 - t3, "other": t5 - t4, "start": t_prev, "end": t_end,
                          "segment": seg})
            t_prev = t_end
    with open(a.out, "w") as f:
        json.dump(steps, f)
    if a.eval_every:
        with open(a.out + ".evals.json", "w") as f:
            json.dump(evals, f)


if __name__ == "__main__":
    main()
