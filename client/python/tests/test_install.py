"""The package installs with pip as users install it: from the checkout
(`pip install ./client/python`, stubs generated from ../../proto) and from
an sdist outside any checkout (the proto travels in it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from conftest import REPO, SDK_SOURCE, install_sdk


def imports_from(target) -> str:
    code = ("import pdserve, pdserve.v1.generation_pb2_grpc as g; "
            "print(pdserve.__file__, g.GenerationStub.__name__, "
            "'temperature' in pdserve.pb.SamplingParams.DESCRIPTOR.fields_by_name)")
    env = dict(os.environ, PYTHONPATH=str(target))
    return subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=str(target),
                          capture_output=True, text=True).stdout


def test_pip_install_from_the_checkout(tmp_path):
    for leftover in (SDK_SOURCE / "build", SDK_SOURCE / "pdserve.egg-info"):
        shutil.rmtree(leftover, ignore_errors=True)
    try:
        env = {k: v for k, v in os.environ.items() if k != "PDSERVE_PROTO_DIR"}
        install_sdk(os.path.relpath(SDK_SOURCE, REPO), tmp_path / "site", env)
    finally:
        for leftover in (SDK_SOURCE / "build", SDK_SOURCE / "pdserve.egg-info"):
            shutil.rmtree(leftover, ignore_errors=True)
    out = imports_from(tmp_path / "site")
    assert str(tmp_path / "site") in out and "GenerationStub True" in out
    # Nothing generated lands in the source tree.
    assert not list((SDK_SOURCE / "pdserve" / "v1").glob("*_pb2*"))


def test_pip_install_of_an_sdist_outside_the_checkout(tmp_path):
    source = tmp_path / "source"
    shutil.copytree(SDK_SOURCE, source, ignore=shutil.ignore_patterns(
        "build", "*.egg-info", "*_pb2*", "__pycache__", "tests"))
    env = dict(os.environ, PDSERVE_PROTO_DIR=str(REPO / "proto"))
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                   cwd=str(source), env=env, check=True, capture_output=True)
    (sdist,) = (tmp_path / "dist").glob("pdserve-*.tar.gz")
    # No checkout beside it, no PDSERVE_PROTO_DIR: the sdist's own copy.
    env.pop("PDSERVE_PROTO_DIR")
    install_sdk(sdist, tmp_path / "site", env)
    assert "GenerationStub True" in imports_from(tmp_path / "site")
