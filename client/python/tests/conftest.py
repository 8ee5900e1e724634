"""Fixtures of the Python SDK's tests: the SDK installed fresh from this
checkout, and real local clusters (pd-router, pd-prefill, pd-decode from
the build directory, model builtin:tiny) started with
deploy/local/cluster.sh, the launcher users run.

Environment: PDSERVE_BUILD_DIR, the CMake build directory holding the
binaries (default: <repo>/build; ctest sets it).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Iterator, List, Optional

import pytest

REPO = pathlib.Path(__file__).resolve().parents[3]
SDK_SOURCE = REPO / "client" / "python"
BUILD = pathlib.Path(os.environ.get("PDSERVE_BUILD_DIR", REPO / "build")).resolve()

# One engine thread per worker and small pools, as tests/cluster does (the
# tests share two cores).
WORKER_ARGS = "--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=16"

_WORK = pathlib.Path(tempfile.mkdtemp(prefix="pdserve-pytest-"))


def install_sdk(source: pathlib.Path, target: pathlib.Path, env: Optional[dict] = None) -> None:
    """pip-installs the package at `source` into `target` (a --target dir),
    with the build requirements of this environment (no network)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(source)],
        check=True, env=env, cwd=str(REPO),
    )


def _install_sdk_for_the_tests() -> None:
    # A copy of the package directory, so that no build output of an earlier
    # run (client/python/build, generated stubs) can leak in; the proto comes
    # from this checkout through PDSERVE_PROTO_DIR, the path for a copy.
    source = _WORK / "sdk-source"
    shutil.copytree(
        SDK_SOURCE, source,
        ignore=shutil.ignore_patterns("build", "*.egg-info", "*_pb2*", "__pycache__", "tests"),
    )
    env = dict(os.environ, PDSERVE_PROTO_DIR=str(REPO / "proto"))
    install_sdk(source, _WORK / "site", env)
    sys.path.insert(0, str(_WORK / "site"))


_install_sdk_for_the_tests()


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(_WORK, ignore_errors=True)


def _binary(relative: str) -> pathlib.Path:
    path = BUILD / relative
    if not path.is_file():
        pytest.fail("%s is missing: build pd-router, pd-prefill, pd-decode and pdctl in %s "
                    "(or set PDSERVE_BUILD_DIR)" % (path, BUILD))
    return path


class LocalCluster:
    """A real cluster: 1 prefill and 1 decode worker behind one router,
    plus any extra routers (start_router) over the same workers."""

    def __init__(self, name: str, router_args: str = "", decode_args: str = WORKER_ARGS) -> None:
        for b in ("router/pd-router", "prefill_worker/pd-prefill",
                  "decode_worker/pd-decode", "client/pdctl"):
            _binary(b)
        self.dir = _WORK / name
        self._routers: List[subprocess.Popen] = []
        result = subprocess.run(
            [str(REPO / "deploy/local/cluster.sh"), "up", "--dir", str(self.dir),
             "--bin", str(BUILD), "--prefill", "1", "--decode", "1",
             "--model", "builtin:tiny", "--prefill-args", WORKER_ARGS,
             "--decode-args", decode_args, "--router-args", router_args],
            capture_output=True, text=True)
        if result.returncode != 0:
            self.down()
            pytest.fail("cluster did not start: %s%s" % (result.stdout, result.stderr))
        self.address = self.address_of("router")

    def address_of(self, name: str) -> str:
        return "127.0.0.1:%s" % (self.dir / (name + ".port")).read_text().strip()

    def pid_of(self, name: str) -> int:
        return int((self.dir / (name + ".pid")).read_text())

    def start_router(self, name: str, *args: str) -> str:
        """Another pd-router over this cluster's workers; its address."""
        port_file = self.dir / (name + ".port")
        log = open(self.dir / (name + ".log"), "w")
        process = subprocess.Popen(
            [str(_binary("router/pd-router")), "--config=%s" % (self.dir / "cluster.json"),
             "--listen=127.0.0.1:0", "--port_file=%s" % port_file, *args],
            stdout=log, stderr=subprocess.STDOUT)
        self._routers.append(process)
        for _ in range(600):
            if port_file.exists() and port_file.read_text().strip():
                return self.address_of(name)
            if process.poll() is not None:
                pytest.fail("%s exited: %s" % (name, (self.dir / (name + ".log")).read_text()))
            time.sleep(0.05)
        pytest.fail("%s did not start" % name)

    def down(self) -> None:
        for process in self._routers:
            process.terminate()
        for process in self._routers:
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
        subprocess.run([str(REPO / "deploy/local/cluster.sh"), "down", "--dir", str(self.dir)],
                       capture_output=True)


def wait_serving(client, decode_workers: int = 1) -> None:
    """Until the router sees the workers (extra routers poll them anew)."""
    for _ in range(300):
        health = client.health()
        if health.serving and health.decode_workers == decode_workers:
            return
        time.sleep(0.05)
    pytest.fail("router not serving: %s" % client.health())


@pytest.fixture(scope="session")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster("shared")
    yield c
    c.down()


@pytest.fixture()
def own_cluster(request) -> Iterator[LocalCluster]:
    """A cluster of the test's own, for tests that break it."""
    c = LocalCluster("own-" + request.node.name)
    yield c
    c.down()


@pytest.fixture(scope="session")
def worker_stubs():
    """pdserve.internal.v1 stubs (worker.proto), generated here with
    grpcio-tools: the decode worker's GetLoad tells its free KV blocks,
    which no public API shows."""
    from grpc_tools import protoc

    out = _WORK / "internal-stubs"
    source = _WORK / "internal-proto" / "pdserve_internal"
    source.mkdir(parents=True)
    # Under a module path of its own, so that it cannot shadow the SDK's
    # `pdserve` package.
    shutil.copyfile(REPO / "proto/pdserve/internal/v1/worker.proto", source / "worker.proto")
    (out / "pdserve_internal").mkdir(parents=True)
    (out / "pdserve_internal" / "__init__.py").write_text("")
    assert protoc.main(["grpc_tools.protoc", "-I%s" % source.parent, "--python_out=%s" % out,
                        "--grpc_python_out=%s" % out, "pdserve_internal/worker.proto"]) == 0
    sys.path.insert(0, str(out))
    from pdserve_internal import worker_pb2, worker_pb2_grpc

    return worker_pb2, worker_pb2_grpc
