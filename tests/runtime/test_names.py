"""Tensor names as a NodeDef writes them, and their canonical form ("node:k")."""

from __future__ import annotations

import pytest

from distserver.runtime.names import canonical_tensor_name, parse_input


@pytest.mark.parametrize(
    ("name", "canonical"),
    [
        ("x", "x:0"),
        ("x:0", "x:0"),
        ("x:10", "x:10"),
        ("x:01", "x:1"),  # (a leading zero is dropped)
        ("x:00", "x:0"),
        ("scope/a:b", "scope/a:b:0"),  # (":b" is part of the node's name)
        ("scope/a:b:3", "scope/a:b:3"),
        ("x:", "x::0"),
        ("x:\uff11", "x:1"),  # (a digit that is not ASCII, read as int() reads it)
        ("^x", "x:-1"),
    ],
)
def test_a_canonical_name_is_the_parsed_node_and_output(name, canonical):
    assert canonical_tensor_name(name) == canonical
    node, index, _ = parse_input(name)
    assert canonical == f"{node}:{index}"
