"""distserver's client against TensorFlow's server: a step that runs silently for long survives.

Our channels ping (HTTP/2 keepalive) while calls wait, to find hung distserver peers;
TensorFlow's servers end a connection that pings like that ("too many pings", at the
third ping of a silent call, ~15 s). A channel that finds a TensorFlow peer stops
pinging: this step blocks for 25 s on a queue of a TensorFlow server and must finish.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

import distserver as ds
from distserver.testing import free_ports

pytestmark = pytest.mark.slow

SERVER = """
import sys, tensorflow as tf
server = tf.distribute.Server({"worker": [f"localhost:{sys.argv[1]}"]}, "worker", 0)
print("serving", flush=True)
server.join()
"""


def test_a_long_silent_step_on_a_tensorflow_server_finishes(tf_client):
    (port,) = free_ports(1)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("GRPC_EXPERIMENTS", None)
    server = subprocess.Popen(
        [tf_client.python, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert server.stdout is not None
        assert server.stdout.readline().strip() == "serving"
        graph = ds.Graph()
        with graph.as_default():
            queue = ds.FIFOQueue(capacity=1, dtypes=[ds.float32], shared_name="later", name="later")
            take = queue.dequeue()
            put = queue.enqueue(ds.constant(7.0))
        target = f"grpc://localhost:{port}"
        with ds.Session(target, graph=graph) as waiting, ds.Session(target, graph=graph) as feeding:
            releaser = threading.Timer(25.0, feeding.run, args=(put,))
            releaser.start()
            started = time.monotonic()
            try:
                assert waiting.run(take) == 7.0
            finally:
                releaser.join()
            assert time.monotonic() - started >= 20
    finally:
        server.kill()
        server.wait(timeout=30)
        server.stdout.close()
