"""Command-line options shared by the benchmarks that train the MLP on the simulated cluster
(bench/comm, bench/onebit/adam.py): the cluster's shape and link, and the model and steps."""


def add_cluster_arguments(p, *, params_help: str = "MLP size in parameters (default 25e6)") -> None:
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--rate", default="1gbit", help="inter-node rate per node, e.g. 1gbit, 200mbit; 'none': unshaped")
    p.add_argument("--params", default="25e6", help=params_help)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--steps", type=int, default=10, help="measured steps per method")
