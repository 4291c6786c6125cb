"""`agentzip-blk webhook`: the Kubernetes mutating admission webhook (HTTPS; fleet.k8s.webhook)."""

from __future__ import annotations

import logging

from ..fleet.metrics import parse_listen
from ._common import PROG, CliError, serve_until_interrupted


def register(sub) -> None:
    s = sub.add_parser("webhook", help="Kubernetes mutating admission webhook (HTTPS)")
    s.add_argument("--listen", default="0.0.0.0:8443", metavar="HOST:PORT",
                   help="address to serve HTTPS on (default 0.0.0.0:8443)")
    s.add_argument("--tls-cert", required=True, metavar="PEM", help="TLS certificate file")
    s.add_argument("--tls-key", required=True, metavar="PEM", help="TLS private key file")
    s.set_defaults(func=cmd_webhook)


def cmd_webhook(args) -> int:
    from ..fleet.k8s.webhook import make_server

    try:
        listen = parse_listen(args.listen)
    except ValueError as e:
        raise CliError(str(e).replace("--listen", "webhook --listen")) from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    server = make_server(listen, args.tls_cert, args.tls_key)
    print(f"{PROG}: webhook on https://{listen[0]}:{server.server_address[1]}/mutate",
          flush=True)
    return serve_until_interrupted(server)
