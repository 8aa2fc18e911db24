"""The control channel between controller and workers: JSON over HTTP (stdlib http.server/urllib).

Loopback by default. Bound anywhere else, the controller refuses to start without a token and TLS
(resilient_jax.elastic.tls), and every request must carry the token (`Authorization: Bearer
<token>`, compared in constant time) inside the TLS connection. The TLS handshake runs on the
connection's own thread, so a plaintext or wrong-CA client is dropped there without holding up
anyone else's requests.
Training never waits on this channel while membership is unchanged: heartbeats run on their own
thread and tolerate a briefly unreachable controller.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import socket
import ssl
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

ROUTES = {
    ("POST", "/register"): "register",
    ("POST", "/heartbeat"): "heartbeat",
    ("POST", "/world"): "wait_world",
    ("POST", "/reform"): "reform",
    ("POST", "/fault"): "fault",
    ("POST", "/progress"): "progress",
    ("POST", "/precompiled"): "precompiled",
    ("POST", "/resumed"): "resumed",
    ("POST", "/adopted"): "adopted",
    ("POST", "/failed"): "failed",
    ("POST", "/done"): "done",
    ("POST", "/drain"): "drain",
    ("GET", "/status"): "status",
}


class Refused(Exception):
    """A request the controller rejects; the worker sees `message` verbatim."""

    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


class ControllerError(RuntimeError):
    pass


class ControllerUnreachable(ControllerError):
    """No answer within the retry window: the controller is gone (its run is over) or cut off --
    unlike a refusal, which is the controller's answer."""


def is_loopback(bind: str) -> bool:
    if bind == "localhost":
        return True
    try:
        return ipaddress.ip_address(bind).is_loopback
    except ValueError:
        return False


def check_bind(bind: str, token: str, tls: bool = False) -> None:
    if is_loopback(bind):
        return
    missing = ([] if token else ["runtime.token (or $RESILIENT_JAX_TOKEN)"]) + (
        [] if tls else ["runtime.tls=auto (or runtime.tls=files with runtime.tls_cert, runtime.tls_key, runtime.tls_ca)"])
    if missing:
        raise ValueError(f"runtime.bind is {bind}, not loopback: set {' and '.join(missing)} so that only your "
                         "workers can talk to the controller, and not in clear text")


def free_port(bind: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


HANDSHAKE_SECONDS = 10.0  # a client that connects and says nothing is dropped after this
# A connection that stops mid-request (after the handshake, or on plaintext loopback) is dropped
# after this, so silent or trickling clients cannot pile up handler threads.
REQUEST_SECONDS = 30.0
MAX_BODY_BYTES = 8 << 20  # control messages are small; a larger body is refused unread


def serve(target: Any, bind: str, port: int, token: str,
          tls: ssl.SSLContext | None = None) -> ThreadingHTTPServer:
    """Serve `target`'s handler methods (see ROUTES) on a background thread; over TLS with `tls`."""

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_SECONDS  # socketserver applies it to the connection in setup()

        def _handle(self, method: str) -> None:
            name = ROUTES.get((method, self.path.split("?")[0]))
            if name is None:
                return self._reply(404, {"error": f"no route {method} {self.path}"})
            if token and not hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {token}"):
                return self._reply(401, {"error": "wrong or missing token: pass the run's runtime.token"})
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                return self._reply(400, {"error": "bad request: Content-Length is not a number"})
            if length > MAX_BODY_BYTES:
                self.close_connection = True
                return self._reply(413, {"error": f"request body of {length} bytes (at most {MAX_BODY_BYTES})"})
            try:
                raw = self.rfile.read(length) if length else b""
            except OSError:  # a client that went silent mid-body (REQUEST_SECONDS) or vanished
                raw = b""
            if len(raw) < length:  # it vanished before its whole body came (a killed worker): no one to answer
                self.close_connection = True
                return None
            try:
                body = json.loads(raw) if raw else {}
            except ValueError as e:
                return self._reply(400, {"error": f"bad request to {self.path}: not JSON ({e})"})
            if not isinstance(body, dict):
                return self._reply(400, {"error": f"bad request to {self.path}: not a JSON object"})
            try:
                result = getattr(target, name)(**body)
                self._reply(200, result)
            except Refused as e:
                self._reply(e.code, {"error": e.message})
            except TypeError as e:  # unknown or missing fields
                self._reply(400, {"error": f"bad request to {self.path}: {e}"})

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            self._handle("GET")

        def do_POST(self) -> None:  # noqa: N802
            self._handle("POST")

        def _reply(self, code: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)  # a client gone by now: QuietHTTPServer.handle_error

        def log_message(self, fmt: str, *args: Any) -> None:
            log.debug("controller: " + fmt, *args)

    try:
        server = (TlsHTTPServer((bind, port), Handler, tls) if tls is not None
                  else QuietHTTPServer((bind, port), Handler))
    except OSError as e:  # an address not on this machine, a port in use or privileged: the user's keys
        raise ValueError(f"runtime.bind {bind}, runtime.port {port}: the controller cannot listen there "
                         f"({e.strerror or e}); use an address of this machine and a free port (0: any)") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="controller-http", daemon=True).start()
    return server


class QuietHTTPServer(ThreadingHTTPServer):
    """socketserver prints a traceback to stderr for any error in a connection; the controller's
    stderr is the user's console, and a peer that reset its connection is not their concern. Any
    other error is ours and goes to the log with its traceback."""

    def handle_error(self, request, client_address) -> None:
        error = sys.exc_info()[1]
        if isinstance(error, OSError):
            log.debug("controller: the connection from %s broke: %s", client_address[0], error)
        else:
            log.error("controller: a request from %s failed", client_address[0], exc_info=True)


class TlsHTTPServer(QuietHTTPServer):
    """Accepts on the serving thread, handshakes on the connection's thread (not in accept, where one
    silent client would stall every other)."""

    def __init__(self, address, handler, context: ssl.SSLContext):
        self.context = context
        super().__init__(address, handler)

    def finish_request(self, request, client_address) -> None:
        request.settimeout(HANDSHAKE_SECONDS)
        try:
            request = self.context.wrap_socket(request, server_side=True)
        except (ssl.SSLError, OSError) as e:
            # A plaintext client, one that does not trust our CA, or a port scanner: not our run's.
            log.warning("controller: refused a connection from %s: TLS handshake failed (%s)", client_address[0], e)
            request.close()
            return
        request.settimeout(None)
        try:
            super().finish_request(request, client_address)
        finally:
            self.shutdown_request(request)


def check_controller_url(url: str) -> None:
    """A controller address a worker may send the run's token to: https, or http on this machine
    (the controller refuses to serve plain http off loopback: `check_bind`). A typo'd http:// to
    another machine would hand the token to whoever answers there, in clear text, unverified."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url} is not a controller address (expected https://HOST:PORT, as the controller prints it)")
    if parts.scheme == "http" and not is_loopback(parts.hostname):
        raise ValueError(f"{url} is plain http to another machine: the run's token would cross the network in clear "
                         "text to an unverified server; use the https:// address the controller prints (runtime.tls)")


class ControllerClient:
    def __init__(self, url: str, token: str = "", *, ca_pem: str = "", timeout: float = 30.0):
        """`ca_pem`: the CA an https controller's certificate must chain to (default: the system's)."""
        check_controller_url(url)
        self.url = url.rstrip("/")
        self.port = urllib.parse.urlsplit(self.url).port
        self.token = token
        self.timeout = timeout
        self.context = None
        if self.url.startswith("https:"):
            from resilient_jax.elastic.tls import client_context

            self.context = client_context(ca_pem)

    def call(self, path: str, *, retry_seconds: float = 30.0, method: str = "POST", **body: Any) -> dict:
        """One request; connection failures are retried for `retry_seconds` (controller restarts,
        brief partitions); a refusal raises ControllerError with the controller's message."""
        deadline = time.monotonic() + retry_seconds
        data = None if method == "GET" else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        while True:
            request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=self.timeout, context=self.context) as response:
                    return json.loads(response.read() or b"{}")
            except urllib.error.HTTPError as e:
                try:
                    message = json.loads(e.read()).get("error", str(e))
                except ValueError:
                    message = str(e)
                raise ControllerError(message) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                if isinstance(reason, ssl.SSLCertVerificationError):  # retrying cannot fix it
                    raise ControllerError(f"the controller at {self.url} is not the one this run trusts: "
                                          f"{reason.verify_message} (check the CA: --tls-ca / runtime.tls_ca)") from None
                if time.monotonic() > deadline:
                    raise ControllerUnreachable(f"controller at {self.url} unreachable: {e}") from None
                time.sleep(0.2)
