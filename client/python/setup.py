"""Builds the pdserve package, generating its gRPC stubs while it builds.

The stubs (pdserve/v1/generation_pb2.py, .pyi and generation_pb2_grpc.py)
are made by grpcio-tools from pdserve/v1/generation.proto, which is looked
for, first found:

  1. $PDSERVE_PROTO_DIR: a directory holding pdserve/v1/generation.proto
     (for a copy of this directory outside a pdserve checkout);
  2. ../../proto beside this file: a pdserve checkout
     (`pip install ./client/python`; pip builds a local directory in place);
  3. _proto/ beside this file: an sdist, into which `sdist` copies the proto.

The package depends on grpcio and protobuf no older than the ones whose code
generator made the stubs (generated code refuses older runtimes).
"""

import os
import pathlib
import shutil
import sys
from importlib import metadata

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = pathlib.Path(__file__).resolve().parent
PROTO = pathlib.Path("pdserve") / "v1" / "generation.proto"


def proto_root() -> pathlib.Path:
    candidates = []
    if os.environ.get("PDSERVE_PROTO_DIR"):
        candidates.append(pathlib.Path(os.environ["PDSERVE_PROTO_DIR"]))
    candidates += [HERE.parent.parent / "proto", HERE / "_proto"]
    for root in candidates:
        if (root / PROTO).is_file():
            return root
    sys.exit(
        "pdserve: cannot find %s under any of %s; set PDSERVE_PROTO_DIR to "
        "the proto/ directory of a pdserve checkout"
        % (PROTO, ", ".join(str(c) for c in candidates))
    )


def generate_stubs(out_dir: pathlib.Path) -> None:
    import grpc_tools
    from grpc_tools import protoc

    root = proto_root()
    # The well-known types (google/protobuf/*.proto) grpcio-tools ships.
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    (out_dir / PROTO.parent).mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        "--proto_path=%s" % root,
        "--proto_path=%s" % well_known,
        "--python_out=%s" % out_dir,
        "--pyi_out=%s" % out_dir,
        "--grpc_python_out=%s" % out_dir,
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        sys.exit("pdserve: grpc_tools.protoc failed on %s" % (root / PROTO))


def dependencies() -> list:
    """grpcio and protobuf at least as new as the generator's."""
    try:
        tools = metadata.version("grpcio-tools")
        protobuf = metadata.version("protobuf")
    except metadata.PackageNotFoundError:
        # Metadata asked for without the build requirements (an unusual
        # frontend): the floor of pyproject's build requirement.
        tools, protobuf = "1.60.0", "4.21.0"
    return ["grpcio>=%s" % tools, "protobuf>=%s" % protobuf]


class BuildPyWithStubs(build_py):
    def run(self):
        super().run()
        # An editable install imports from the source tree, so the stubs go
        # there (ignored by git); a regular build puts them in the wheel.
        if getattr(self, "editable_mode", False):
            generate_stubs(HERE)
        else:
            generate_stubs(pathlib.Path(self.build_lib))


class SdistWithProto(sdist):
    def make_release_tree(self, base_dir, files):
        super().make_release_tree(base_dir, files)
        target = pathlib.Path(base_dir) / "_proto" / PROTO
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(proto_root() / PROTO, target)


setup(
    install_requires=dependencies(),
    cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProto},
)
