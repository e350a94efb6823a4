"""`ds.gradients` checked against finite differences, run by a real local server.

Every registered gradient function is exercised by at least one case below (a test
checks that), in float64 where the op allows it: the analytic gradient of
``sum(W * f(inputs))`` (W fixed random weights) must match central differences of
the same graph evaluated by the session.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import distserver as ds
from distserver import tensors
from distserver.graph import autodiff
from distserver.graph import ops as graph_ops
from distserver.protos.attr_value_pb2 import AttrValue

F64 = np.float64


@pytest.fixture(scope="module")
def server() -> Iterator[ds.Server]:
    with ds.Server.create_local_server() as server:
        yield server


def _raw(op_type: str, *inputs: ds.Tensor) -> ds.Tensor:
    # An op the graph API has no constructor for (its gradient is registered).
    graph = ds.get_default_graph()
    attrs = {"T": graph_ops._type_attr(inputs[0].datatype)}
    return graph.create_op(
        op_type, list(inputs), [inputs[0].dtype], attrs=attrs, shapes=[inputs[0].shape]
    ).outputs[0]


def _op(op_type: str, inputs: list[Any], outputs: int = 1, **attrs: Any) -> Any:
    """A raw op of a kernel we ship that the graph API has no constructor for.

    `attrs` values: dtypes (type attrs), bools, ints, floats; "T" defaults to the
    first input's dtype. Returns the output, or the list of outputs.
    """
    graph = ds.get_default_graph()
    tensors_ = [graph_ops.convert_to_tensor(v) for v in inputs]
    values: dict[str, AttrValue] = {"T": graph_ops._type_attr(tensors_[0].datatype)}
    for key, value in attrs.items():
        if isinstance(value, bool):
            values[key] = AttrValue(b=value)
        elif isinstance(value, int):
            values[key] = AttrValue(i=value)
        elif isinstance(value, float):
            values[key] = AttrValue(f=value)
        elif isinstance(value, str):
            values[key] = AttrValue(s=value.encode())
        elif isinstance(value, list):
            values[key] = AttrValue(list=AttrValue.ListValue(type=[graph_ops.as_datatype(v) for v in value]))
        else:
            values[key] = graph_ops._type_attr(graph_ops.as_datatype(value))
    out_type = attrs.get("T", tensors_[0].dtype)
    dtypes = [out_type if not isinstance(out_type, list) else out_type[0]] * outputs
    op = graph.create_op(op_type, tensors_, dtypes, attrs=values)
    return op.outputs[0] if outputs == 1 else op.outputs


def _conv(op_type: str, inputs: list[Any], padding: str, strides: list[int], **lists: list[int]) -> Any:
    graph = ds.get_default_graph()
    attrs = {
        "T": graph_ops._type_attr(inputs[0].datatype),
        "padding": AttrValue(s=padding.encode()),
        "strides": AttrValue(list=AttrValue.ListValue(i=strides)),
        "data_format": AttrValue(s=b"NHWC"),
        **{key: AttrValue(list=AttrValue.ListValue(i=value)) for key, value in lists.items()},
    }
    return graph.create_op(op_type, inputs, [inputs[0].dtype], attrs=attrs).outputs[0]


def _top_k(x: Any, k: int) -> Any:
    graph = ds.get_default_graph()
    attrs = {"T": graph_ops._type_attr(x.datatype), "sorted": AttrValue(b=True)}
    op = graph.create_op("TopKV2", [x, ds.constant(np.int32(k))], [x.dtype, ds.int32], attrs=attrs)
    return op.outputs[0]


def _i32(values: Any) -> Any:
    return np.array(values, dtype=np.int32)


@dataclass
class Case:
    """y = build(*inputs); inputs are placeholders fed with `values` (or variables)."""

    build: Callable[..., Any]
    values: list[np.ndarray]
    dynamic: bool = False  # placeholders of unknown shape: the gradients' dynamic paths
    variables: list[int] = field(default_factory=list)  # inputs that are Variables
    eps: float = 1e-6
    tolerance: float = 1e-6


def _rand(*shape: int, low: float = -1.0, high: float = 1.0, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed + 17 * len(shape) + sum(shape))
    return rng.uniform(low, high, size=shape).astype(F64)


def _away_from_zero(*shape: int, seed: int = 0) -> np.ndarray:
    values = _rand(*shape, seed=seed)
    return np.where(values >= 0, values + 0.2, values - 0.2)


def _distinct(*shape: int, seed: int = 0) -> np.ndarray:
    # Values far apart, so max/min/maximum pick the same element after a small nudge.
    count = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    return (rng.permutation(count) * 0.37 - count * 0.15).reshape(shape).astype(F64)


def _positive(*shape: int, seed: int = 0) -> np.ndarray:
    return _rand(*shape, low=0.5, high=2.0, seed=seed)


def _probabilities(*shape: int) -> np.ndarray:
    # Rows summing to 1: the kernel's gradient assumes labels are distributions, as TF's does.
    values = _positive(*shape)
    return values / values.sum(-1, keepdims=True)


def _strided_slice(x: ds.Tensor) -> list[ds.Tensor]:
    return [x[1:, ::-1], x[:, 1], x[..., None, 0]]


def _raw_add(x: ds.Tensor, y: ds.Tensor) -> ds.Tensor:
    graph = ds.get_default_graph()
    attrs = {"T": graph_ops._type_attr(x.datatype)}
    return graph.create_op("Add", [x, y], [x.dtype], attrs=attrs, shapes=[x.shape]).outputs[0]


CASES: dict[str, Case] = {
    # identities and casts
    "identity": Case(lambda x: ds.identity(x) * x, [_rand(2, 3)]),
    "snapshot": Case(lambda x: _raw("Snapshot", x) * x, [_rand(2, 3)]),
    "placeholder_with_default": Case(lambda x: ds.placeholder_with_default(x, [2, 3]) * 2.0, [_rand(2, 3)]),
    "cast": Case(
        lambda x: ds.cast(ds.cast(x, ds.float32) * 3.0, ds.float64),
        [_rand(2, 3)],
        eps=1e-2,
        tolerance=1e-4,
    ),
    "add_n": Case(lambda x, y: ds.add_n([x, x * y, y]), [_rand(2, 3), _rand(2, 3, seed=1)]),
    # element-wise
    "neg": Case(lambda x: -x * x, [_rand(2, 3)]),
    "abs": Case(lambda x: ds.abs(x), [_away_from_zero(2, 3)]),
    "square": Case(lambda x: ds.square(x), [_rand(2, 3)]),
    "sqrt": Case(lambda x: ds.sqrt(x), [_positive(2, 3)]),
    "rsqrt": Case(lambda x: _raw("Rsqrt", x), [_positive(2, 3)]),
    "reciprocal": Case(lambda x: _raw("Reciprocal", x), [_positive(2, 3)]),
    "tanh": Case(lambda x: ds.tanh(x), [_rand(2, 3)]),
    "sigmoid": Case(lambda x: ds.sigmoid(x), [_rand(2, 3)]),
    "exp": Case(lambda x: ds.exp(x), [_rand(2, 3)]),
    "log": Case(lambda x: ds.log(x), [_positive(2, 3)]),
    "relu": Case(lambda x: ds.relu(x), [_away_from_zero(2, 3)]),
    # binary, with broadcasting (static and dynamic shapes)
    "add": Case(lambda x, y: _raw_add(x, y), [_rand(2, 3), _rand(2, 3, seed=1)]),
    "add_v2 broadcast": Case(lambda x, y: x + y, [_rand(2, 3), _rand(3, seed=1)]),
    "add_v2 both broadcast": Case(lambda x, y: (x + y) * x, [_rand(2, 1), _rand(1, 3, seed=1)]),
    "add_v2 dynamic": Case(lambda x, y: (x + y) * y, [_rand(2, 3), _rand(1, 3, seed=1)], dynamic=True),
    "sub": Case(lambda x, y: x - y, [_rand(2, 3), _rand(1, seed=1)]),
    "sub dynamic": Case(lambda x, y: (x - y) * x, [_rand(2, 3), _rand(3, seed=1)], dynamic=True),
    "mul": Case(lambda x, y: x * y, [_rand(4, 3), _rand(3, seed=1)]),
    "mul scalar": Case(lambda x, y: x * y, [_rand(), _rand(2, 2, seed=1)]),
    "mul dynamic": Case(lambda x, y: x * y, [_rand(2, 1, 3), _rand(4, 1, seed=1)], dynamic=True),
    "real_div": Case(lambda x, y: x / y, [_rand(2, 3), _away_from_zero(3, seed=1)]),
    "floor_mod": Case(
        lambda x, y: ds.floormod(x, y),
        [np.array([[0.3, 1.6, -0.7], [2.3, -1.2, 0.45]]), np.array([0.7, 1.1, 0.9])],
    ),
    "pow": Case(lambda x, y: ds.pow(x, y), [_positive(2, 3), _rand(3, seed=1)]),
    "pow negative base": Case(lambda x: ds.pow(x, 2.0), [_away_from_zero(2, 3)]),
    "maximum": Case(lambda x, y: ds.maximum(x, y), [_distinct(2, 3), _distinct(3, seed=1)]),
    "minimum": Case(lambda x, y: ds.minimum(x, y), [_distinct(2, 3), _distinct(2, 3, seed=1)]),
    "select_v2": Case(
        lambda x, y: ds.where(np.array([True, False, True]), x, y),
        [_rand(2, 3), _rand(1, seed=1)],
    ),
    "select_v2 dynamic": Case(
        lambda x, y: ds.where(x > 0.0, x, y), [_away_from_zero(2, 3), _rand(2, 1, seed=1)], dynamic=True
    ),
    "matmul": Case(lambda a, b: ds.matmul(a, b), [_rand(2, 3), _rand(3, 4, seed=1)]),
    "matmul transpose_a": Case(
        lambda a, b: ds.matmul(a, b, transpose_a=True), [_rand(3, 2), _rand(3, 4, seed=1)]
    ),
    "matmul transpose_b": Case(
        lambda a, b: ds.matmul(a, b, transpose_b=True), [_rand(2, 3), _rand(4, 3, seed=1)]
    ),
    "matmul transpose both": Case(
        lambda a, b: ds.matmul(a, b, transpose_a=True, transpose_b=True), [_rand(3, 2), _rand(4, 3, seed=1)]
    ),
    "bias_add": Case(lambda x, b: ds.bias_add(x, b), [_rand(2, 2, 3), _rand(3, seed=1)]),
    # reductions
    "sum all": Case(lambda x: ds.reduce_sum(x * x), [_rand(2, 3)]),
    "sum axis": Case(lambda x: ds.reduce_sum(x * x, 1), [_rand(2, 3, 2)]),
    "sum keepdims": Case(lambda x: ds.reduce_sum(x * x, [0, 2], keepdims=True), [_rand(2, 3, 2)]),
    "sum dynamic": Case(lambda x: ds.reduce_sum(x * x, 1), [_rand(2, 3)], dynamic=True),
    "sum dynamic all": Case(lambda x: ds.reduce_sum(x * x), [_rand(2, 3)], dynamic=True),
    "mean": Case(lambda x: ds.reduce_mean(x * x, 0), [_rand(4, 3)]),
    "mean dynamic": Case(lambda x: ds.reduce_mean(x * x, -1, keepdims=True), [_rand(4, 3)], dynamic=True),
    "max": Case(lambda x: ds.reduce_max(x, 1), [_distinct(3, 4)]),
    "max dynamic": Case(lambda x: ds.reduce_max(x, 0), [_distinct(3, 4)], dynamic=True),
    "min": Case(lambda x: ds.reduce_min(x, [0, 1], keepdims=True), [_distinct(3, 4)]),
    "prod": Case(lambda x: ds.reduce_prod(x, 1), [_away_from_zero(2, 3)]),
    "prod all dynamic": Case(lambda x: ds.reduce_prod(x), [_away_from_zero(2, 3)], dynamic=True),
    # shapes and indexing
    "reshape": Case(lambda x: ds.reshape(x, [3, 2]) * np.arange(6.0).reshape(3, 2), [_rand(2, 3)]),
    "expand_dims": Case(lambda x: ds.expand_dims(x, 1) * x, [_rand(2, 3)]),
    "squeeze": Case(lambda x: ds.squeeze(x) * 2.0, [_rand(2, 1, 3)]),
    "transpose": Case(lambda x: ds.transpose(x, [2, 0, 1]) * x[0, 0, 0], [_rand(2, 3, 2)]),
    "tile": Case(lambda x: ds.tile(x, [2, 3]), [_rand(2, 3)]),
    "fill": Case(lambda x: ds.fill([2, 3], x) * np.arange(6.0).reshape(2, 3), [_rand()]),
    "concat": Case(lambda x, y: ds.concat([x, y, x], 1), [_rand(2, 3), _rand(2, 1, seed=1)]),
    "concat dynamic": Case(
        lambda x, y: ds.concat([x, y], -1), [_rand(2, 3), _rand(2, 2, seed=1)], dynamic=True
    ),
    "stack": Case(lambda x, y: ds.stack([x, y, x], axis=1), [_rand(2, 3), _rand(2, 3, seed=1)]),
    "strided_slice": Case(_strided_slice, [_rand(3, 4)]),
    "gather": Case(lambda x: ds.gather(x, [2, 0, 2]) * x[0], [_rand(3, 4)]),
    "gather axis 1": Case(lambda x: ds.gather(x, [[1, 1], [2, 0]], axis=1), [_rand(2, 3, 2)]),
    "gather dynamic": Case(lambda x: ds.gather(x, [1, 1]), [_rand(3, 2)], dynamic=True),
    # variables
    "read variable": Case(
        lambda v, x: ds.matmul(x, v) * v[0], [_rand(3, 3), _rand(2, 3, seed=1)], variables=[0]
    ),
    "resource gather": Case(lambda v: ds.gather(v, [3, 0, 3]) * 2.0, [_rand(4, 3)], variables=[0]),
    # neural networks
    "softmax": Case(lambda x: ds.softmax(x), [_rand(2, 4)]),
    "log_softmax": Case(lambda x: ds.log_softmax(x), [_rand(2, 4)]),
    "softmax_cross_entropy": Case(
        lambda labels, logits: ds.softmax_cross_entropy_with_logits(labels=labels, logits=logits),
        [_probabilities(3, 4), _rand(3, 4, seed=1)],
    ),
    "sparse_softmax_cross_entropy": Case(
        lambda x: ds.sparse_softmax_cross_entropy_with_logits(labels=[1, 0, 3], logits=x), [_rand(3, 4)]
    ),
    # kernels we ship without a graph-API constructor (raw ops)
    "relu6": Case(lambda x: _op("Relu6", [x * 4.0]), [_away_from_zero(2, 3)]),
    "elu": Case(lambda x: _op("Elu", [x]), [_away_from_zero(2, 3)]),
    "selu": Case(lambda x: _op("Selu", [x]), [_away_from_zero(2, 3)]),
    "softplus": Case(lambda x: _op("Softplus", [x]), [_rand(2, 3)]),
    "softsign": Case(lambda x: _op("Softsign", [x]), [_rand(2, 3)]),
    "leaky_relu": Case(lambda x: _op("LeakyRelu", [x], alpha=0.3), [_away_from_zero(2, 3)]),
    "l2_loss": Case(lambda x: _op("L2Loss", [x]), [_rand(2, 3)]),
    "log1p": Case(lambda x: _op("Log1p", [x]), [_positive(2, 3)]),
    "expm1": Case(lambda x: _op("Expm1", [x]), [_rand(2, 3)]),
    "squared_difference": Case(
        lambda x, y: _op("SquaredDifference", [x, y]), [_rand(2, 3), _rand(3, seed=1)]
    ),
    "div": Case(lambda x, y: _op("Div", [x, y]), [_rand(2, 3), _away_from_zero(3, seed=1)]),
    "div_no_nan": Case(lambda x, y: _op("DivNoNan", [x, y]), [_rand(2, 3), _away_from_zero(2, 3, seed=1)]),
    "mul_no_nan": Case(lambda x, y: _op("MulNoNan", [x, y]), [_rand(2, 3), _rand(1, 3, seed=1)]),
    "bias_add_v1": Case(lambda x, b: _op("BiasAddV1", [x, b]), [_rand(2, 3), _rand(3, seed=1)]),
    "identity_n": Case(
        lambda x, y: _op("IdentityN", [x, y], outputs=2, T=[ds.float64, ds.float64]),
        [_rand(2, 3), _rand(2, 3, seed=1)],
    ),
    "unpack": Case(lambda x: _op("Unpack", [x], outputs=3, num=3, axis=1), [_rand(2, 3)]),
    "split": Case(lambda x: _op("Split", [_i32(1), x], outputs=2, T=ds.float64, num_split=2), [_rand(2, 4)]),
    "split_v": Case(
        lambda x: _op("SplitV", [x, _i32([1, 2]), _i32(1)], outputs=2, Tlen=ds.int32, num_split=2),
        [_rand(2, 3)],
    ),
    "slice": Case(lambda x: _op("Slice", [x, _i32([0, 1]), _i32([2, 2])], Index=ds.int32), [_rand(3, 4)]),
    "pad": Case(lambda x: _op("Pad", [x, _i32([[1, 0], [0, 2]])], Tpaddings=ds.int32), [_rand(2, 3)]),
    "pad_v2": Case(
        lambda x: _op("PadV2", [x, _i32([[0, 1], [2, 0]]), np.float64(0.5)], Tpaddings=ds.int32),
        [_rand(2, 3)],
    ),
    "reverse_v2": Case(lambda x: _op("ReverseV2", [x, _i32([1])], Tidx=ds.int32) * x, [_rand(2, 3)]),
    "broadcast_to": Case(lambda x: _op("BroadcastTo", [x, _i32([2, 3, 3])], Tidx=ds.int32), [_rand(3, 1)]),
    "cumsum": Case(lambda x: _op("Cumsum", [x, _i32(1)], Tidx=ds.int32), [_rand(2, 4)]),
    "cumsum exclusive reverse": Case(
        lambda x: _op("Cumsum", [x, _i32(0)], Tidx=ds.int32, exclusive=True, reverse=True), [_rand(3, 2)]
    ),
    "select": Case(
        lambda x, y: _op("Select", [np.array([True, False]), x, y], T=ds.float64),
        [_rand(2, 3), _rand(2, 3, seed=1)],
    ),
    "gather v1": Case(
        lambda x: _op(
            "Gather", [x, _i32([2, 0, 2])], Tparams=ds.float64, Tindices=ds.int32, validate_indices=True
        ),
        [_rand(3, 2)],
    ),
    "conv2d": Case(
        lambda x, k: _conv("Conv2D", [x, k], "SAME", [1, 2, 1, 1]), [_rand(1, 4, 3, 2), _rand(3, 2, 2, 3)]
    ),
    "conv2d valid dilated": Case(
        lambda x, k: _conv("Conv2D", [x, k], "VALID", [1, 1, 1, 1], dilations=[1, 2, 1, 1]),
        [_rand(2, 5, 4, 1), _rand(2, 2, 1, 2, seed=1)],
    ),
    "max_pool": Case(
        lambda x: _conv("MaxPool", [x], "VALID", [1, 2, 2, 1], ksize=[1, 2, 2, 1]), [_distinct(1, 4, 4, 2)]
    ),
    "avg_pool": Case(
        lambda x: _conv("AvgPool", [x], "SAME", [1, 2, 2, 1], ksize=[1, 3, 3, 1]), [_rand(1, 5, 4, 2)]
    ),
    "cumprod": Case(lambda x: _op("Cumprod", [x, _i32(1)], Tidx=ds.int32), [_away_from_zero(2, 4)]),
    "cumprod exclusive reverse": Case(
        lambda x: _op("Cumprod", [x, _i32(0)], Tidx=ds.int32, exclusive=True, reverse=True),
        [_away_from_zero(3, 2)],
    ),
    "dynamic_stitch": Case(
        lambda x, y: _op("DynamicStitch", [_i32([0, 5]), _i32([[1, 3], [2, 4]]), x, y], N=2, T=ds.float64),
        [_rand(2, 3), _rand(2, 2, 3, seed=1)],
    ),
    "parallel_dynamic_stitch": Case(
        lambda x, y: _op("ParallelDynamicStitch", [_i32([1]), _i32([0, 2]), x, y], N=2, T=ds.float64),
        [_rand(1, 2), _rand(2, 2, seed=1)],
    ),
    "dynamic_partition": Case(
        lambda x: _op("DynamicPartition", [x, _i32([1, 0, 1, 2])], outputs=3, num_partitions=3),
        [_rand(4, 2)],
    ),
    "mirror_pad": Case(
        lambda x: _op("MirrorPad", [x, _i32([[1, 1], [0, 2]])], Tpaddings=ds.int32, mode="REFLECT"),
        [_rand(3, 4)],
    ),
    "unsorted_segment_max": Case(
        lambda x: _op(
            "UnsortedSegmentMax", [x, _i32([1, 0, -1, 1]), _i32(2)], Tindices=ds.int32, Tnumsegments=ds.int32
        ),
        [_distinct(4, 2)],
    ),
    "unsorted_segment_min": Case(
        lambda x: _op(
            "UnsortedSegmentMin",
            [x, _i32([[0, 1], [1, 0]]), _i32(2)],
            Tindices=ds.int32,
            Tnumsegments=ds.int32,
        ),
        [_distinct(2, 2, 3)],
    ),
    "unsorted_segment_prod": Case(
        lambda x: _op(
            "UnsortedSegmentProd",
            [x, _i32([1, 0, -1, 1, 1]), _i32(2)],
            Tindices=ds.int32,
            Tnumsegments=ds.int32,
        ),
        [np.array([[0.5, 0.0], [1.5, -2.0], [3.0, 1.0], [0.0, 0.7], [-1.2, 0.9]])],
    ),
    "top_k": Case(lambda x: _top_k(x, 2), [_distinct(2, 3, 4)]),
    "unsorted_segment_sum": Case(
        lambda x: _op(
            "UnsortedSegmentSum", [x, _i32([0, 2, -1, 0]), _i32(3)], Tindices=ds.int32, Tnumsegments=ds.int32
        ),
        [_rand(4, 2)],
    ),
}


def _build(case: Case) -> tuple[ds.Graph, list[Any], list[ds.Tensor], list[ds.Tensor | None], Any]:
    """The graph of one case: inputs, the assign feeds of variable inputs, the scalar loss."""
    graph = ds.Graph()
    with graph.as_default():
        inputs: list[Any] = []
        assigns: list[Any] = []
        for i, value in enumerate(case.values):
            if i in case.variables:
                variable = ds.Variable(value, name=f"v{i}")
                fed = ds.placeholder(ds.float64, value.shape, name=f"assign{i}")
                inputs.append(variable)
                assigns.append((fed, variable.assign(fed, read_value=False)))
            else:
                shape = None if case.dynamic else value.shape
                inputs.append(ds.placeholder(ds.float64, shape, name=f"x{i}"))
                assigns.append(None)
        outputs = case.build(*inputs)
        outputs = outputs if isinstance(outputs, list) else [outputs]
        weighted = []
        for output in outputs:
            # Fixed weights 0.5, 0.8, 1.1, ... shaped like the output (known when it runs).
            count = ds.cast(ds.range(ds.size(output)), output.dtype)
            weights = ds.reshape(0.5 + 0.3 * count, ds.shape(output))
            weighted.append(ds.reduce_sum(output * weights))
        loss = ds.add_n(weighted) if len(weighted) > 1 else weighted[0]
        grads = ds.gradients(loss, inputs)
        init = ds.global_variables_initializer()
    return graph, inputs, assigns, grads, (loss, init)


class _Evaluator:
    def __init__(self, session: ds.Session, case: Case, inputs: list[Any], assigns: list[Any], loss: Any):
        self.session, self.case, self.inputs, self.assigns, self.loss = session, case, inputs, assigns, loss

    def feeds(self, values: list[np.ndarray]) -> dict[Any, np.ndarray]:
        feeds = {}
        for tensor, assign, value in zip(self.inputs, self.assigns, values, strict=True):
            if assign is None:
                feeds[tensor] = value
            else:
                fed, op = assign
                self.session.run(op, {fed: value})
        return feeds

    def loss_at(self, values: list[np.ndarray]) -> float:
        return float(self.session.run(self.loss, self.feeds(values)))

    def numeric(self, index: int) -> np.ndarray:
        values = [v.copy() for v in self.case.values]
        result = np.zeros_like(values[index])
        flat = values[index].reshape(-1)
        for k in range(flat.size):
            original = flat[k]
            flat[k] = original + self.case.eps
            up = self.loss_at(values)
            flat[k] = original - self.case.eps
            down = self.loss_at(values)
            flat[k] = original
            result.reshape(-1)[k] = (up - down) / (2 * self.case.eps)
        return result


def _dense(value: Any, shape: tuple[int, ...]) -> np.ndarray:
    if isinstance(value, tuple):  # fetched IndexedSlices: (values, indices, dense_shape)
        values, indices, dense_shape = value
        assert tuple(dense_shape) == shape
        dense = np.zeros(shape)
        np.add.at(dense, indices, values)
        return dense
    return np.asarray(value)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gradient_matches_finite_differences(server, name):
    case = CASES[name]
    graph, inputs, assigns, grads, (loss, init) = _build(case)
    fetches = [
        (g.values, g.indices, g.dense_shape) if isinstance(g, ds.IndexedSlices) else g
        for g in grads
        if g is not None
    ]
    assert len(fetches) == len(grads), f"an input got no gradient: {grads}"
    with ds.Session(server.target, graph=graph) as session:
        session.run(init)
        evaluator = _Evaluator(session, case, inputs, assigns, loss)
        analytic = session.run(fetches, evaluator.feeds(case.values))
        for index, value in enumerate(case.values):
            expected = evaluator.numeric(index)
            np.testing.assert_allclose(
                _dense(analytic[index], value.shape),
                expected,
                rtol=case.tolerance,
                atol=case.tolerance,
                err_msg=f"gradient of input {index}",
            )


def _gradient_op_types(case: Case) -> set[str]:
    graph, *_ = _build(case)
    return {op.type for op in graph.get_operations() if not op.name.startswith("gradients")}


def test_every_registered_gradient_is_checked():
    registered = {op_type for op_type, function in autodiff._REGISTRY.items() if function is not None}
    covered: set[str] = set()
    for case in CASES.values():
        covered |= _gradient_op_types(case)
    assert registered - covered == set()


def test_sparse_gradients_of_gathers_are_indexed_slices():
    with ds.Graph().as_default():
        v = ds.Variable(np.ones((5, 2)), name="v")
        x = ds.placeholder(ds.float64, [5, 2])
        (grad_v,) = ds.gradients(ds.reduce_sum(ds.gather(v, [1, 3])), [v])
        (grad_x,) = ds.gradients(ds.reduce_sum(ds.gather(x, [1, 3])), [x])
        # Two gathers: the slices are concatenated; with a dense path too they are summed densely.
        (both,) = ds.gradients(ds.reduce_sum(ds.gather(v, [0])) + ds.reduce_sum(ds.gather(v, [4])), [v])
        (mixed,) = ds.gradients(ds.reduce_sum(ds.gather(v, [0])) + ds.reduce_sum(v * 2.0), [v])
    assert isinstance(grad_v, ds.IndexedSlices)
    assert isinstance(grad_x, ds.IndexedSlices)
    assert grad_v.values.op.type == "Reshape"
    assert grad_v.indices.shape == (2,)
    assert isinstance(both, ds.IndexedSlices)
    assert both.values.op.type == "ConcatV2"
    assert isinstance(mixed, ds.Tensor)
    assert mixed.op.type == "AddN"
    assert {op.type for op in mixed.op.inputs[0].op.graph.get_operations()} >= {"UnsortedSegmentSum"}


def test_unconnected_stopped_and_integer_paths_give_none(server):
    g = ds.Graph()
    with g.as_default():
        x = ds.placeholder(ds.float64, [3], name="x")
        z = ds.placeholder(ds.float64, [3], name="z")
        k = ds.placeholder(ds.int32, [3], name="k")
        y = ds.reduce_sum(x * ds.stop_gradient(x * 3.0) + ds.cast(k, ds.float64))
        grad_x, grad_z, grad_k = ds.gradients(y, [x, z, k])
        (only_stopped,) = ds.gradients(ds.reduce_sum(ds.stop_gradient(x)), [x])
    assert grad_z is None
    assert grad_k is None
    assert only_stopped is None
    with ds.Session(server.target, graph=g) as session:
        value = np.array([1.0, 2.0, 3.0])
        np.testing.assert_allclose(session.run(grad_x, {x: value, k: [1, 2, 3]}), 3.0 * value)


def test_paths_are_summed_with_add_n_and_grad_ys_scale(server):
    g = ds.Graph()
    with g.as_default():
        x = ds.placeholder(ds.float64, [2], name="x")
        y = x * x + ds.exp(x)
        (grad,) = ds.gradients(y, x)
        (scaled,) = ds.gradients([y, 2.0 * x], [x], grad_ys=[np.array([1.0, 10.0]), None])
    assert grad.op.type == "AddN"
    with ds.Session(server.target, graph=g) as session:
        value = np.array([0.5, -1.0])
        np.testing.assert_allclose(session.run(grad, {x: value}), 2 * value + np.exp(value))
        np.testing.assert_allclose(
            session.run(scaled, {x: value}), (2 * value + np.exp(value)) * [1.0, 10.0] + 2.0
        )


def test_gradient_graphs_use_tensorflows_ops_and_names():
    # Shapes of TensorFlow 2.21's tf.compat.v1.gradients graphs (checked by dumping them).
    g = ds.Graph()
    with g.as_default():
        x = ds.placeholder(ds.float32, [2, 3], name="x")
        w = ds.placeholder(ds.float32, [3], name="w")
        ds.gradients(ds.reduce_sum(x * w + x), [x, w])
    nodes = {n.name: (n.op, list(n.input)) for n in g.as_graph_def().node if n.name.startswith("gradients")}
    assert nodes["gradients/grad_ys_0"] == ("Fill", ["gradients/Shape", "gradients/grad_ys_0/Const"])
    assert nodes["gradients/Sum_grad/Tile"][0] == "Tile"
    assert nodes["gradients/mul_grad/Mul"] == ("Mul", ["gradients/Sum_grad/Tile", "w"])
    assert nodes["gradients/mul_grad/Mul_1"] == ("Mul", ["x", "gradients/Sum_grad/Tile"])
    assert nodes["gradients/mul_grad/Sum"][0] == "Sum"
    assert nodes["gradients/AddN"] == ("AddN", ["gradients/Sum_grad/Tile", "gradients/mul_grad/Mul"])
    assert g.get_operation_by_name("gradients/AddN").get_attr("_class") == [b"loc:@gradients/Sum_grad/Tile"]


def test_gated_gradients_and_matmul_attrs():
    g = ds.Graph()
    with g.as_default():
        a = ds.placeholder(ds.float32, [4, 3], name="a")
        b = ds.placeholder(ds.float32, [3, 2], name="b")
        ds.gradients(ds.reduce_sum(ds.matmul(a, b)), [a, b], gate_gradients=True)
    grad_a = g.get_operation_by_name("gradients/MatMul_grad/MatMul")
    grad_b = g.get_operation_by_name("gradients/MatMul_grad/MatMul_1")
    assert (grad_a.get_attr("grad_a"), grad_a.get_attr("transpose_b")) == (True, True)
    assert (grad_b.get_attr("grad_b"), grad_b.get_attr("transpose_a")) == (True, True)
    gate = g.get_operation_by_name("gradients/MatMul_grad/tuple/group_deps")
    assert gate.type == "NoOp"
    gated = g.get_operation_by_name("gradients/MatMul_grad/tuple/control_dependency")
    assert gated.type == "Identity"
    assert gated.control_inputs == (gate,)


def test_errors():
    with ds.Graph().as_default():
        x = ds.placeholder(ds.float64, [3], name="x")
        mirror_pad_grad = _op("MirrorPadGrad", [x, _i32([[1, 0]])], Tpaddings=ds.int32, mode="REFLECT")
        with pytest.raises(
            LookupError, match=r"No gradient defined for operation 'MirrorPadGrad' \(op type: MirrorPadGrad\)"
        ):
            ds.gradients(ds.reduce_sum(mirror_pad_grad), [x])
        with pytest.raises(ValueError, match="Passed 2 grad_ys for 1 ys"):
            ds.gradients(x, [x], grad_ys=[x, x])
        with pytest.raises(TypeError, match="xs must be tensors or variables"):
            ds.gradients(x, [ds.no_op()])
    with pytest.raises(KeyError, match="Registering two gradient with name 'MatMul'"):
        ds.RegisterGradient("MatMul")(lambda op, grad: [grad, grad])


def test_stop_gradients_argument_and_gradient_of_x_itself(server):
    g = ds.Graph()
    with g.as_default():
        a = ds.placeholder(ds.float64, [2], name="a")
        b = a * 2.0
        y = ds.reduce_sum(a * b)
        (through_b,) = ds.gradients(y, a)
        (b_constant,) = ds.gradients(y, a, stop_gradients=[b])
        (itself,) = ds.gradients(a, a)
    with ds.Session(server.target, graph=g) as session:
        value = np.array([1.0, -3.0])
        np.testing.assert_allclose(session.run(through_b, {a: value}), 4.0 * value)
        np.testing.assert_allclose(session.run(b_constant, {a: value}), 2.0 * value)
        np.testing.assert_allclose(session.run(itself, {a: value}), [1.0, 1.0])


def test_colocate_gradients_with_ops():
    with ds.Graph().as_default() as g:
        x = ds.placeholder(ds.float32, [2, 2], name="x")
        with ds.device("/job:worker/task:1"):
            y = ds.tanh(x)
        (plain,) = ds.gradients(ds.reduce_sum(y), x)
        (colocated,) = ds.gradients(ds.reduce_sum(y), x, colocate_gradients_with_ops=True)
    assert plain.op.type == colocated.op.type == "TanhGrad"
    assert plain.device == ""
    assert colocated.device == "/job:worker/task:1"
    assert colocated.op.get_attr("_class") == [b"loc:@Tanh"]
    assert g.get_operation_by_name("gradients_1/Tanh_grad/TanhGrad") is colocated.op


def test_gradients_flow_through_a_reference_variable(server):
    # A TF 1.x VariableV2 used directly by its consumers (no ReadVariableOp): the
    # gradient with respect to its ref output is that of any tensor.
    g = ds.Graph()
    with g.as_default():
        attrs = {
            "dtype": graph_ops._type_attr(graph_ops.as_datatype(ds.float64)),
            "shape": AttrValue(shape=tensors.shape_to_proto((2,))),
            "container": AttrValue(s=b""),
            "shared_name": AttrValue(s=b""),
        }
        ref = g.create_op("VariableV2", [], [ds.float64], name="ref", attrs=attrs, shapes=[(2,)]).outputs[0]
        assign_attrs = {
            "T": graph_ops._type_attr(graph_ops.as_datatype(ds.float64)),
            "use_locking": AttrValue(b=True),
            "validate_shape": AttrValue(b=True),
        }
        init = g.create_op(
            "Assign", [ref, ds.constant([1.0, 2.0], dtype=ds.float64)], [ds.float64], attrs=assign_attrs
        )
        (grad,) = ds.gradients(ds.reduce_sum(ds.identity(ref) * ref), [ref])
    with ds.Session(server.target, graph=g) as session:
        session.run(init)
        np.testing.assert_allclose(session.run(grad), [2.0, 4.0])
