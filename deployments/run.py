"""`raypipe serve`: start the Serve application on a local (or the running) Ray and block until Ctrl-C."""

from __future__ import annotations

import os
import signal
import sys
import time

from deployments.app import AppArgs, build_app

APP_NAME = "raypipe"


def run_serve(args) -> int:
    import ray
    from ray import serve

    from raypipe.models.presets import resolve_model
    from raypipe.pipeline import connect_ray

    resolve_model(args.model)  # write a preset once here, before several replicas race to
    owns_ray = not ray.is_initialized()
    connect_ray()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        api_key = args.api_key or os.environ.get("RAYPIPE_API_KEY")
        shared = {name: getattr(args, name) for name in AppArgs.model_fields if hasattr(args, name)}
        app = build_app(AppArgs(**{**shared, "api_key": api_key}))
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
        serve.shutdown()
        if owns_ray:
            ray.shutdown()


def _interrupt(*_):
    raise KeyboardInterrupt
