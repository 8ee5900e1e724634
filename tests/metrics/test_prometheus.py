"""Every process's /metrics against the real Prometheus tools.

A live builtin:tiny 1P1D cluster (deploy/local/cluster.sh, binaries from
PDSERVE_BUILD_DIR) serves some requests; then
  - `promtool check metrics` passes on the router's, the prefill worker's
    and the decode worker's exposition;
  - the real Prometheus server (Debian package `prometheus`) scrapes all
    three every second: every target is up, and a histogram queried through
    its HTTP API holds the requests sent;
  - every pdserve_* metric the Grafana dashboard (deploy/grafana/pdserve.json)
    queries exists in a live scrape, so the dashboard cannot rot.
promtool and prometheus come from deploy/install-deps.sh; without them the
tests fail and say so.
"""
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILD = pathlib.Path(os.environ.get("PDSERVE_BUILD_DIR", ROOT / "build"))
DASHBOARD = ROOT / "deploy/grafana/pdserve.json"
PROCESSES = ["router", "prefill-0", "decode-0"]
REQUESTS = 6


def tool(name):
    path = shutil.which(name) or (f"/usr/bin/{name}"
                                  if os.access(f"/usr/bin/{name}", os.X_OK)
                                  else None)
    if path is None:
        pytest.fail(f"{name} not found: run deploy/install-deps.sh "
                    "(Debian package 'prometheus')")
    return path


def get(url, timeout=30):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("cluster")
    script = ROOT / "deploy/local/cluster.sh"
    threads = os.environ.get("PDSERVE_TEST_WORKER_THREADS", "1")
    subprocess.run([str(script), "up", "--prefill", "1", "--decode", "1",
                    "--model", "builtin:tiny", "--dir", str(run_dir),
                    "--bin", str(BUILD),
                    "--prefill-args", f"--num_threads={threads}",
                    "--decode-args", f"--num_threads={threads}"],
                   check=True, capture_output=True, timeout=180)
    try:
        http = int((run_dir / "router.http_port").read_text())
        for i in range(REQUESTS):
            body = json.dumps({"model": "builtin:tiny",
                               "prompt": f"metrics request {i}",
                               "max_tokens": 8}).encode()
            req = urllib.request.Request(
                f"http://127.0.0.1:{http}/v1/completions", data=body,
                headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                assert r.status == 200
        yield run_dir
    finally:
        subprocess.run([str(script), "down", "--dir", str(run_dir)],
                       capture_output=True, timeout=60)


def scrape(run_dir, name):
    port = int((run_dir / f"{name}.metrics_port").read_text())
    return get(f"http://127.0.0.1:{port}/metrics")


@pytest.mark.parametrize("name", PROCESSES)
def test_promtool_accepts_each_process(cluster, name):
    text = scrape(cluster, name)
    assert "# TYPE pdserve_" in text
    result = subprocess.run([tool("promtool"), "check", "metrics"],
                            input=text, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and not result.stdout.strip() \
        and not result.stderr.strip(), \
        f"promtool on {name}:\n{result.stdout}{result.stderr}"


def test_workers_serve_health(cluster):
    for name in ("prefill-0", "decode-0"):
        port = int((cluster / f"{name}.metrics_port").read_text())
        assert get(f"http://127.0.0.1:{port}/health") == "ok\n"


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    work = tmp_path_factory.mktemp("prometheus")
    config = work / "prometheus.yml"
    config.write_text(f"""\
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: pdserve
    file_sd_configs:
      - files: ['{cluster / "prometheus_targets.json"}']
        refresh_interval: 1s
""")
    port = free_port()
    log = open(work / "prometheus.log", "w")
    proc = subprocess.Popen(
        [tool("prometheus"), f"--config.file={config}",
         f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 90
        while True:
            try:
                if "Ready" in get(f"{base}/-/ready", timeout=5):
                    break
            except OSError:
                pass
            assert proc.poll() is None, \
                f"prometheus exited: {(work / 'prometheus.log').read_text()}"
            assert time.time() < deadline, "prometheus not ready in 90 s"
            time.sleep(0.5)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def api(base, path, **params):
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    reply = json.loads(get(url))
    assert reply["status"] == "success", reply
    return reply["data"]


def wait_for(check, what, timeout=90):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        ok, last = check()
        if ok:
            return last
        time.sleep(1)
    pytest.fail(f"{what} within {timeout} s; last: {last}")


def test_prometheus_scrapes_every_process(prometheus):
    def all_up():
        active = api(prometheus, "targets", state="active")["activeTargets"]
        health = {t["labels"].get("process"): t["health"] for t in active}
        errors = [t.get("lastError") for t in active if t.get("lastError")]
        return (sorted(health) == sorted(PROCESSES) and
                all(h == "up" for h in health.values())), (health, errors)
    wait_for(all_up, "every target up")


def test_histogram_through_the_query_api(prometheus):
    def counted():
        result = api(prometheus, "query",
                     query="pdserve_router_time_to_first_token_seconds_count")
        value = float(result["result"][0]["value"][1]) if result["result"] else 0
        return value >= REQUESTS, value
    assert wait_for(counted, f"{REQUESTS} TTFT observations") >= REQUESTS

    def quantile():
        result = api(prometheus, "query", query=(
            "histogram_quantile(0.5, sum by (le) "
            "(pdserve_router_time_to_first_token_seconds_bucket))"))
        if not result["result"]:
            return False, result
        value = float(result["result"][0]["value"][1])
        return 0 < value < 60, value
    wait_for(quantile, "a TTFT median")

    def decode_steps():
        result = api(prometheus, "query", query=(
            'sum(pdserve_decode_step_seconds_count{process="decode-0"})'))
        value = float(result["result"][0]["value"][1]) if result["result"] else 0
        return value > 0, value
    wait_for(decode_steps, "decode steps scraped from the decode worker")


def dashboard_metric_names():
    dashboard = json.loads(DASHBOARD.read_text())
    names = set()
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            names.update(re.findall(r"pdserve_[a-z0-9_]+", target["expr"]))
    return names


def test_dashboard_queries_only_live_metrics(cluster):
    families = set()
    for name in PROCESSES:
        families.update(re.findall(r"^# TYPE (\S+) (\S+)$",
                                   scrape(cluster, name), re.M))
    live = set()
    for family, kind in families:
        live.add(family)
        if kind == "histogram":
            live.update(family + s for s in ("_bucket", "_sum", "_count"))
    names = dashboard_metric_names()
    assert len(names) > 20
    missing = sorted(names - live)
    assert not missing, f"the dashboard queries metrics no process serves: {missing}"
