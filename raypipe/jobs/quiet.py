"""What a `raypipe` command prints of Ray's own output unless `--verbose`: what a user should read.

Two kinds of noise are left out: the warning Ray 2.60 logs on every new local cluster that token
authentication is on by default (the mode itself is untouched: a driver joining a cluster must keep
the cluster's `RAY_AUTH_MODE`), and Ray Data's multi-line progress bars (a batch job prints one
progress line of its own). `--verbose` keeps both and forwards the workers' logs to the terminal.
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
