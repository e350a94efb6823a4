"""Switch, Merge and dead tensors in the executor, in-process (across tasks: test_distributed.py)."""

from __future__ import annotations

import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.graph.graph import as_datatype
from distserver.protos.attr_value_pb2 import AttrValue


def switch(data: ds.Tensor, pred: ds.Tensor) -> tuple[ds.Tensor, ds.Tensor]:
    graph = data.graph
    attrs = {"T": AttrValue(type=as_datatype(data.dtype))}
    op = graph.create_op("Switch", [data, pred], [data.dtype, data.dtype], attrs=attrs)
    return op.outputs[0], op.outputs[1]


def merge(*values: ds.Tensor) -> tuple[ds.Tensor, ds.Tensor]:
    graph = values[0].graph
    attrs = {"T": AttrValue(type=as_datatype(values[0].dtype)), "N": AttrValue(i=len(values))}
    op = graph.create_op("Merge", list(values), [values[0].dtype, ds.int32], attrs=attrs)
    return op.outputs[0], op.outputs[1]


def test_merge_takes_the_branch_the_predicate_names():
    with ds.Graph().as_default() as graph:
        pred = ds.placeholder(ds.bool_, shape=[], name="pred")
        x = ds.placeholder(ds.float32, shape=[3], name="x")
        when_false, when_true = switch(x, pred)
        # The untaken branch must not run: this reshape would fail on a 3-vector.
        broken = ds.reshape(when_false * 2.0, [7])
        value, index = merge(ds.reshape(broken, [7])[:3], when_true + 100.0)
    with ds.Session(graph=graph) as run:
        got, which = run.run([value, index], {pred: True, x: [1, 2, 3]})
        np.testing.assert_array_equal(got, [101, 102, 103])
        assert which == 1
        with pytest.raises(errors.InvalidArgumentError, match="reshape"):
            run.run(value, {pred: False, x: [1, 2, 3]})


def test_a_dead_node_makes_its_control_dependents_dead_but_not_a_control_trigger():
    with ds.Graph().as_default() as graph:
        pred = ds.placeholder(ds.bool_, shape=[], name="pred")
        x = ds.placeholder(ds.float32, shape=[2], name="x")
        when_false, _ = switch(x, pred)
        on_dead_branch = ds.identity(when_false, name="on_dead_branch")
        with ds.control_dependencies([on_dead_branch]):
            dependent = ds.identity(x, name="dependent")
            trigger = graph.create_op("ControlTrigger", [], [], name="trigger")
        with ds.control_dependencies([trigger]):
            after_trigger = ds.identity(x, name="after_trigger")
    with ds.Session(graph=graph) as run:
        feeds = {pred: True, x: [5, 6]}
        np.testing.assert_array_equal(run.run(after_trigger, feeds), [5, 6])
        with pytest.raises(errors.InvalidArgumentError, match="dependent:0 was not valid"):
            run.run(dependent, feeds)
        np.testing.assert_array_equal(run.run(dependent, {pred: False, x: [5, 6]}), [5, 6])


def test_a_predicate_that_is_not_a_scalar_is_refused():
    with ds.Graph().as_default() as graph:
        pred = ds.placeholder(ds.bool_, shape=[2], name="pred")
        x = ds.constant([1.0, 2.0])
        _, when_true = switch(x, pred)
    with ds.Session(graph=graph) as run, pytest.raises(errors.InvalidArgumentError, match="must be a scalar"):
        run.run(when_true, {pred: [True, False]})
