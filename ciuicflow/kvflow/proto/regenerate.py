"""Regenerate the Python stubs of ``kvflow.proto`` (run after editing the .proto).

    python -m ciuicflow.kvflow.proto.regenerate

Uses grpcio-tools' bundled protoc; the generated ``kvflow_pb2.py``, ``kvflow_pb2.pyi`` and
``kvflow_pb2_grpc.py`` are committed. The import in ``kvflow_pb2_grpc.py`` is rewritten to a
package-relative one so the stubs work as ``ciuicflow.kvflow.proto``.
"""
import pathlib
import re
import sys


def main() -> int:
    from grpc_tools import protoc

    here = pathlib.Path(__file__).resolve().parent
    rc = protoc.main([
        "grpc_tools.protoc",
        f"-I{here}",
        f"--python_out={here}",
        f"--pyi_out={here}",
        f"--grpc_python_out={here}",
        str(here / "kvflow.proto"),
    ])
    if rc != 0:
        return rc
    grpc_file = here / "kvflow_pb2_grpc.py"
    text = grpc_file.read_text()
    text = re.sub(r"^import kvflow_pb2 as", "from . import kvflow_pb2 as", text, flags=re.M)
    grpc_file.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
