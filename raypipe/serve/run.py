"""`raypipe serve`: start the Serve application on a local (or the running) Ray and block until Ctrl-C.

It refuses a port something already listens on (Serve's proxy would share it), and keeps its log
to what a user should read: no "Connecting to existing Serve app" note for the Serve it has just
started itself, and no controller-retry noise on a clean stop of a Ray it owns (`ray.shutdown`
stops Serve with everything else).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import socket
import sys
import time

APP_NAME = "raypipe"


def run_serve(args) -> int:
    import ray
    from ray import serve

    from raypipe.models.registry import resolve_model
    from raypipe.runtime.ray_cluster import connect_ray

    try:
        check_port_free(args.host, args.port)
    except OSError as exc:
        print(f"raypipe: could not start serving: {exc}", file=sys.stderr, flush=True)
        return 1
    from raypipe.serve.app import AppArgs, build_app  # heavy imports only once the port is known to be free
    from raypipe.serve.proxy_errors import CONTROLLER_OPTIONS

    resolve_model(args.model)  # write a preset once here, before several replicas race to
    owns_ray = not ray.is_initialized()
    connect_ray()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        # The proxies answer a dead replica's requests with OpenAI error bodies (raypipe/serve/proxy_errors.py).
        serve.start(http_options={"host": args.host, "port": args.port}, controller_options=CONTROLLER_OPTIONS)
        api_key = args.api_key or os.environ.get("RAYPIPE_API_KEY")
        shared = {name: getattr(args, name) for name in AppArgs.model_fields if hasattr(args, name)}
        app = build_app(AppArgs(**{**shared, "api_key": api_key}))
        with _quiet_reconnect_note():
            serve.run(app, name=APP_NAME, route_prefix="/")  # returns once every replica is healthy
        print(f"raypipe: serving {args.model!r} at http://{args.host}:{args.port}/v1 "
              f"(API key {'on' if api_key else 'off'}); Ctrl-C stops", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("raypipe: shutting down", file=sys.stderr, flush=True)
        return 0
    except Exception as exc:  # noqa: BLE001 - a failed deploy is reported, not dumped
        print(f"raypipe: could not start serving: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        if owns_ray:
            ray.shutdown()  # takes Serve down with it, without Serve's controller-retry warnings
        else:
            serve.shutdown()  # a shared cluster: remove only our application and Serve


def check_port_free(host: str, port: int) -> None:
    """Raise if something listens on `host:port` already.

    Serve's proxy binds with SO_REUSEPORT, so a second server on a taken port would "start" and
    the kernel would split connections between the two (with an API key on only one of them, half
    the connections would skip authentication). A plain bind, without port reuse, finds out first.
    """
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine; a listener is not
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(exc.errno, f"port {port} on {host} is already in use (another server is "
                                         "listening there); pick another --port") from None
            raise


@contextlib.contextmanager
def _quiet_reconnect_note():
    """serve.run() reconnects to the Serve that serve.start() just started with our HTTP options, and
    says at INFO that "new http_options will not be applied": true, but there were none to apply."""
    def drop(record: logging.LogRecord) -> bool:
        return "Connecting to existing Serve app" not in record.getMessage()

    logger = logging.getLogger("ray.serve")
    logger.addFilter(drop)
    try:
        yield
    finally:
        logger.removeFilter(drop)


def _interrupt(*_):
    raise KeyboardInterrupt
