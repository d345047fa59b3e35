"""A multi-node Ray cluster with a real autoscaler on one machine: the `fake_multinode` provider.

`ray start --head --autoscaling-config=...` with `RAY_FAKE_CLUSTER=1` runs Ray's own autoscaler,
which "launches" worker nodes as extra raylets on this machine with the resources the node type
declares (fake GPUs included) and terminates them after `idle_timeout_minutes`. Scale-up and
scale-down are then the autoscaler's real decisions, driven by real pending resource demands.

Ray's `AutoscalingCluster` helper is not used: in Ray 2.60 it reads a yaml that the wheel lacks
and runs `ray stop --force`, which kills every Ray on the machine. Instead this cluster has its own
temp dir and free ports, and `stop()` kills only processes whose command line names that temp dir,
so other Ray clusters on the machine live on. Drivers must join with the same `RAY_AUTH_MODE`
(`run_as_driver`).
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

AUTH_MODE = "disabled"  # head, fake nodes and drivers must agree (token auth is on by default)


def run_as_driver() -> None:
    """Make this process fit to drive a fake cluster: restart it once with `RAY_AUTH_MODE` set to
    the cluster's, unless it already started with it.

    Ray fixes a process's auth mode before any bench code runs (`raypipe.cli` imports ray), so
    setting the variable later is too late. A driver left in token mode (inherited from a parent
    that called `ray.init()`, which exports RAY_AUTH_MODE=token) joins, but the GCS takes every
    actor the driver owns as out of scope and cancels it before it starts (most likely because the
    driver, in token mode, refuses the GCS's token-less calls about its references):
    Serve's actors (its detached controller's) live on, a batch job's pool actors all die
    ("The actor never ran").
    """
    if os.environ.get("RAY_AUTH_MODE") != AUTH_MODE:
        sys.stdout.flush()
        os.execve(sys.executable, sys.orig_argv, {**os.environ, "RAY_AUTH_MODE": AUTH_MODE})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def client_server_port() -> int:
    """A free port outside 10002-19999, the range Ray hands out to worker processes."""
    while True:
        port = free_port()
        if not 10002 <= port <= 19999:
            return port


def _alive_pids() -> set[int]:
    alive = set()
    for entry in pathlib.Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(int(entry.name))
        except OSError:
            pass
    return alive


class FakeCluster:
    """Head node with `head_resources` (no GPUs) plus autoscaled worker types.

    `worker_types` maps a node type name to `{"resources": {...}, "min_workers": n, "max_workers": m}`.
    """

    def __init__(self, worker_types: dict[str, dict], head_resources: dict | None = None,
                 idle_timeout_minutes: float = 0.1, upscaling_speed: float = 1.0, env: dict | None = None):
        self.worker_types = worker_types
        self.head_resources = head_resources or {"CPU": 2}
        self.idle_timeout_minutes = idle_timeout_minutes
        self.upscaling_speed = upscaling_speed
        self._new_home()
        # The autoscaler decides every AUTOSCALER_UPDATE_INTERVAL_S (5 s by default); each scale-up or -down waits
        # for a decision, so 1 s takes seconds off every phase of a test-sized cycle.
        self.env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", **(env or {}), "RAY_FAKE_CLUSTER": "1",
                    "RAY_AUTH_MODE": AUTH_MODE}

    def _new_home(self) -> None:
        # Short: Unix socket paths under it must stay below ~107 characters.
        self.temp_dir = pathlib.Path(tempfile.mkdtemp(prefix="rpfc-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"

    def autoscaling_config(self) -> dict:
        worker_types = {name: {"node_config": {}, "min_workers": 0, **spec} for name, spec in self.worker_types.items()}
        return {
            "cluster_name": "raypipe-fake",
            "max_workers": sum(spec["max_workers"] for spec in self.worker_types.values()),
            "upscaling_speed": self.upscaling_speed,
            "idle_timeout_minutes": self.idle_timeout_minutes,
            "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                         "disable_launch_config_check": True, "gcs_address": self.address},
            "auth": {"ssh_user": "nobody"},
            "available_node_types": {
                "ray.head.default": {"resources": self.head_resources, "node_config": {}, "max_workers": 0},
                **worker_types},
            "head_node_type": "ray.head.default",
            "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
            "initialization_commands": [], "setup_commands": [], "head_setup_commands": [],
            "worker_setup_commands": [], "head_start_ray_commands": [], "worker_start_ray_commands": [],
        }

    def start(self, attempts: int = 3) -> "FakeCluster":
        """Start the head; retried because Ray gives a raylet 30 s to register, which an overloaded
        machine can miss ("The current node timed out during startup")."""
        for attempt in range(attempts):
            try:
                return self._start_head()
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
                self._new_home()  # the failed attempt's processes and temp dir are gone (stop())

    def _start_head(self, timeout_s: float = 180.0) -> "FakeCluster":
        config_path = self.temp_dir / "autoscaling.json"
        config_path.write_text(json.dumps(self.autoscaling_config()))
        head = self.head_resources
        custom = {k: v for k, v in head.items() if k not in ("CPU", "GPU")}
        command = [
            str(pathlib.Path(sys.executable).parent / "ray"), "start", "--head",
            f"--port={self.port}", f"--temp-dir={self.temp_dir}", f"--autoscaling-config={config_path}",
            f"--num-cpus={head.get('CPU', 0)}", "--num-gpus=0", f"--resources={json.dumps(custom)}",
            "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
            f"--ray-client-server-port={client_server_port()}", "--dashboard-agent-listen-port=0",
        ]
        try:
            result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        except BaseException:
            self.stop()  # a half-started head must not outlive us
            raise
        if result.returncode != 0:
            self.stop()
            raise RuntimeError(f"ray start --head failed:\n{result.stdout}\n{result.stderr}")
        return self

    def own_pids(self) -> set[int]:
        """Live processes whose command line names this cluster's temp dir, and their descendants.

        Plus the head's Ray Client server: it cannot be turned off, is orphaned at start and names
        only this cluster's GCS address (a port this cluster holds, so no other cluster's).

        Descendants: the raylets' agents and worker processes rename themselves (`ray::IDLE`,
        `ray::DashboardAgent`) and outlive a killed raylet, but they are its children. Zombies
        (PID 1 here does not reap) have an empty command line and a `Z` state: never counted.
        """
        children, named = {}, set()
        marker = str(self.temp_dir).encode()
        gcs_arg = f":{self.port}\0".encode()
        for entry in pathlib.Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue  # exited meanwhile
            state, ppid = stat.rsplit(")", 1)[1].split()[:2]
            if state == "Z":
                continue
            children.setdefault(int(ppid), []).append(int(entry.name))
            if marker in cmdline or (b"ray.util.client.server" in cmdline and gcs_arg in cmdline):
                named.add(int(entry.name))
        own, todo = set(), list(named)
        while todo:
            pid = todo.pop()
            if pid not in own:
                own.add(pid)
                todo.extend(children.get(pid, []))
        return own

    def node_count(self) -> int:
        """Nodes alive now (head included), counted as this cluster's raylet processes: no Ray connection needed."""
        marker = str(self.temp_dir).encode()
        count = 0
        for pid in self.own_pids():
            try:
                cmdline = pathlib.Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            count += cmdline.split(b"\0", 1)[0].endswith(b"/raylet") and marker in cmdline
        return count

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL, every process of this cluster and nothing else; remove the temp dir."""
        targets = self.own_pids()  # collected while the raylets live: their children are found through them
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
            for pid in targets:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                targets = (targets | self.own_pids()) & _alive_pids()
                if not targets:
                    break
                time.sleep(0.2)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> "FakeCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
