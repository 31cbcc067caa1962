"""An eager TensorFlow training loop (Keras model, tf.GradientTape, the optimizer's
apply_gradients) that times itself with perf_counter: the ground truth the TensorFlow tests
compare gputrace's analysis with.

    python tf_timed_loop.py OUT.json [--steps N] [--batch B]

Per step it writes the loop's own times (seconds; time.time_ns for boundaries): `io` (the
wait for the next batch of a tf.data pipeline whose map runs in the loop's own thread),
`forward` (the model and the loss under the tape, synced with `.numpy()`), `backward`
(`tape.gradient`, synced), `update` (`apply_gradients`, synced), `other` (a logging
`.numpy()` and a sleep for the loop's bookkeeping), and `start`/`end`: iterations tile the
loop, the next one begins where this one ended.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--batch", type=int, default=64)
    a = p.parse_args()
    import keras
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    keras.utils.set_random_seed(0)
    w = tf.random.stateless_normal([256, 256], seed=[1, 2])

    def decode(i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        x = tf.random.stateless_normal([a.batch, 256], seed=tf.stack([i, 0]))
        for _ in range(40):                      # the batch's decoding: real work to wait for
            x = tf.tanh(tf.matmul(x, w))
        return x, tf.cast(i % 10, tf.int64) * tf.ones([a.batch], tf.int64)

    batches = iter(tf.data.Dataset.range(10_000).map(decode))
    model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(1024, activation="relu"),
                              keras.layers.Dense(10)])
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = keras.optimizers.SGD(0.01, momentum=0.9)
    now = time.perf_counter
    steps: list[dict[str, float]] = []
    t_prev = time.time_ns()
    for _ in range(a.steps):
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
        opt.apply_gradients(zip(grads, model.trainable_variables, strict=True))
        opt.iterations.numpy()
        t4 = now()
        float(loss.numpy())                     # logging
        time.sleep(0.002)                       # bookkeeping
        t5 = now()
        t_end = time.time_ns()
        steps.append({"io": t1 - t0, "forward": t2 - t1, "backward": t3 - t2,
                      "update": t4 - t3, "other": t5 - t4, "start": t_prev, "end": t_end})
        t_prev = t_end
    with open(a.out, "w") as f:
        json.dump(steps, f)


if __name__ == "__main__":
    main()
