"""Regenerate ``etcd_pb2.py`` (and its ``.pyi``) from ``etcd.proto`` with grpcio-tools' bundled protoc:

    python -m ciuicflow.kvflow.discovery.regenerate

Messages only: the client calls etcd's methods by path (etcd.py), so there is no service stub to keep."""
import pathlib
import sys


def main() -> int:
    from grpc_tools import protoc

    here = pathlib.Path(__file__).resolve().parent
    return protoc.main(["grpc_tools.protoc", f"-I{here}", f"--python_out={here}", f"--pyi_out={here}",
                        str(here / "etcd.proto")])


if __name__ == "__main__":
    sys.exit(main())
