"""Real pdserve clusters for the OpenAI-client tests.

Each cluster is started by deploy/local/cluster.sh from the build directory
named by PDSERVE_BUILD_DIR (ctest sets it), serving stories260K from
deploy/models converted to Hugging Face layout, with its chat template.
"""
import os
import pathlib
import re
import shutil
import subprocess
import time
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("PDSERVE_BUILD_DIR", ROOT / "build"))
MODEL_NAME = "stories260K"


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("models") / MODEL_NAME
    shipped = ROOT / "deploy/models/stories260K"
    subprocess.run([str(BUILD / "client/pdctl"), "convert-llama2c",
                    str(shipped / "stories260K.bin"),
                    str(shipped / "tok512.bin"), str(out)],
                   check=True, capture_output=True)
    shutil.copy(shipped / "chat_template.jinja", out)
    return out


class Cluster:
    def __init__(self, run_dir, prefill, decode, model, router_args="",
                 decode_args=""):
        self.dir = run_dir
        self.script = ROOT / "deploy/local/cluster.sh"
        args = [str(self.script), "up", "--prefill", str(prefill), "--decode",
                str(decode), "--model", str(model), "--dir", str(run_dir),
                "--bin", str(BUILD)]
        if router_args:
            args += ["--router-args", router_args]
        # Engine threads per worker; 1 under ThreadSanitizer, which cannot
        # see into OpenMP (docs/development.md).
        threads = os.environ.get("PDSERVE_TEST_WORKER_THREADS")
        if threads:
            args += ["--prefill-args", f"--num_threads={threads}"]
            decode_args = f"--num_threads={threads} {decode_args}".strip()
        if decode_args:
            args += ["--decode-args", decode_args]
        subprocess.run(args, check=True, capture_output=True, timeout=120)
        self.http_port = int((run_dir / "router.http_port").read_text())
        self.base_url = f"http://127.0.0.1:{self.http_port}/v1"

    def metrics(self):
        with urllib.request.urlopen(
                f"http://127.0.0.1:{self.http_port}/metrics") as r:
            return r.read().decode()

    def kv_blocks(self):
        """(free, total) KV blocks summed over the decode workers."""
        text = self.metrics()
        free = sum(int(v) for v in re.findall(
            r'pdserve_router_worker_kv_blocks\{[^}]*state="free"\} (\d+)',
            text))
        total = sum(int(v) for v in re.findall(
            r'pdserve_router_worker_kv_blocks\{[^}]*state="total"\} (\d+)',
            text))
        return free, total

    def wait_all_blocks_free(self, timeout=10.0):
        end = time.time() + timeout
        free, total = self.kv_blocks()
        while time.time() < end and (total == 0 or free != total):
            time.sleep(0.1)
            free, total = self.kv_blocks()
        return free, total

    def down(self):
        subprocess.run([str(self.script), "down", "--dir", str(self.dir)],
                       capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def start_cluster(tmp_path_factory, model_dir):
    started = []

    def start(prefill=1, decode=1, router_args="", decode_args=""):
        cluster = Cluster(tmp_path_factory.mktemp("cluster"), prefill, decode,
                          model_dir, router_args, decode_args)
        started.append(cluster)
        return cluster

    yield start
    for cluster in started:
        cluster.down()


@pytest.fixture(scope="session")
def cluster(start_cluster):
    """1P1D: one prefill and one decode worker behind the router."""
    return start_cluster(1, 1)
