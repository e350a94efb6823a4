"""Build TensorFlow graphs without TensorFlow: a TF 1.x-shaped graph API.

`Graph`, `Tensor`, `Operation`, scopes (`name_scope`, `device`,
`control_dependencies`, `colocate_with`), op constructors with TensorFlow's names
(`constant`, `placeholder`, `matmul`, `reduce_sum`, ...), resource `Variable`s and
`replica_device_setter`; `gradients` (autodiff, `IndexedSlices` for gathers) and
`train` (TensorFlow's v1 optimizers). Graphs serialise (`Graph.as_graph_def`) to GraphDefs whose
nodes carry TensorFlow's op types and attrs, so a TensorFlow runtime can run them and
distserver's kernels run TensorFlow's.

Example::

    import distserver.graph as tf

    g = tf.Graph()
    with g.as_default(), tf.device(tf.replica_device_setter(ps_tasks=1)):
        w = tf.Variable([[1.0], [2.0]], name="w")
        x = tf.placeholder(tf.float32, shape=[None, 2], name="x")
        y = tf.reduce_sum(tf.matmul(x, w))
        init = tf.global_variables_initializer()
    graph_def = g.as_graph_def()

Dtypes are numpy dtypes; the names below (`float32`, `int64`, `string`, ...) are
provided for convenience, and anything numpy or TensorFlow calls a dtype is accepted.
"""

from typing import Final

import numpy as np

from distserver import tensors as _tensors
from distserver.graph import gradient_functions as _gradient_functions  # noqa: F401 - registers them
from distserver.graph import train
from distserver.graph.autodiff import IndexedSlices, NotDifferentiable, RegisterGradient, gradients
from distserver.graph.graph import (
    GRAPH_DEF_VERSION,
    Graph,
    GraphKeys,
    Operation,
    Shape,
    Tensor,
    add_to_collection,
    colocate_with,
    control_dependencies,
    device,
    get_collection,
    get_default_graph,
    name_scope,
    reset_default_graph,
)
from distserver.graph.ops import (
    abs,
    add,
    add_n,
    argmax,
    argmin,
    bias_add,
    cast,
    concat,
    constant,
    convert_to_tensor,
    divide,
    dynamic_partition,
    dynamic_stitch,
    embedding_lookup,
    equal,
    exp,
    expand_dims,
    fill,
    floordiv,
    floormod,
    gather,
    greater,
    greater_equal,
    group,
    identity,
    less,
    less_equal,
    log,
    log1p,
    log_softmax,
    logical_and,
    logical_not,
    logical_or,
    matmul,
    maximum,
    minimum,
    multiply,
    negative,
    no_op,
    not_equal,
    one_hot,
    ones,
    ones_like,
    placeholder,
    placeholder_with_default,
    pow,
    random_uniform,
    range,
    rank,
    reduce_all,
    reduce_any,
    reduce_max,
    reduce_mean,
    reduce_min,
    reduce_prod,
    reduce_sum,
    relu,
    reshape,
    select,
    shape,
    sigmoid,
    sigmoid_cross_entropy_with_logits,
    size,
    softmax,
    softmax_cross_entropy_with_logits,
    sparse_softmax_cross_entropy_with_logits,
    sqrt,
    square,
    squeeze,
    stack,
    stop_gradient,
    strided_slice,
    subtract,
    tanh,
    tile,
    transpose,
    truediv,
    where,
    zeros,
    zeros_like,
)
from distserver.graph.queues import FIFOQueue
from distserver.graph.variables import (
    STANDARD_PS_OPS,
    Variable,
    global_variables,
    global_variables_initializer,
    replica_device_setter,
    trainable_variables,
    variables_initializer,
)

float16: Final = np.dtype(np.float16)
bfloat16: Final = _tensors.as_numpy_dtype(_tensors.as_datatype("bfloat16"))
float32: Final = np.dtype(np.float32)
float64: Final = np.dtype(np.float64)
int8: Final = np.dtype(np.int8)
int16: Final = np.dtype(np.int16)
int32: Final = np.dtype(np.int32)
int64: Final = np.dtype(np.int64)
uint8: Final = np.dtype(np.uint8)
uint16: Final = np.dtype(np.uint16)
uint32: Final = np.dtype(np.uint32)
uint64: Final = np.dtype(np.uint64)
bool_: Final = np.dtype(np.bool_)
complex64: Final = np.dtype(np.complex64)
complex128: Final = np.dtype(np.complex128)
string: Final = np.dtype(object)
"""DT_STRING: numpy's object dtype (elements are `bytes`)."""

__all__ = [
    "GRAPH_DEF_VERSION",
    "STANDARD_PS_OPS",
    "FIFOQueue",
    "Graph",
    "GraphKeys",
    "IndexedSlices",
    "NotDifferentiable",
    "Operation",
    "RegisterGradient",
    "Shape",
    "Tensor",
    "Variable",
    "abs",
    "add",
    "add_n",
    "add_to_collection",
    "argmax",
    "argmin",
    "bfloat16",
    "bias_add",
    "bool_",
    "cast",
    "colocate_with",
    "complex64",
    "complex128",
    "concat",
    "constant",
    "control_dependencies",
    "convert_to_tensor",
    "device",
    "divide",
    "dynamic_partition",
    "dynamic_stitch",
    "embedding_lookup",
    "equal",
    "exp",
    "expand_dims",
    "fill",
    "float16",
    "float32",
    "float64",
    "floordiv",
    "floormod",
    "gather",
    "get_collection",
    "get_default_graph",
    "global_variables",
    "global_variables_initializer",
    "gradients",
    "greater",
    "greater_equal",
    "group",
    "identity",
    "int8",
    "int16",
    "int32",
    "int64",
    "less",
    "less_equal",
    "log",
    "log1p",
    "log_softmax",
    "logical_and",
    "logical_not",
    "logical_or",
    "matmul",
    "maximum",
    "minimum",
    "multiply",
    "name_scope",
    "negative",
    "no_op",
    "not_equal",
    "one_hot",
    "ones",
    "ones_like",
    "placeholder",
    "placeholder_with_default",
    "pow",
    "random_uniform",
    "range",
    "rank",
    "reduce_all",
    "reduce_any",
    "reduce_max",
    "reduce_mean",
    "reduce_min",
    "reduce_prod",
    "reduce_sum",
    "relu",
    "replica_device_setter",
    "reset_default_graph",
    "reshape",
    "select",
    "shape",
    "sigmoid",
    "sigmoid_cross_entropy_with_logits",
    "size",
    "softmax",
    "softmax_cross_entropy_with_logits",
    "sparse_softmax_cross_entropy_with_logits",
    "sqrt",
    "square",
    "squeeze",
    "stack",
    "stop_gradient",
    "strided_slice",
    "string",
    "subtract",
    "tanh",
    "tile",
    "train",
    "trainable_variables",
    "transpose",
    "truediv",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "variables_initializer",
    "where",
    "zeros",
    "zeros_like",
]
