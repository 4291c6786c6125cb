"""`agentzip-blk node-agent`: keep the scopes in step with this node's annotated Pods
(fleet.k8s.nodeagent)."""

from __future__ import annotations

import argparse
import json
import logging
import os

from ._common import CliError, run_dir_of


def register(sub) -> None:
    s = sub.add_parser("node-agent", help="add this node's annotated Pods to the scopes",
                       description="Keep the scopes in step with this node's Pods annotated "
                                   "agentzip.io/enable: \"true\". Example: agentzip-blk "
                                   "node-agent --source api --node $NODE_NAME --once")
    s.add_argument("--source", choices=("api", "kubelet"), default="api",
                   help="list Pods from the API server with a spec.nodeName field selector "
                        "(default; RBAC: pods list) or from the kubelet's /pods (RBAC: "
                        "nodes/proxy, which the shipped manifests do not grant)")
    s.add_argument("--url", metavar="URL",
                   help="API server base (default from KUBERNETES_SERVICE_HOST/PORT) or "
                        "kubelet base (default https://127.0.0.1:10250)")
    s.add_argument("--node", metavar="NAME", help="node name (default $NODE_NAME)")
    s.add_argument("--cgroup-driver", choices=("systemd", "cgroupfs"), default="systemd",
                   help="the kubelet's cgroup driver (default systemd)")
    s.add_argument("--token-file", metavar="PATH", help="bearer token (default: service account)")
    s.add_argument("--ca-file", metavar="PATH",
                   help="CA bundle that signed the server's certificate (default for --source "
                        "api: the service account's CA; required for --source kubelet: the "
                        "kubelet's serving CA)")
    s.add_argument("--insecure", action="store_true", help=argparse.SUPPRESS)  # removed: says so
    s.add_argument("--state-dir", metavar="DIR",
                   help="where the agent records the scopes it added (default: the run dir)")
    s.add_argument("--no-release", action="store_true",
                   help="do not restore the cgroup settings of Pods that left (the tuner does "
                        "it on its next step; lets the agent run without cgroupfs or run dir)")
    s.add_argument("--kubelet-config", metavar="PATH", default="/var/lib/kubelet/config.yaml",
                   help="the kubelet's config file, whose swap settings each round reports "
                        "(default /var/lib/kubelet/config.yaml)")
    s.add_argument("--interval", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between rounds (default 30)")
    s.add_argument("--heartbeat", metavar="FILE",
                   help="write FILE after every round, for Kubernetes probes "
                        "(python -m agentzip_blk.host.heartbeat FILE --max-age S [--ready])")
    s.add_argument("--once", action="store_true", help="one round, print the result, exit")
    s.add_argument("--json", action="store_true", help="--once: print JSON")
    s.set_defaults(func=cmd_node_agent)


def cmd_node_agent(args) -> int:
    from ..fleet.k8s.nodeagent import (
        CA_PATH,
        TOKEN_PATH,
        NodeAgent,
        apiserver_url,
        http_fetch,
        kubelet_url,
    )

    if args.insecure:
        raise CliError("node-agent --insecure is no longer accepted: it sent the service "
                       "account token to an unverified peer; give the server's CA with "
                       "--ca-file (or use --source api)")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    node = args.node or os.environ.get("NODE_NAME")
    token = None
    token_file = args.token_file or (TOKEN_PATH if os.path.exists(TOKEN_PATH) else None)
    if token_file:
        try:
            with open(token_file) as f:
                token = f.read().strip()
        except OSError as e:
            raise CliError(f"node-agent --token-file {token_file}: {e.strerror}") from None
    if args.source == "api":
        if not node:
            raise CliError("node-agent --source api needs --node NAME (or NODE_NAME)")
        base = args.url or "https://{}:{}".format(os.environ.get("KUBERNETES_SERVICE_HOST", ""),
                                                  os.environ.get("KUBERNETES_SERVICE_PORT", "443"))
        url = apiserver_url(base, node)
        cafile = args.ca_file or (CA_PATH if os.path.exists(CA_PATH) else None)
    else:
        if not args.ca_file:
            raise CliError("node-agent --source kubelet needs --ca-file (the CA that signed "
                           "the kubelet's serving certificate): the token is never sent to "
                           "an unverified kubelet")
        url = kubelet_url(args.url or "https://127.0.0.1:10250")
        cafile = args.ca_file
    for path in (cafile,):
        if path and not os.path.isfile(path):
            raise CliError(f"node-agent --ca-file {path}: no such file")
    fetch = http_fetch(token, cafile)
    agent = NodeAgent(fetch, url, args.cgroup_driver, args.config, run_dir_of(args), node,
                      release=not args.no_release, state_dir=args.state_dir,
                      kubelet_config=args.kubelet_config)
    if args.once:
        res = agent.run_once()
        print(json.dumps(res.to_dict(), sort_keys=True) if args.json else
              f"{len(res.wanted)} Pods in scope; added {res.added or '-'}, "
              f"removed {res.removed or '-'}; invalid {len(res.invalid)}; "
              f"skipped {len(res.skipped)}; kubelet swap: "
              f"{(res.kubelet or {}).get('detail', '-')}")
        return 0
    agent.run(args.interval, heartbeat=args.heartbeat)
    return 0
