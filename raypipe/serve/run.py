"""`raypipe serve`: run deployments/config.yaml's application on a local (or the running) Ray until Ctrl-C.

It runs what `serve run deployments/config.yaml` runs (the packaged copy, or `--config PATH`): the
app's args, each deployment's options (autoscaling, resources), proxy_location, http_options and
controller_options. Its flags override the file's values; a key it cannot apply is refused.

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
import pathlib
import signal
import socket
import sys
import time

from raypipe.serve.kuberay import SERVE_CONFIG, load_serve_config

FLAG_ARGS = ("model", "num_encoders", "encoder_gpus", "cost_model", "api_key")  # flags that override the app's args
FLAG_HTTP = ("host", "port")  # flags that override http_options
# Flags that override the app's `engine:` args (EngineConfig fields people set most; the file holds them
# all): field -> (type, help). The CLI adds one flag each; their defaults are the file's, then EngineConfig's.
ENGINE_FLAGS = {
    "max_num_seqs": (int, "sequences decoded together per Decoder replica"),
    "max_model_len": (int, "prompt + output tokens per request (default: the model's limit, at most 4096)"),
    "max_num_batched_tokens": (int, "prompt tokens prefilled per scheduling round (longer prompts are chunked)"),
    "num_scheduler_steps": (int, "decode steps per scheduling round"),
    "dtype": (str, "language-model dtype: auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16 or float16"),
    "kv_cache_memory": (int, "bytes of the paged KV cache (default: max_num_seqs sequences of max_model_len "
                             "tokens on CPU, a fraction of the free memory on CUDA)"),
    "enable_prefix_caching": (bool, "reuse the KV cache of prompts' shared prefixes"),
    "tensor_parallel_size": (int, "devices each Decoder replica's language model spans (one GPU each on GPU "
                                  "clusters)"),
}
FLAG_ENGINE = tuple(ENGINE_FLAGS)
START_KEYS = ("proxy_location", "http_options", "grpc_options", "controller_options")  # as `serve run` passes them
APP_KEYS = {"name", "route_prefix", "import_path", "args", "deployments"}


def serve_config(args) -> dict:
    """The Serve config file (`--config`, else the packaged one) with the command line's flags applied."""
    path = pathlib.Path(args.config) if args.config else SERVE_CONFIG
    config = load_serve_config(path)
    apps = config.get("applications") or []
    if len(apps) != 1:
        raise ValueError(f"{path} has {len(apps)} applications; `raypipe serve` runs exactly one")
    unapplied = sorted(config.keys() - {*START_KEYS, "applications"}) + sorted(apps[0].keys() - APP_KEYS)
    if unapplied:
        raise ValueError(f"{path} sets {', '.join(unapplied)}, which `raypipe serve` does not apply; "
                         f"use `serve run {path}`")
    apps[0]["args"] = {**(apps[0].get("args") or {}), **_given(args, FLAG_ARGS)}
    if _given(args, FLAG_ENGINE):
        apps[0]["args"]["engine"] = {**(apps[0]["args"].get("engine") or {}), **_given(args, FLAG_ENGINE)}
    config["http_options"] = {**(config.get("http_options") or {}), **_given(args, FLAG_HTTP)}
    return config


def _given(args, names) -> dict:
    return {name: getattr(args, name) for name in names if getattr(args, name) is not None}


def run_serve(args) -> int:
    from ray.serve.schema import ServeDeploySchema

    try:
        config = serve_config(args)
        schema = ServeDeploySchema.model_validate(config)  # Serve's own checks and defaults, as `serve run`'s
        http = schema.http_options
        check_port_free(http.host, http.port)
    except (OSError, ValueError) as exc:  # a pydantic ValidationError is a ValueError
        print(f"raypipe: could not start serving: {exc}", file=sys.stderr, flush=True)
        return 1
    import ray  # heavy imports only once the port is known to be free
    from ray import serve

    from raypipe.models.registry import resolve_model
    from raypipe.runtime.ray_cluster import connect_ray
    from raypipe.serve.app import IMPORT_PATH, AppArgs, compose, deployment_options

    [app] = schema.applications
    if app.import_path != IMPORT_PATH:
        print(f"raypipe: could not start serving: `raypipe serve` runs {IMPORT_PATH}, not {app.import_path}; "
              "use `serve run`", file=sys.stderr, flush=True)
        return 1
    app_args = AppArgs.model_validate(config["applications"][0]["args"])
    if app_args.api_key is None:
        app_args.api_key = os.environ.get("RAYPIPE_API_KEY")
    resolve_model(app_args.model)  # write a preset once here, before several replicas race to
    owns_ray = not ray.is_initialized()
    connect_ray()
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops it as cleanly as Ctrl-C
    try:
        # controller_options: the proxies answer a dead replica's requests with OpenAI error bodies
        # (raypipe/serve/proxy_errors.py).
        serve.start(proxy_location=schema.proxy_location, http_options=http.model_dump(),
                    grpc_options=schema.grpc_options.model_dump(), controller_options=schema.controller_options)
        with _quiet_reconnect_note():  # returns once every replica is healthy
            serve.run(compose(app_args, deployment_options(config)), name=app.name, route_prefix=app.route_prefix)
        print(f"raypipe: serving {app_args.model!r} at http://{http.host}:{http.port}{app.route_prefix.rstrip('/')}/v1 "
              f"(API key {'on' if app_args.api_key else 'off'}); Ctrl-C stops", flush=True)
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
