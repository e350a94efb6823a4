"""The top-level API: sorted, complete, and importable without TensorFlow."""

from __future__ import annotations

import subprocess
import sys
import types

import distserver as ds


def test_all_is_sorted_unique_and_resolvable():
    assert ds.__all__ == sorted(set(ds.__all__))
    for name in ds.__all__:
        assert hasattr(ds, name), name


def test_every_public_name_is_in_all():
    # Submodules become package attributes once imported; they are not API names.
    public = {
        name
        for name, value in vars(ds).items()
        if not name.startswith("_")
        and (not isinstance(value, types.ModuleType) or name in ("errors", "train"))
    }
    assert public == set(ds.__all__)


def test_core_names():
    for name in ("AsyncServer", "AsyncSession", "Server", "Session", "ClusterSpec", "Graph", "Variable"):
        assert name in ds.__all__


def test_the_protos_users_need_for_timeouts_are_top_level():
    options = ds.RunOptions(timeout_in_ms=2000)
    config = ds.ConfigProto(operation_timeout_in_ms=5000)
    assert (options.timeout_in_ms, config.operation_timeout_in_ms) == (2000, 5000)
    assert ds.RunMetadata().ByteSize() == 0


def test_import_does_not_import_tensorflow(python_env):
    code = "import sys, distserver; assert 'tensorflow' not in sys.modules; print('ok')"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=python_env, timeout=60
    )
    assert result.stdout.strip() == "ok", result.stderr
