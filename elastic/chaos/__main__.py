"""`python -m elastic.chaos`: run chaos scenarios against the GPT recipe on this machine.

    python -m elastic.chaos --scenario kill-worker --scenario node-loss
    python -m elastic.chaos --scenario all --backend etcd-v3      # starts an etcd of its own
    python -m elastic.chaos --scenario kill-worker --backend etcd-v3 --endpoint 127.0.0.1:2379
    sudo python -m elastic.chaos --scenario partition --hosts netns
    python -m elastic.chaos --scenario kill-worker --scenario node-loss --fsdp   # the model sharded (FSDP2)
    python -m elastic.chaos --scenario node-loss+scale-up   # one job: a node lost, then one joins
    python -m elastic.chaos audit runs/samples   # the exactly-once audit of any job's sample records

Each scenario starts a fresh job of two torchrun agents (`--nnodes=2:3`, or 1:3
for node-loss, scale-up and partition), injects its fault once training is
under way, waits for the end and prints one line: exit codes, the step
reached, recovery time from the event log, whether the final checkpoint
verifies, and the exactly-once audit of the samples trained on. With `--hosts
netns` each agent runs in a network namespace of its own, as a host with its
own address (root only); `partition` needs that. `--fsdp` trains the recipe
with its model sharded (FSDP2, `recipes/gpt.py --fsdp`) instead of DDP.
`--backend etcd-v3` without
`--endpoint` starts an etcd of its own (the `etcd` binary), which the
`etcd-restart` scenario stops and starts again. Exit status: 0 when every
scenario passed, 1 when one failed (its agents' logs are kept in --workdir),
2 on usage.
"""

from __future__ import annotations

import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

from elastic._shared.common.cli import OneLineArgumentParser, positive_int, run_main
from elastic._shared.common.errors import ElasticError, UsageError
from elastic._shared.protocol.heal_env import MODES, RESTART
from elastic.chaos import audit_cli
from elastic.chaos.etcd import EtcdServer
from elastic.chaos.job_spec import find_recipe
from elastic.chaos.netns import VirtualNetwork
from elastic.chaos.scenarios import NEEDS_NETWORK, NEEDS_OWN_ETCD, parse_chain, run_scenario
from elastic.chaos.strikes import SCENARIOS


def build_parser() -> OneLineArgumentParser:
    p = OneLineArgumentParser(prog="python -m elastic.chaos", description=__doc__.split("\n\n")[0],
                              epilog="python -m elastic.chaos audit PREFIX: the exactly-once audit of any job's sample records")
    p.add_argument(
        "--scenario", action="append", required=True, metavar="|".join([*SCENARIOS, "all"]),
        help="fault to inject (repeatable; 'all' runs every one, each in a job of its own); several joined by + "
        "share one job, one fault after the other (node-loss+scale-up)",
    )
    p.add_argument("--backend", choices=["c10d", "etcd-v3"], default="c10d")
    p.add_argument(
        "--endpoint", default=None,
        help="etcd HOST:PORT (etcd-v3; default: start one here); with --hosts netns a loopback HOST means this "
        "machine as the hosts see it, so etcd must listen on 0.0.0.0",
    )
    p.add_argument(
        "--hosts", choices=["loopback", "netns"], default="loopback",
        help="agents on this machine's loopback, or each on a host of its own (network namespaces; root)",
    )
    p.add_argument("--launcher", choices=["ours", "stock"], default="ours", help="elastic._agent.launcher or plain torchrun")
    p.add_argument("--steps", type=positive_int, default=None, help="steps of each job (default: 40; more for node-loss, scale-up, partition)")
    p.add_argument(
        "--fsdp", action="store_true",
        help="train the recipe with --fsdp: parameters, gradients and optimizer state sharded (FSDP2) instead of DDP",
    )
    p.add_argument(
        "--survivors", choices=list(MODES), default=RESTART,
        help="TORCHREVIVE_SURVIVORS for the agents: restart every worker after a fault (default), keep the "
        "others' processes and wait for the replacement, or keep them and train on without it",
    )
    p.add_argument("--data", default=None, help="text for the recipe (default: this package's own sources)")
    p.add_argument("--recipe", default=None, help="the GPT recipe to run (default: recipes/gpt.py of this checkout)")
    p.add_argument("--workdir", default=None, help="keep jobs' logs, events and checkpoints here (default: temporary)")
    p.add_argument("--seed", type=int, default=0)
    return p


def as_seen_from_hosts(endpoint: str, gateway: str) -> str:
    """etcd endpoints (`HOST:PORT` or URLs, comma-separated) as the namespaced hosts
    reach them: a loopback host is this machine, which they see at `gateway`."""
    rewritten = []
    for item in endpoint.split(","):
        scheme, sep, rest = item.strip().rpartition("://")
        host, colon, port = rest.rpartition(":")
        if host in ("127.0.0.1", "localhost", "[::1]"):
            rest = f"{gateway}{colon}{port}"
        rewritten.append(f"{scheme}{sep}{rest}")
    return ",".join(rewritten)


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    if given[:1] == ["audit"]:  # python -m elastic.chaos audit PREFIX: the exactly-once audit alone
        return audit_cli.main(given[1:])
    args = build_parser().parse_args(argv)
    own_etcd = args.backend == "etcd-v3" and not args.endpoint
    if args.endpoint and args.backend != "etcd-v3":
        raise UsageError("--endpoint is etcd's address: it goes with --backend etcd-v3")
    if "all" in args.scenario:
        names = [
            n for n in SCENARIOS
            if (args.hosts == "netns" or n not in NEEDS_NETWORK) and (own_etcd or n not in NEEDS_OWN_ETCD)
        ]
    else:
        names = ["+".join(parse_chain(given)) for given in dict.fromkeys(args.scenario)]
    for name in names:
        members = set(name.split("+"))
        if members & NEEDS_NETWORK and args.hosts != "netns":
            raise UsageError(f"--scenario {name} cuts a host's link: it needs --hosts netns")
        if members & NEEDS_OWN_ETCD and not own_etcd:
            raise UsageError(f"--scenario {name} restarts etcd: it needs --backend etcd-v3 without --endpoint")
    recipe = find_recipe(args.recipe)
    root = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="elastic-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    data = Path(args.data) if args.data else root / "corpus.txt"
    if not args.data:
        package = Path(__file__).resolve().parents[1]
        data.write_text("".join(p.read_text() for p in sorted(package.rglob("*.py"))))
    elif not data.is_file():
        raise UsageError(f"--data {data}: no such file")
    failed = 0
    with ExitStack() as stack:
        network = stack.enter_context(VirtualNetwork.create()) if args.hosts == "netns" else None
        endpoint = as_seen_from_hosts(args.endpoint, network.gateway) if network and args.endpoint else args.endpoint
        etcd = None
        if own_etcd:
            listen = ("127.0.0.1", network.gateway) if network else ("127.0.0.1",)
            etcd = stack.enter_context(EtcdServer(root / "etcd-data", listen_hosts=listen))
        for name in names:
            result = run_scenario(
                name, root / name, data, steps=args.steps, backend=args.backend, endpoint=endpoint,
                launcher=args.launcher, seed=args.seed, network=network, etcd=etcd,
                recipe_args=["--fsdp"] if args.fsdp else [], recipe=recipe, survivors=args.survivors,
            )
            print(result.summary(), flush=True)
            failed += not result.ok
    if failed:
        raise ElasticError(f"{failed} of {len(names)} scenarios failed; logs under {root}")
    print(f"all {len(names)} scenarios passed; logs under {root}")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
