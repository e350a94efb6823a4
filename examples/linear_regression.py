"""Fit y = 3x - 2 with a variable that lives on a distserver server.

The gradient is computed in numpy from values fetched from the server and applied
on the server with `assign_sub`, so the model state never leaves the server.

    python examples/linear_regression.py                    # an in-process server
    python examples/linear_regression.py --target grpc://localhost:2222
"""

from __future__ import annotations

import argparse

import numpy as np

import distserver as ds


def fit(target: str, steps: int, learning_rate: float, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    xs = rng.uniform(-1, 1, size=(256, 1)).astype(np.float32)
    ys = (3.0 * xs - 2.0 + rng.normal(scale=0.05, size=xs.shape)).astype(np.float32)

    graph = ds.Graph()
    with graph.as_default():
        x = ds.placeholder(ds.float32, shape=[None, 1], name="x")
        y = ds.placeholder(ds.float32, shape=[None, 1], name="y")
        w = ds.Variable(np.zeros((1, 1), np.float32), name="linear/w")
        b = ds.Variable(np.zeros((1,), np.float32), name="linear/b")
        prediction = ds.matmul(x, w) + b
        error = prediction - y
        loss = ds.reduce_mean(ds.square(error))
        grad_w_in = ds.placeholder(ds.float32, shape=[1, 1], name="grad_w")
        grad_b_in = ds.placeholder(ds.float32, shape=[1], name="grad_b")
        apply = ds.group(w.assign_sub(grad_w_in * learning_rate), b.assign_sub(grad_b_in * learning_rate))

    with ds.Session(target, graph=graph) as session:
        session.run(ds.variables_initializer([w, b]))
        for step in range(steps):
            err, loss_value = session.run([error, loss], feed_dict={x: xs, y: ys})
            grad_w = (2.0 / len(xs)) * xs.T @ err
            grad_b = (2.0 / len(xs)) * err.sum(axis=0)
            session.run(apply, feed_dict={grad_w_in: grad_w, grad_b_in: grad_b})
            if step % 20 == 0 or step == steps - 1:
                print(f"step {step:3d}  loss {loss_value:.5f}")
        w_value, b_value, final = session.run(
            [w.read_value(), b.read_value(), loss], feed_dict={x: xs, y: ys}
        )
    print(f"w = {w_value.item():.3f} (true 3), b = {b_value.item():.3f} (true -2), final loss {final:.5f}")
    return float(final)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", help="a server's target; default: start one in this process")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--learning-rate", type=float, default=0.5)
    args = parser.parse_args()
    if args.target:
        fit(args.target, args.steps, args.learning_rate)
        return
    with ds.Server.create_local_server() as server:
        fit(server.target, args.steps, args.learning_rate)


if __name__ == "__main__":
    main()
