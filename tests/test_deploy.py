"""deploy/: the container recipe and the Kubernetes manifests, parsed and then run.

The fast tests read every manifest and the Dockerfile: each pod runs `distserver
serve` with options the real parser accepts, is probed for readiness with `distserver
status --only-target`, and reads its TLS files and token from mounted Secrets with the
same paths in the server and the probe. The slow test runs what a pod would run, the
commands verbatim (only the mount paths point at temporary directories, as a kubelet
would mount them, and `distserver` is this checkout's), one task per network namespace
joined by a veth link: TF_CONFIG set as the Kubeflow operator sets it (tfjob.yaml), or
the StatefulSet's shell line with its ConfigMap and pod hostname (statefulset.yaml, TLS
and a token on). Docker is not needed.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from distserver.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
MANIFESTS = ["tfjob.yaml", "tfjob-tls.yaml", "statefulset.yaml"]
SECURE = {"tfjob-tls.yaml", "statefulset.yaml"}
PROBE = ["distserver", "status", "grpc://localhost:2222", "--only-target"]
TLS_FLAGS = ("--tls-cert", "--tls-key", "--tls-ca", "--auth-token-file")


def documents(name):
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def pod_specs(name):
    """(job name, replicas, pod spec) of every pod template in the manifest."""
    for doc in documents(name):
        if doc["kind"] == "TFJob":
            for job, replica in doc["spec"]["tfReplicaSpecs"].items():
                yield job.lower(), replica["replicas"], replica["template"]["spec"]
        elif doc["kind"] == "StatefulSet":
            template = doc["spec"]["template"]
            yield template["metadata"]["labels"]["job"], doc["spec"]["replicas"], template["spec"]


def serve_command(container, hostname="pod-0"):
    """The container's command as the argv `distserver` gets (a `sh -c` line is split)."""
    command = [*container.get("command", []), *container.get("args", [])]
    if command[:2] == ["sh", "-c"]:
        line = command[2]
        line = line.replace('"$(cat "$DISTSERVER_CLUSTER_FILE")"', "CLUSTER")
        line = line.replace('"${HOSTNAME##*-}"', hostname.rsplit("-", 1)[1])
        line = re.sub(r'"\$(\w+)"', lambda m: _env(container)[m.group(1)], line)
        command = shlex.split(line.removeprefix("exec "))
    return command


def _env(container):
    return {item["name"]: item["value"] for item in container.get("env", [])}


def _flag_values(argv, flag):
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == flag]


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_pod_serves_with_options_the_command_line_accepts(name):
    specs = list(pod_specs(name))
    assert {job for job, _, _ in specs} == {"ps", "worker"}
    for _, _, spec in specs:
        (container,) = spec["containers"]
        argv = serve_command(container)
        assert argv[0] == "distserver"
        args = build_parser().parse_args(argv[1:])
        assert args.command == "serve"
        assert args.all_interfaces
        assert args.metrics_port == 9100
        ports = {port["containerPort"] for port in container["ports"]}
        assert {2222, 9100} <= ports
        probe = container["readinessProbe"]["exec"]["command"]
        assert probe[: len(PROBE)] == PROBE
        assert build_parser().parse_args(probe[1:]).only_target
        assert spec["securityContext"]["runAsUser"] == 10001  # the Dockerfile's user
        if "TFJob" in {doc["kind"] for doc in documents(name)}:
            assert container["name"] == "tensorflow"  # the operator's conventions
            assert "tfjob-port" in {port["name"] for port in container["ports"]}


@pytest.mark.parametrize("name", MANIFESTS)
def test_security_files_come_from_mounted_secrets_in_server_and_probe(name):
    for _, _, spec in pod_specs(name):
        (container,) = spec["containers"]
        argv = serve_command(container)
        probe = container["readinessProbe"]["exec"]["command"]
        if name not in SECURE:
            assert not any(flag in argv or flag in probe for flag in TLS_FLAGS)
            continue
        assert "--require-client-cert" in argv
        secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        for flag in TLS_FLAGS:
            (path,) = _flag_values(argv, flag)
            assert _flag_values(probe, flag) == [path], flag
            volume = mounts[os.path.dirname(path)]
            assert volume in secrets, f"{flag} {path} is not in a mounted Secret"


def test_statefulset_cluster_lists_every_pod_by_its_stable_name():
    docs = documents("statefulset.yaml")
    (config_map,) = [doc for doc in docs if doc["kind"] == "ConfigMap"]
    cluster = json.loads(config_map["data"]["cluster.json"])
    services = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "Service"}
    for doc in docs:
        if doc["kind"] != "StatefulSet":
            continue
        name, service = doc["metadata"]["name"], doc["spec"]["serviceName"]
        job = doc["spec"]["template"]["metadata"]["labels"]["job"]
        assert services[service]["spec"]["publishNotReadyAddresses"] is True  # peers resolve while starting
        assert services[service]["spec"]["clusterIP"] == "None"
        expected = [f"{name}-{i}.{service}:2222" for i in range(doc["spec"]["replicas"])]
        assert cluster[job] == expected


def test_dockerfile_installs_the_wheel_and_serves_from_tf_config():
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path
    assert 'ENTRYPOINT ["distserver"]' in text
    (cmd,) = re.findall(r"^CMD (.+)$", text, re.M)
    args = build_parser().parse_args(json.loads(cmd))
    assert (args.command, args.cluster, args.all_interfaces) == ("serve", None, True)
    assert "USER 10001" in text


# ------------------------------------------------------------------ run across namespaces

ADDRESSES = {"ps": "10.213.9.1", "worker": "10.213.9.2"}


def _ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def namespaces():
    """A namespace per task (ps, worker) joined by a veth pair; removed afterwards."""
    tag = f"{os.getpid() % 100000}"
    names = {"ps": f"dsd-ps-{tag}", "worker": f"dsd-wk-{tag}"}
    try:
        _ip("netns", "add", names["ps"])
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot make network namespaces here (needs root or CAP_NET_ADMIN): {exc}")
    try:
        _ip("netns", "add", names["worker"])
        links = {"ps": f"vdp-{tag}", "worker": f"vdw-{tag}"}
        _ip("link", "add", links["ps"], "netns", names["ps"], "type", "veth",
            "peer", "name", links["worker"], "netns", names["worker"])  # fmt: skip
        for job, ns in names.items():
            _ip("-n", ns, "addr", "add", f"{ADDRESSES[job]}/30", "dev", links[job])
            _ip("-n", ns, "link", "set", links[job], "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in names.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def _mounted(container, spec, mounts_root, cluster):
    """Directories standing in for the container's volume mounts (mount path -> directory)."""
    volumes = {volume["name"]: volume for volume in spec.get("volumes", [])}
    paths = {}
    for mount in container.get("volumeMounts", []):
        directory = mounts_root / mount["name"]
        directory.mkdir(parents=True, exist_ok=True)
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            (directory / "cluster.json").write_text(json.dumps(cluster))
        paths[mount["mountPath"]] = str(directory)
    return paths


def _remap(argv, paths):
    out = []
    for arg in argv:
        for mount_path, directory in paths.items():
            arg = arg.replace(mount_path, directory)
        out.append(arg)
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", ["tfjob.yaml", "statefulset.yaml"])
def test_the_pods_commands_make_a_cluster_across_network_namespaces(name, namespaces, tmp_path, python_env):
    secure = name in SECURE
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "distserver").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m distserver "$@"\n')
    (bin_dir / "distserver").chmod(0o755)
    secrets = tmp_path / "secrets"
    if secure:
        from distserver.testing.certs import make_cluster_certificates

        make_cluster_certificates(secrets / "tls", ["localhost", "127.0.0.1", *ADDRESSES.values()])
        (secrets / "token").mkdir()
        (secrets / "token" / "token").write_text("a-token-for-this-test\n")

    # One task per job: the manifests' other replicas would need more namespaces.
    pods = {job: spec for job, _, spec in pod_specs(name)}
    cluster = {job: [f"{ADDRESSES[job]}:2222"] for job in pods}
    tasks, probes, env = {}, {}, {}
    try:
        for job, spec in pods.items():
            (container,) = copy.deepcopy(spec["containers"])
            paths = _mounted(container, spec, tmp_path / job, cluster)
            for mount_path in list(paths):
                secret = secrets / Path(mount_path).name
                if secret.is_dir():
                    paths[mount_path] = str(secret)
            env[job] = {
                **python_env,
                "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
                "PYTHONUNBUFFERED": "1",
            }
            env[job].update({key: _remap([value], paths)[0] for key, value in _env(container).items()})
            if name == "tfjob.yaml":  # what the operator sets
                env[job]["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": 0}})
            env[job]["HOSTNAME"] = f"distserver-{job}-0"
            command = _remap([*container.get("command", []), *container.get("args", [])], paths)
            tasks[job] = subprocess.Popen(
                ["ip", "netns", "exec", namespaces[job], *command],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env[job],
            )  # fmt: skip
            probes[job] = _remap(container["readinessProbe"]["exec"]["command"], paths)
        for job, task in tasks.items():
            assert task.stdout is not None
            line = task.stdout.readline()
            assert f"/job:{job}/replica:0/task:0 serving at" in line, (
                task.stderr.read() if task.stderr else ""
            )

        for job, probe in probes.items():  # readiness, as the kubelet would probe it
            for _ in range(20):
                ready = subprocess.run(
                    ["ip", "netns", "exec", namespaces[job], *probe],
                    capture_output=True, text=True, env=env[job], timeout=60,
                )  # fmt: skip
                if ready.returncode == 0:
                    break
                time.sleep(0.5)
            assert ready.returncode == 0, ready.stderr
            assert "grpc://localhost:2222 is serving" in ready.stdout

        # The whole cluster, asked from the worker's namespace: the ps answers across the link.
        whole = [arg for arg in probes["worker"] if arg != "--only-target"]
        status = subprocess.run(
            ["ip", "netns", "exec", namespaces["worker"], *whole, "--stats"],
            capture_output=True, text=True, env=env["worker"], timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        devices = [line.split("\t")[0] for line in status.stdout.splitlines() if "\t" in line]
        assert devices == [
            "/job:worker/replica:0/task:0/device:CPU:0",
            "/job:ps/replica:0/task:0/device:CPU:0",
        ]
        assert f"peer /job:ps/replica:0/task:0 at {ADDRESSES['ps']}:2222 via grpc" in status.stdout

        scrape = subprocess.run(
            ["ip", "netns", "exec", namespaces["ps"], sys.executable, "-c",
             "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:9100/metrics').read().decode())"],
            capture_output=True, text=True, env=env["ps"], timeout=60,
        )  # fmt: skip
        assert scrape.returncode == 0, scrape.stderr
        assert 'distserver_steps_total{result="ok",task="/job:ps/replica:0/task:0"}' in scrape.stdout
    finally:
        for task in tasks.values():
            task.send_signal(signal.SIGTERM)
        for task in tasks.values():
            try:
                task.communicate(timeout=30)
            finally:
                task.kill()
