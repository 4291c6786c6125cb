"""`agentzip-blk node-agent`: keep the scopes in step with this node's annotated Pods
(fleet.k8s.nodeagent)."""

from __future__ import annotations

import json
import logging
import os

from ._common import CliError, run_dir_of


def register(sub) -> None:
    s = sub.add_parser("node-agent", help="add this node's annotated Pods to the scopes")
    s.add_argument("--source", choices=("kubelet", "api"), default="kubelet",
                   help="list Pods from the kubelet's /pods (default) or the API server")
    s.add_argument("--url", metavar="URL",
                   help="kubelet base (default https://127.0.0.1:10250) or API server base "
                        "(default from KUBERNETES_SERVICE_HOST/PORT)")
    s.add_argument("--node", metavar="NAME", help="node name (default $NODE_NAME)")
    s.add_argument("--cgroup-driver", choices=("systemd", "cgroupfs"), default="systemd",
                   help="the kubelet's cgroup driver (default systemd)")
    s.add_argument("--token-file", metavar="PATH", help="bearer token (default: service account)")
    s.add_argument("--ca-file", metavar="PATH", help="CA bundle (default: service account CA for --source api)")
    s.add_argument("--insecure", action="store_true",
                   help="do not verify the server certificate (kubelet self-signed certs)")
    s.add_argument("--interval", type=float, default=30.0, metavar="SECONDS",
                   help="seconds between rounds (default 30)")
    s.add_argument("--once", action="store_true", help="one round, print the result, exit")
    s.add_argument("--json", action="store_true", help="--once: print JSON")
    s.set_defaults(func=cmd_node_agent)


def cmd_node_agent(args) -> int:
    from ..fleet.k8s.nodeagent import (CA_PATH, TOKEN_PATH, NodeAgent, apiserver_url, http_fetch,
                                        kubelet_url)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    node = args.node or os.environ.get("NODE_NAME")
    token = None
    token_file = args.token_file or (TOKEN_PATH if os.path.exists(TOKEN_PATH) else None)
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
    if args.source == "api":
        if not node:
            raise CliError("node-agent --source api needs --node NAME (or NODE_NAME)")
        base = args.url or "https://{}:{}".format(os.environ.get("KUBERNETES_SERVICE_HOST", ""),
                                                  os.environ.get("KUBERNETES_SERVICE_PORT", "443"))
        url = apiserver_url(base, node)
        cafile = args.ca_file or (CA_PATH if os.path.exists(CA_PATH) else None)
    else:
        url = kubelet_url(args.url or "https://127.0.0.1:10250")
        cafile = args.ca_file
    fetch = http_fetch(token, cafile, insecure=args.insecure)
    agent = NodeAgent(fetch, url, args.cgroup_driver, args.config, run_dir_of(args), node)
    if args.once:
        res = agent.run_once()
        print(json.dumps(res.to_dict(), sort_keys=True) if args.json else
              f"{len(res.wanted)} Pods in scope; added {res.added or '-'}, "
              f"removed {res.removed or '-'}; invalid {len(res.invalid)}")
        return 0
    agent.run(args.interval)
    return 0
