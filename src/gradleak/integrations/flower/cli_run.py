"""Run a Flower app with Flower's own CLI (``flwr run``) in a private Flower home, and stop what it started.

``flwr run APP`` in simulation mode starts a local SuperLink in the background and leaves it running; two
runs on one machine share ``~/.flwr`` and Flower's default ports. :func:`run_app` gives a run its own
``FLWR_HOME`` and free ports, runs the app from the Python environment that calls it (Flower does not
install the app's dependencies: ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION``), and afterwards stops,
by PID, every process that inherited this run's own token (``GRADLEAK_FLWR_RUN``, a fresh UUID in the
environment ``flwr run`` starts with: the SuperLink, its simulation, Ray's workers), and nothing else.
gradleak's tests and benchmarks drive the quickstart with it; a CI job can drive its own audited app so.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

TOKEN = "GRADLEAK_FLWR_RUN"  # the environment variable that marks one run's processes


@dataclass(frozen=True)
class FlwrRun:
    """How one ``flwr run`` ended: its exit status and output, and how many processes were stopped."""

    returncode: int
    stdout: str
    stderr: str
    stopped: int

    def tail(self, chars: int = 3000) -> str:
        return self.stdout[-chars:] + self.stderr[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_started(token: str) -> int:
    """Stop, by PID, every process whose environment holds ``GRADLEAK_FLWR_RUN = token`` (SIGTERM, then
    SIGKILL after 15 s); how many there were."""
    import psutil  # Ray's dependency: present wherever Flower's simulation is

    mine = []
    for proc in psutil.process_iter():
        try:
            if proc.pid != os.getpid() and proc.environ().get(TOKEN) == token:
                mine.append(proc)
        except psutil.Error:
            continue
    for proc in mine:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(mine, timeout=15)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    return len(mine)


def run_app(
    app: Path,
    home: Path,
    *,
    supernodes: int,
    run_config: tuple[str, ...] = (),
    timeout: float = 600.0,
) -> FlwrRun:
    """``flwr run app --stream`` on ``supernodes`` simulated SuperNodes with ``run_config`` overrides
    (``key=value``), in Flower home ``home``, on free ports; then :func:`stop_started` of its token."""
    bin_dir = Path(sys.executable).parent
    token = uuid.uuid4().hex
    env = {**os.environ, TOKEN: token, "FLWR_HOME": str(home),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(free_port())}  # fmt: skip
    command = [str(bin_dir / "flwr"), "run", str(app), "--stream", "--federation-config",
               f"num-supernodes={supernodes}"]  # fmt: skip
    for item in run_config:
        command += ["--run-config", item]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    finally:
        stopped = stop_started(token)
    return FlwrRun(done.returncode, done.stdout, done.stderr, stopped)
