"""`distserver bench` and the measurement code the `benchmarks/` scripts share.

* `command`: the command's options, checks and output; `transfer`: the transfer
  workload (RecvTensor, fetch, concurrency by protocol), its table and plot.
* `sides`: the benchmark sides (a distserver cluster, TensorFlow, memcpy) and
  `measure`, which times them in interleaved blocks; `grpcio_baseline`: raw grpcio.
* `timing`: graphs, timing loop, /proc readers (standard library only: `tf_side`
  runs it under TensorFlow's Python); `tf_side`: TensorFlow's side, a script;
  `tfenv`: finding TensorFlow; `report`: cell formatting; `progress`: the progress bar.

Importing this package imports nothing else: the command stays fast to start.
"""
