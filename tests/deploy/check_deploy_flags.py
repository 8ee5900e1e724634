#!/usr/bin/env python3
"""Checks that the flags deploy/ passes to the pdserve binaries are theirs.

Every pd-router / pd-prefill / pd-decode command line in rendered Kubernetes
manifests (--k8s FILE, the output of `kubectl kustomize`) and in the systemd
units' example environment files (--systemd DIR: the units and DIR/env/)
must name only flags that `BINARY --helpfull` of this build lists, so the
manifests cannot drift from the code. Also checks what
a flag name alone cannot: a decode worker's --kv_listen is a routable
address, and each ConfigMap's model is its cluster.json's model.

  check_deploy_flags.py --bin BUILD_DIR [--k8s FILE]... [--systemd DIR]

Exits 1 with every problem listed, 0 when there is none.
"""

import argparse
import json
import pathlib
import re
import shlex
import subprocess
import sys

import yaml

BINARIES = {
    "pd-router": "router/pd-router",
    "pd-prefill": "prefill_worker/pd-prefill",
    "pd-decode": "decode_worker/pd-decode",
}

FLAG_LINE = re.compile(r"^\s+--([A-Za-z0-9_]+) \(")


def binary_flags(build_dir):
    """Flag names of each binary, from its --helpfull (which exits 1)."""
    flags = {}
    for name, rel in BINARIES.items():
        path = pathlib.Path(build_dir) / rel
        out = subprocess.run([str(path), "--helpfull"], capture_output=True,
                             text=True, timeout=60)
        names = {m.group(1) for line in (out.stdout + out.stderr).splitlines()
                 if (m := FLAG_LINE.match(line))}
        if "listen" not in names:
            sys.exit(f"{path} --helpfull lists no --listen: is it built?\n"
                     f"{out.stdout[-500:]}{out.stderr[-500:]}")
        flags[name] = names
    return flags


class Checker:
    def __init__(self, flags):
        self.flags = flags
        self.problems = []
        self.command_lines = 0

    def check(self, where, binary, args):
        self.command_lines += 1
        known = self.flags[binary]
        for arg in args:
            m = re.fullmatch(r"--([A-Za-z0-9_]+)(=(.*))?", arg, re.S)
            if not m:
                self.problems.append(f"{where}: {binary}: '{arg}' is not a --flag")
                continue
            name, value = m.group(1), m.group(3)
            if name not in known:
                self.problems.append(f"{where}: {binary} has no flag --{name}")
            if binary == "pd-decode" and name == "kv_listen":
                host = (value or "").rsplit(":", 1)[0]
                if host in ("", "0.0.0.0", "[::]", "::"):
                    self.problems.append(
                        f"{where}: --kv_listen={value}: prefill workers push "
                        "KV to this address, so it must be routable")

    def report(self):
        for p in self.problems:
            print(f"FAIL {p}")
        print(f"{self.command_lines} command lines checked, "
              f"{len(self.problems)} problems")
        return 1 if self.problems or self.command_lines == 0 else 0


def check_k8s(checker, path):
    docs = [d for d in yaml.safe_load_all(pathlib.Path(path).read_text()) if d]
    configmaps = [d for d in docs if d.get("kind") == "ConfigMap"]
    for cm in configmaps:
        data = cm.get("data", {})
        name = f"{path}: ConfigMap {cm['metadata']['name']}"
        if "cluster.json" not in data or "model" not in data:
            checker.problems.append(f"{name}: wants cluster.json and model")
            continue
        cluster_model = json.loads(data["cluster.json"]).get("model")
        if cluster_model != data["model"]:
            checker.problems.append(
                f"{name}: workers load model {data['model']!r} but the "
                f"router's cluster.json names {cluster_model!r}")
    seen = set()
    for d in docs:
        pod = d.get("spec", {}).get("template", {}).get("spec")
        if not pod:
            continue
        for c in pod.get("containers", []):
            command = c.get("command") or []
            binary = command[0] if command else None
            if binary in BINARIES:
                seen.add(binary)
                checker.check(f"{path}: {d['kind']} {d['metadata']['name']}",
                              binary, command[1:] + c.get("args", []))
    for binary in sorted(set(BINARIES) - seen):
        checker.problems.append(f"{path}: no container runs {binary}")


def env_flags(path):
    """PDSERVE_FLAGS of a systemd EnvironmentFile, split as systemd does."""
    text = pathlib.Path(path).read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line.startswith("PDSERVE_FLAGS="):
            return shlex.split(line[len("PDSERVE_FLAGS="):])
    return None


def check_systemd(checker, unit_dir):
    unit_dir = pathlib.Path(unit_dir)
    units = sorted(unit_dir.glob("*.service"))
    if not units:
        checker.problems.append(f"{unit_dir}: no units")
    for unit in units:
        text = unit.read_text()
        exec_start = re.search(r"^ExecStart=(\S+) \$PDSERVE_FLAGS$", text, re.M)
        env_file = re.search(r"^EnvironmentFile=/etc/pdserve/(\S+)$", text, re.M)
        if not exec_start or not env_file:
            checker.problems.append(
                f"{unit}: wants 'ExecStart=BINARY $PDSERVE_FLAGS' and "
                "'EnvironmentFile=/etc/pdserve/NAME.env'")
            continue
        binary = pathlib.Path(exec_start.group(1)).name
        if binary not in BINARIES:
            checker.problems.append(f"{unit}: runs {binary}, not a pdserve server")
            continue
        # prefill-%i.env -> the examples prefill-*.env.
        examples = sorted((unit_dir / "env").glob(env_file.group(1).replace("%i", "*")))
        if not examples:
            checker.problems.append(f"{unit}: no example env/{env_file.group(1)}")
        for env in examples:
            args = env_flags(env)
            if args is None:
                checker.problems.append(f"{env}: no PDSERVE_FLAGS=")
            else:
                checker.check(str(env), binary, args)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bin", required=True)
    parser.add_argument("--k8s", action="append", default=[])
    parser.add_argument("--systemd")
    args = parser.parse_args()
    checker = Checker(binary_flags(args.bin))
    for path in args.k8s:
        check_k8s(checker, path)
    if args.systemd:
        check_systemd(checker, args.systemd)
    return checker.report()


if __name__ == "__main__":
    sys.exit(main())
