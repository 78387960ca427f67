"""``ciuicflow doctor``'s arguments and command."""
from __future__ import annotations

import json
import sys

from ciuicflow.doctor.diagnosis import diagnose
from ciuicflow.doctor.output import format_diagnosis


def add_arguments(parser) -> None:
    parser.add_argument("--topo-file", metavar="FILE",
                        help="a saved `nvidia-smi topo -m` output to read instead of running it "
                        "('-': stdin)")
    parser.add_argument("--sys-root", metavar="DIR", default="/sys",
                        help="read DIR in place of /sys (class/infiniband, class/net, module)")
    parser.add_argument("--nodes", type=int, metavar="N",
                        help="nodes the job will use (default: WORLD_SIZE / LOCAL_WORLD_SIZE "
                        "when set, else advice for both one and several nodes)")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH",
                        help="write the diagnosis as JSON to PATH ('-' or no PATH: stdout)")


def run(args) -> int:
    if args.nodes is not None and args.nodes < 1:
        print("ciuicflow doctor: error: --nodes must be >= 1", file=sys.stderr)
        return 2
    topo_text, source = None, None
    if args.topo_file:
        try:
            if args.topo_file == "-":
                topo_text, source = sys.stdin.read(), "stdin"
            else:
                with open(args.topo_file, encoding="utf-8") as handle:
                    topo_text, source = handle.read(), args.topo_file
        except OSError as exc:
            print(f"ciuicflow doctor: error: cannot read {args.topo_file}: {exc}", file=sys.stderr)
            return 2
    try:
        diagnosis = diagnose(topo_text, sys_root=args.sys_root, nodes=args.nodes,
                             topology_source=source)
    except ValueError as exc:
        print(f"ciuicflow doctor: error: {exc}", file=sys.stderr)
        return 2
    if args.json == "-":
        print(json.dumps(diagnosis.as_dict(), indent=2))
    else:
        print(format_diagnosis(diagnosis))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as handle:
                json.dump(diagnosis.as_dict(), handle, indent=2)
    return diagnosis.exit_code
