"""The blocking, TF-compatible Server: threads, signals, interpreter exit."""

from __future__ import annotations

import asyncio
import inspect
import signal
import subprocess
import sys
import threading
import time

import pytest

import distserver as ds
from distserver import errors, facade


def test_create_local_server_target_and_stop():
    server = ds.Server.create_local_server()
    try:
        assert server.target.startswith("grpc://localhost:")
        assert int(server.target.rsplit(":", 1)[1]) > 0
        assert server.server_def.job_name == "localhost"
        assert server.server_def.protocol == "grpc"
    finally:
        server.stop()


def test_one_liner_from_the_issue_exits_promptly(python_env):
    code = "import distserver as ds; s = ds.Server.create_local_server(); print(s.target); s.stop()"
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=python_env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("grpc://localhost:")
    assert time.monotonic() - started < 30


def test_a_running_server_does_not_keep_the_interpreter_alive(python_env):
    code = "import distserver as ds; s = ds.Server.create_local_server(); print(s.target, flush=True)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=python_env
    )
    assert result.returncode == 0, result.stderr
    assert "grpc://localhost:" in result.stdout


@pytest.mark.parametrize("close", [True, False])
def test_an_in_process_session_exits_without_a_word(python_env, close):
    # A TF 1.x script's `Session("")`, closed or not: its implicit server is stopped at
    # exit with the loop thread, so nothing is left pending ("Task was destroyed but it
    # is pending!") and nothing else reaches stderr.
    code = (
        "import distserver as ds\n"
        "g = ds.Graph()\n"
        "with g.as_default():\n"
        "    total = ds.reduce_sum(ds.constant([1.0, 2.0]))\n"
        "s = ds.Session('', graph=g)\n"
        "print(s.run(total), flush=True)\n" + ("s.close()\n" if close else "")
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=python_env
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "3.0"
    assert result.stderr == ""


def test_ctrl_c_interrupts_join(python_env):
    code = (
        "import distserver as ds\n"
        "s = ds.Server.create_local_server()\n"
        "print('joining', flush=True)\n"
        "try:\n"
        "    s.join()\n"
        "except KeyboardInterrupt:\n"
        "    print('interrupted', flush=True)\n"
        "    s.stop()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=python_env,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "joining"
        time.sleep(0.2)  # let join() block; the signal must interrupt the wait itself
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "interrupted" in out, err
    assert proc.returncode == 0


def test_stop_from_another_thread_ends_join():
    server = ds.Server.create_local_server()
    stopper = threading.Timer(0.2, server.stop)
    stopper.start()
    try:
        assert server.join(timeout=30) is True
    finally:
        stopper.cancel()
        server.stop()


def test_join_timeout_and_context_manager():
    with ds.Server.create_local_server() as server:
        assert server.join(timeout=0.05) is False
        target = server.target
    port = target.rsplit(":", 1)[1]
    # The port was released by __exit__.
    with ds.Server({"localhost": [f"localhost:{port}"]}) as again:
        assert again.target == target


def test_start_false_binds_then_join_forbids_start():
    server = ds.Server.create_local_server(start=False)
    port = server.target.rsplit(":", 1)[1]
    with pytest.raises(errors.UnknownError, match=port):
        ds.Server({"localhost": [f"localhost:{port}"]})
    assert server.join() is True
    with pytest.raises(errors.FailedPreconditionError, match=r"Server has stopped\."):
        server.start()


def test_start_twice_is_harmless():
    server = ds.Server.create_local_server()
    try:
        server.start()
        server.start()
    finally:
        server.stop()


def test_blocking_api_inside_the_loop_thread_raises():
    server = ds.Server.create_local_server()
    try:

        async def misuse():
            server.stop()

        with pytest.raises(RuntimeError, match="own event-loop thread"):
            ds.facade.run_blocking(misuse())
    finally:
        server.stop()


def test_blocking_session_against_blocking_server():
    with ds.Server.create_local_server() as server:
        graph = ds.Graph()
        with graph.as_default():
            x = ds.placeholder(ds.float32, shape=[2])
            y = x * 2.0
        with ds.Session(server.target, graph=graph) as session:
            assert session.run(y, feed_dict={x: [1.0, 2.0]}).tolist() == [2.0, 4.0]
            fn = session.make_callable(y, feed_list=[x])
            assert fn([3.0, 4.0]).tolist() == [6.0, 8.0]
            assert [d.name for d in session.list_devices()] == [
                "/job:localhost/replica:0/task:0/device:CPU:0"
            ]


def test_sessions_from_many_threads():
    with ds.Server.create_local_server() as server:
        graph = ds.Graph()
        with graph.as_default():
            x = ds.placeholder(ds.int32, shape=[])
            y = x + 1
        session = ds.Session(server.target, graph=graph)
        results: dict[int, int] = {}

        def work(i: int) -> None:
            results[i] = int(session.run(y, feed_dict={x: i}))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        session.close()
        assert results == {i: i + 1 for i in range(16)}


def test_facade_parity_with_async_classes():

    for sync_cls, async_cls in ((ds.Server, ds.AsyncServer), (ds.Session, ds.AsyncSession)):
        for name, member in inspect.getmembers(async_cls, inspect.iscoroutinefunction):
            if name.startswith("_") or name in {"bind"}:
                continue
            assert hasattr(sync_cls, name), f"{sync_cls.__name__} lacks {name}"
            sync_params = list(inspect.signature(getattr(sync_cls, name)).parameters)
            async_params = list(inspect.signature(member).parameters)
            assert sync_params == async_params, name


async def test_async_server_in_user_loop_is_independent_of_the_facade_loop():
    async with ds.AsyncServer({"localhost": ["localhost:0"]}) as server:
        assert server.loop is asyncio.get_running_loop()


def test_a_call_after_the_loop_thread_shut_down_raises_instead_of_waiting_forever():
    loop_thread = facade._LoopThread()  # not the process-wide one, which other tests use
    assert loop_thread.run(asyncio.sleep(0, result=7)) == 7
    loop = loop_thread.loop()
    loop_thread.shutdown()
    assert loop.is_closed()
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            loop_thread.run(asyncio.sleep(0))
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(timeout=10)
    assert not caller.is_alive(), "a blocking call after shutdown() hung"
    (error,) = outcome
    assert isinstance(error, RuntimeError)
    assert "shut down" in str(error)
