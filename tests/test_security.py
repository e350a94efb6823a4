"""TLS, mutual TLS and the shared token, on real ports (in-process servers and task processes)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import grpc.aio
import numpy as np
import pytest

import distserver as ds
from distserver import errors
from distserver.protos.config_pb2 import RPCOptions
from distserver.protos.master_pb2 import ListDevicesRequest
from distserver.protos.services import MASTER_SERVICE
from distserver.runtime.clients import RemoteMaster
from distserver.security import TOKEN_ENV
from distserver.testing import LocalCluster
from distserver.testing.certs import make_cluster_certificates
from distserver.transports import call_stream, get_transport

LOCAL = {"local": ["localhost:0"]}
TOKEN = "correct horse battery staple"
# Sessions on the server's own loop would call its master in-process: make them use RPC.
OVER_RPC = ds.ConfigProto(rpc_options=RPCOptions(use_rpc_for_inprocess_master=True))


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_cluster_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture
def no_env_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)


def server_tls(certs, **kwargs):
    return ds.Security(str(certs.server_cert), str(certs.server_key), str(certs.ca_cert), **kwargs)


async def list_devices(target: str, security: ds.Security | None, timeout: float = 10.0) -> list[str]:
    channel = get_transport("grpc").connect(target.removeprefix("grpc://"), security=security)
    try:
        response = await RemoteMaster(channel).call("ListDevices", ListDevicesRequest(), timeout=timeout)
    finally:
        await channel.close()
    return [d.name for d in response.local_device]


async def run_doubled(target: str, security: ds.Security | None, protocol_config=OVER_RPC) -> float:
    with ds.Graph().as_default() as graph:
        x = ds.placeholder(ds.float32, shape=[], name="x")
        y = x * 2.0
    async with ds.AsyncSession(target, graph=graph, config=protocol_config, security=security) as session:
        return float(await session.run(y, feed_dict={x: 21.0}))


# -- the options -----------------------------------------------------------------------


def test_options_that_do_not_fit_together_are_refused(certs, tmp_path, no_env_token):
    with pytest.raises(ValueError, match="cert_file and key_file go together"):
        ds.Security(cert_file=str(certs.server_cert))
    with pytest.raises(ValueError, match="require_client_cert needs"):
        ds.Security(ca_file=str(certs.ca_cert), require_client_cert=True)
    with pytest.raises(ValueError, match=r"ca_file '.*missing.pem' does not exist"):
        ds.Security(ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match="token must be non-empty"):
        ds.Security(token=" padded ")
    with pytest.raises(ValueError, match="needs cert_file and key_file to serve TLS"):
        ds.AsyncServer(LOCAL, security=ds.Security(ca_file=str(certs.ca_cert)))


def test_the_token_may_come_from_the_environment(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    assert ds.Security().token == TOKEN
    assert ds.Security(token="given").token == "given"


# -- the token ---------------------------------------------------------------------------


async def test_every_call_needs_the_token(no_env_token):
    async with ds.AsyncServer(LOCAL, security=ds.Security(token=TOKEN)) as server:
        assert await list_devices(server.target, ds.Security(token=TOKEN))
        assert await run_doubled(server.target, ds.Security(token=TOKEN)) == 42.0
        for wrong in (None, ds.Security(token="guess")):
            with pytest.raises(errors.UnauthenticatedError, match="needs the cluster's token"):
                await list_devices(server.target, wrong)
            with pytest.raises(errors.UnauthenticatedError, match="DISTSERVER_AUTH_TOKEN"):
                await run_doubled(server.target, wrong)


async def test_raw_calls_without_the_token_are_refused_on_every_path(no_env_token):
    """Unary methods, the call stream and the tensor stream alike."""
    async with ds.AsyncServer(LOCAL, security=ds.Security(token=TOKEN)) as server:
        address = server.target.removeprefix("grpc://")
        async with grpc.aio.insecure_channel(address) as channel:
            paths = [
                f"/{MASTER_SERVICE}/ListDevices",
                f"/{MASTER_SERVICE}/Reset",
                "/tensorflow.WorkerService/RunGraph",
                "/tensorflow.WorkerService/RecvTensor",
            ]
            for path in paths:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary(path)(b"", timeout=10)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, path
            call = channel.stream_stream(call_stream.METHOD)(iter([b"\0" * 16]), timeout=10)
            assert await call.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_the_environment_token_secures_servers_and_sessions(monkeypatch):
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    async with ds.AsyncServer(LOCAL) as server:
        assert await run_doubled(server.target, None) == 42.0
        monkeypatch.delenv(TOKEN_ENV)
        with pytest.raises(errors.UnauthenticatedError):
            await run_doubled(server.target, None)


# -- TLS -----------------------------------------------------------------------------


async def test_tls_serves_clients_that_trust_the_ca(certs, no_env_token):
    async with ds.AsyncServer(LOCAL, security=server_tls(certs)) as server:
        assert await run_doubled(server.target, ds.Security(ca_file=str(certs.ca_cert))) == 42.0


async def test_a_plaintext_client_of_a_tls_server_fails_fast_unavailable(certs, no_env_token):
    async with ds.AsyncServer(LOCAL, security=server_tls(certs)) as server:
        started = time.monotonic()
        with pytest.raises(errors.UnavailableError):
            await list_devices(server.target, None, timeout=30)
        assert time.monotonic() - started < 10


async def test_a_client_that_does_not_trust_the_server_fails_unavailable(certs, tmp_path, no_env_token):
    other = make_cluster_certificates(tmp_path / "other")
    async with ds.AsyncServer(LOCAL, security=server_tls(certs)) as server:
        with pytest.raises(errors.UnavailableError):
            await list_devices(server.target, ds.Security(ca_file=str(other.ca_cert)), timeout=30)


async def test_mutual_tls_refuses_clients_without_a_certificate(certs, no_env_token):
    async with ds.AsyncServer(LOCAL, security=server_tls(certs, require_client_cert=True)) as server:
        with pytest.raises(errors.UnavailableError):
            await list_devices(server.target, ds.Security(ca_file=str(certs.ca_cert)), timeout=30)
        client = ds.Security(str(certs.client_cert), str(certs.client_key), str(certs.ca_cert))
        assert await run_doubled(server.target, client) == 42.0


# -- a cluster of task processes -----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["grpc", "grpc+verbs"])
def test_a_cluster_with_mutual_tls_and_a_token_runs_steps_across_tasks(certs, tmp_path, protocol):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    tls = [
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
        "--tls-ca", str(certs.ca_cert),
    ]  # fmt: skip
    serve_args = [*tls, "--require-client-cert", "--auth-token-file", str(token_file)]
    with LocalCluster({"ps": 1, "worker": 1}, protocol=protocol, serve_args=serve_args) as cluster:
        graph = ds.Graph()
        with graph.as_default():
            with ds.device("/job:ps/task:0"):
                big = ds.constant(np.ones((512, 1024), np.float32), name="big") * 3.0
            total = ds.reduce_sum(big)
        client = ds.Security(str(certs.client_cert), str(certs.client_key), str(certs.ca_cert), token=TOKEN)
        with ds.Session(cluster.target("worker"), graph=graph, security=client) as session:
            assert session.run(total) == 3.0 * 512 * 1024
        no_token = ds.Security(str(certs.client_cert), str(certs.client_key), str(certs.ca_cert))
        with (
            ds.Session(cluster.target("worker"), graph=graph, security=no_token) as session,
            pytest.raises(errors.UnauthenticatedError),  # the certificate alone is not enough
        ):
            session.run(total)

        status = [sys.executable, "-m", "distserver", "status", cluster.target("ps"), *tls]
        refused = subprocess.run(status, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 1
        assert "UnauthenticatedError" in refused.stderr, refused.stderr
        shown = subprocess.run(
            [*status, "--auth-token-file", str(token_file)], capture_output=True, text=True, timeout=60
        )
        assert shown.returncode == 0, shown.stderr
        assert "/job:ps/replica:0/task:0/device:CPU:0" in shown.stdout


def test_status_names_an_unreadable_token_file(tmp_path):
    missing = str(tmp_path / "none")
    result = subprocess.run(
        [sys.executable, "-m", "distserver", "status", "localhost:1", "--auth-token-file", missing],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--auth-token-file: cannot read" in result.stderr


async def test_servers_and_sessions_are_plaintext_without_security(no_env_token):
    async with ds.AsyncServer(LOCAL) as server:
        assert await asyncio.wait_for(run_doubled(server.target, None), 30) == 42.0
