"""The ``ciuicflow`` command. Each subcommand lives in its own module, imported only when used;
a subcommand module provides ``add_arguments(parser)`` and ``run(args) -> int``."""
import argparse
import sys
from importlib import import_module

# subcommand -> (module, one-line help)
SUBCOMMANDS = {
    "demo": ("ciuicflow.demo", "train on 2 simulated nodes x 2 ranks with each hook and compare"),
    "plan": ("ciuicflow.plan", "predict step time and bytes per link of each strategy for a cluster"),
    "doctor": ("ciuicflow.doctor", "check the training environment and recommend settings"),
    "report": ("ciuicflow.monitor.report", "draw charts and a summary from a recorded run"),
    "kv-demo": ("ciuicflow.kvflow.demo", "disaggregated prefill/decode through two KV-flow sidecars"),
    "vllm-demo": ("ciuicflow.integrations.vllm.demo", "two vLLM servers (prefill, decode) over two sidecars"),
}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ciuicflow", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        sub_parser.set_defaults(_module=module_name)
        try:
            import_module(module_name).add_arguments(sub_parser)
        except ModuleNotFoundError as exc:
            # only this subcommand's own module (or a package above it) may be missing
            if not (exc.name == module_name or module_name.startswith(f"{exc.name}.")):
                raise
            sub_parser.set_defaults(_missing=True)
    args = parser.parse_args(argv)
    if getattr(args, "_missing", False):
        parser.error(f"'{args.command}' is not available in this build")
    return int(import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
