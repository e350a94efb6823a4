"""A TensorFlow `tf.distribute.Server` for one task of a TF2 cluster (a worker, or a ps in the
all-TensorFlow baseline); prints "serving at <target>" once it serves, then serves until killed.

Argument (JSON): {"cluster": {job: [address, ...]}, "job": name, "task": index}
"""

from __future__ import annotations

import tensorflow as tf
from _common import args


def main() -> None:
    a = args()
    cluster = tf.train.ClusterSpec(a["cluster"])
    server_def = tf.train.ServerDef(
        cluster=cluster.as_cluster_def(), job_name=a["job"], task_index=a["task"], protocol="grpc"
    )
    server = tf.distribute.Server(server_def, start=True)
    print(f"serving at {server.target}", flush=True)
    server.join()


if __name__ == "__main__":
    main()
