"""Training steps, distserver side by side with TensorFlow (`distserver.bench.training`).

    DISTSERVER_TF_PYTHON=.tfenv/bin/python .venv/bin/python benchmarks/bench_training.py \
        [--workloads mlp,embedding,small] [--layouts cluster,one] [--runtimes grpc,grpc+verbs,tf]
        [--blocks 4] [--steps 15] [--warmup 10] [--tree NAME=PATH ...] [--profile DIR] [--json out.json]

Also `distserver bench --workload training`. See docs/benchmarks.md, "Training steps".
"""

from distserver.bench.training import main

if __name__ == "__main__":
    main()
