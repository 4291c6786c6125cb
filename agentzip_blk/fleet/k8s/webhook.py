"""Mutating admission webhook (AdmissionReview ``admission.k8s.io/v1``) over HTTPS.

For a Pod CREATE:

- no ``agentzip.io/`` annotation: allowed, no patch (the webhook is a no-op for other Pods);
- valid annotations: allowed, with a JSONPatch that records the validated request in
  ``agentzip.io/admission`` (``{"enabled": true, "compression_level": 3}``); warnings (e.g.
  a level on a disabled Pod) go to the response's ``warnings``;
- invalid annotations: denied, status code 400 with a message naming every bad annotation.

Anything else (other kinds, DELETE, CONNECT) is allowed untouched. The response always
echoes ``request.uid``. The HTTP server is the stdlib's (``http.server`` + ``ssl``, TLS 1.2+):
it has one route, ``POST /mutate`` (also ``/``), JSON in and out, bodies up to 4 MiB;
``GET /healthz`` answers ``ok`` for the readiness probe.

A malformed review never takes the server down or goes unanswered: anything ``review``
raises becomes one log line and an HTTP 400 for that request alone.

Certificate rotation (cert-manager renews the Secret; the kubelet swaps the mounted files
through a symlink): every new connection compares the (inode, size, mtime) of the cert and
key files with those the current ``SSLContext`` was built from, and builds a new one when
they differ. A pair that does not load (cert renewed, key not yet) keeps the old context
and is retried on the next connection: no restart, no window without a certificate.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import annotations as ann

log = logging.getLogger(__name__)

API_VERSION = "admission.k8s.io/v1"
MAX_BODY = 4 << 20


class BadReview(ValueError):
    """The body is not an AdmissionReview v1 request (HTTP 400, no review response)."""


def _escape(key: str) -> str:
    """RFC 6901 JSON Pointer escaping of one path segment."""
    return key.replace("~", "~0").replace("/", "~1")


def patch_for(pod: dict, settings: ann.PodSettings) -> list[dict]:
    metadata = pod.get("metadata") or {}
    value = settings.record()
    if not metadata.get("annotations"):  # cannot add below a missing object
        return [{"op": "add", "path": "/metadata/annotations", "value": {ann.RECORD: value}}]
    op = "replace" if ann.RECORD in metadata["annotations"] else "add"
    return [{"op": op, "path": f"/metadata/annotations/{_escape(ann.RECORD)}", "value": value}]


def review(body: dict) -> dict:
    """AdmissionReview request -> AdmissionReview response (pure; the HTTP layer is thin)."""
    if not isinstance(body, dict) or body.get("apiVersion") != API_VERSION \
            or body.get("kind") != "AdmissionReview":
        raise BadReview(f"expected apiVersion {API_VERSION} kind AdmissionReview")
    req = body.get("request")
    if not isinstance(req, dict) or not isinstance(req.get("uid"), str):
        raise BadReview("AdmissionReview without request.uid")
    resp: dict = {"uid": req["uid"], "allowed": True}
    out = {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": resp}
    kind = req.get("kind") or {}
    pod = req.get("object")
    if kind.get("kind") != "Pod" or kind.get("group", "") != "" or not isinstance(pod, dict) \
            or req.get("operation") not in ("CREATE", "UPDATE"):
        return out
    md = pod.get("metadata")
    md = md if isinstance(md, dict) else {}
    name = md.get("name") or md.get("generateName", "") or req.get("name", "")
    where = f"{req.get('namespace', '')}/{name}"
    try:
        settings = ann.parse(md.get("annotations"))
    except ann.AnnotationError as e:
        resp["allowed"] = False
        resp["status"] = {"code": 400, "reason": "Invalid", "message": f"agentzip: {e}"}
        log.info("denied %s: %s", where, e)
        return out
    if settings is None:
        return out
    if settings.warnings:
        resp["warnings"] = [f"agentzip: {w}" for w in settings.warnings]
    patch = patch_for(pod, settings)
    resp["patchType"] = "JSONPatch"
    resp["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    log.info("admitted %s: %s", where, settings.record())
    return out


class Handler(BaseHTTPRequestHandler):
    server_version = "agentzip-webhook"
    protocol_version = "HTTP/1.1"

    def _send(self, code: int, payload: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] == "/healthz":
            self._send(200, b"ok", "text/plain")
        else:
            self._send(404, b"not found", "text/plain")

    def do_POST(self) -> None:  # noqa: N802
        if self.path.split("?")[0] not in ("/mutate", "/"):
            self._send(404, b'{"error": "not found: POST /mutate"}')
            return
        try:
            n = int(self.headers.get("Content-Length", "-1"))
        except ValueError:
            n = -1
        if n < 0 or n > MAX_BODY:
            self._send(413 if n > MAX_BODY else 411, b"bad Content-Length", "text/plain")
            self.close_connection = True
            return
        raw = self.rfile.read(n)
        try:
            out = review(json.loads(raw))
        except (ValueError, BadReview) as e:  # JSONDecodeError is a ValueError
            self._send(400, json.dumps({"error": str(e)}).encode())
            return
        except Exception as e:  # a shape review() did not foresee: this request fails alone
            log.warning("malformed review from %s: %s: %s", self.address_string(),
                        type(e).__name__, e)
            self._send(400, json.dumps({"error": f"malformed AdmissionReview: "
                                                 f"{type(e).__name__}"}).encode())
            return
        self._send(200, json.dumps(out).encode())

    def log_message(self, fmt: str, *args) -> None:  # route to logging, not stderr
        log.debug("%s " + fmt, self.address_string(), *args)


def tls_context(certfile: str, keyfile: str) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(certfile, keyfile)
    return ctx


def _signature(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)  # follows the kubelet's ..data symlink: a swap changes the inode
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class ReloadingContext:
    """The server's SSLContext, rebuilt when the cert or key file changes (see the module
    docstring). ``current()`` is called once per accepted connection."""

    def __init__(self, certfile: str, keyfile: str):
        self.certfile, self.keyfile = certfile, keyfile
        self._lock = threading.Lock()
        self._sig = (_signature(certfile), _signature(keyfile))
        self._ctx = tls_context(certfile, keyfile)  # the first load must work: fail at start

    def current(self) -> ssl.SSLContext:
        try:
            sig = (_signature(self.certfile), _signature(self.keyfile))
        except OSError as e:  # mid-swap: a file briefly missing; keep serving the old pair
            log.warning("TLS files: %s; keeping the loaded certificate", e)
            return self._ctx
        if sig == self._sig:
            return self._ctx
        with self._lock:
            if sig != self._sig:
                try:
                    self._ctx = tls_context(self.certfile, self.keyfile)
                except (ssl.SSLError, OSError) as e:
                    log.warning("new TLS certificate does not load yet (%s); keeping the "
                                "old one", e)
                    return self._ctx
                self._sig = sig
                log.info("TLS certificate reloaded from %s", self.certfile)
        return self._ctx


class TLSServer(ThreadingHTTPServer):
    """Handshake per connection in its handler thread: a slow client stalls only itself."""

    daemon_threads = True

    def __init__(self, addr, handler, context: ssl.SSLContext | ReloadingContext):
        self.contexts = context
        super().__init__(addr, handler)

    def get_request(self):
        sock, addr = super().get_request()
        c = self.contexts
        ctx = c.current() if isinstance(c, ReloadingContext) else c
        return ctx.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr

    def finish_request(self, request, client_address):
        request.settimeout(30)
        try:
            request.do_handshake()
        except (ssl.SSLError, OSError) as e:
            log.debug("TLS handshake from %s: %s", client_address, e)
            return
        super().finish_request(request, client_address)


def make_server(listen: tuple[str, int], certfile: str, keyfile: str) -> TLSServer:
    return TLSServer(listen, Handler, ReloadingContext(certfile, keyfile))
