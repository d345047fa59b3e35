"""What a `raypipe` command prints of Ray's own output unless `--verbose`: what a user should read.

Left out: the warning Ray 2.60 logs on every new local cluster that token authentication is on by
default (the mode itself is untouched: a driver joining a cluster must keep the cluster's
`RAY_AUTH_MODE`), Ray Data's multi-line progress bars and its INFO lines about each execution (a batch
job prints one progress line of its own; Ray Data's log file under the session folder keeps them).
`--verbose` keeps all of it and forwards the workers' logs to the terminal.
"""

from __future__ import annotations

import logging
import os

TOKEN_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
RAY_LOGS_ENV = "RAYPIPE_RAY_LOGS"  # "1": the workers' logs on the driver's terminal (runtime.ray_cluster)


def quiet_ray() -> None:
    """Before Ray is imported: no token-auth notice, no Ray Data progress bars."""
    logging.getLogger(TOKEN_AUTH_LOGGER).addFilter(
        lambda record: "Token authentication is enabled" not in record.getMessage())
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")


def verbose_ray() -> None:
    """Everything Ray says, the workers' logs included."""
    os.environ[RAY_LOGS_ENV] = "1"


def quiet_ray_data() -> None:
    """Ray Data's terminal handler shows errors only (it logs plans, progress notes and timings at INFO and
    WARNING); its file handler is left as it is."""
    import ray.data  # noqa: F401 - configures Ray Data's logging on import

    for handler in logging.getLogger("ray.data").handlers:
        if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
            handler.setLevel(logging.ERROR)
