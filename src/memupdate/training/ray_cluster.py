"""One Ray cluster across the nodes of a Slurm allocation, then one command on its head.

A multi-node training rule (Snakemake resources ``nodes=N, tasks=N, gres="gpu:G", tasks_per_gpu=0,
mpi="srun"``) runs its shell in the batch step, and ``srun`` starts one task per node::

    srun python -m memupdate.training.ray_cluster --shared-dir <run>/ray -- python -m memupdate.verl_ext.main_ppo ...

Every task runs :func:`run_ray_cluster` with its rank (``SLURM_PROCID``):

- rank 0 starts the Ray head (``ray start --head --block``), waits until it answers, and writes its
  address atomically to ``<shared-dir>/<cluster id>.head.json``;
- every other rank waits for that file and joins (``ray start --address <head> --block``);
- rank 0 waits until ``ray.nodes()`` shows all N nodes alive (or fails after ``timeout``, naming the
  ranks that joined), runs the command with ``RAY_ADDRESS`` set, so main_ppo's ``ray.init()`` joins this
  cluster instead of starting its own, and then writes ``<cluster id>.stop`` with the exit code. A
  ``python -m MODULE`` command imports its module while the head starts (:mod:`memupdate.training.ray_gate`)
  and runs once the nodes joined;
- on that file every rank stops its own Ray node; rank 0 exits with the command's exit code.

The cluster uses Ray's token authentication with a token of its own: rank 0 writes a fresh one to
``<shared-dir>/<cluster id>.token`` (mode 0600) before the head starts, and every ``ray start``, the
readiness check and the command find it through ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN_PATH``, the
only way Ray takes them. Without this the outcome would depend on ``~/.ray/auth_token``: Ray 2.60
creates that file on the first local ``ray.init()``, ``ray start --head`` then turns authentication on,
and a joining node or driver given an explicit address does not, so it is refused.

Stopping is scoped to this cluster: each rank sends SIGTERM to the ``ray start --block`` process it
started, whose handler stops exactly that node's Ray processes. ``ray stop`` would kill every Ray process
of the user on the host: another job's, or the other "node" when two share a host.

Several nodes on one host (CI runs two slurmd daemons on one machine) must not collide:

- each node gets its own ``--temp-dir`` (session, sockets, logs);
- ports Ray would take from fixed defaults are random instead: worker ports (``--min-worker-port 0
  --max-worker-port 0``, each worker binds a free port) and the dashboard agent's HTTP port (default 52365);
  the head's GCS and Ray-client ports (6379, 10001 by default) are picked free unless given; the head starts no
  dashboard (8265). Every other Ray port is random already.

On a cluster:

- each node gives Ray the IPv4 address of the network interface ``--node-ip-interface`` names (default
  ``$MEMUPDATE_NODE_IP_INTERFACE``, e.g. ``ib0``; unset: Ray's guess, the default route's address);
- under Slurm Ray counts the CPUs Slurm gave the task (``SLURM_CPUS_PER_TASK``, else ``SLURM_CPUS_ON_NODE``),
  not the host's, unless ``--num-cpus`` says otherwise (the CPU platform does);
- a node's temp dir too long for Ray's socket paths moves to a short one under ``/tmp``;
- the soft limit of open files (``ulimit -n``) is raised to the hard limit for the Ray processes.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import resource
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import ray

from memupdate.utils.io import write_json_atomic
from memupdate.utils.logging import setup_logging
from memupdate.utils.system import free_port, stop_process, tail

logger = logging.getLogger(__name__)

# Spelled out: under `python -m` this module's __name__ is "__main__".
MODULE = "memupdate.training.ray_cluster"
GATE_MODULE = "memupdate.training.ray_gate"
#: The network interface whose address each node gives Ray (e.g. ib0), set where the workflow starts.
NODE_IP_INTERFACE_ENV = "MEMUPDATE_NODE_IP_INTERFACE"
# The plasma socket is <temp dir>/session_<date>_<time>_<usec>_<pid>/sockets/plasma_store: 64 characters
# after the temp dir, and an AF_UNIX path holds at most 107 bytes.
AF_UNIX_PATH_MAX = 107
MAX_TEMP_DIR_LEN = AF_UNIX_PATH_MAX - 64
#: Where a node's temp dir goes when the one under $TMPDIR (or --temp-root) is too long.
SHORT_TEMP_ROOT = Path("/tmp")
POLL_S = 0.5
#: Starts of the head before its start-up fails (see _start_head).
HEAD_START_ATTEMPTS = 3
# How long a `ray start --block` gets to stop its node after SIGTERM before it is killed.
STOP_TIMEOUT_S = 60.0


class RayClusterError(RuntimeError):
    """The cluster could not be formed; the message names the ranks and their logs."""


@dataclass(frozen=True)
class ClusterFiles:
    """The files ranks share, in a directory every node sees."""

    shared_dir: Path
    cluster_id: str

    @property
    def head(self) -> Path:
        return self.shared_dir / f"{self.cluster_id}.head.json"

    @property
    def stop(self) -> Path:
        return self.shared_dir / f"{self.cluster_id}.stop"

    @property
    def token(self) -> Path:
        return self.shared_dir / f"{self.cluster_id}.token"

    def log(self, rank: int) -> Path:
        return self.shared_dir / f"{self.cluster_id}.rank{rank}.ray.log"

    def auth_env(self) -> dict[str, str]:
        """The environment that makes a Ray process use this cluster's token."""
        return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token)}

    def stopped(self, rank: int) -> Path:
        return self.shared_dir / f"{self.cluster_id}.rank{rank}.stopped"


def slurm_rank(env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """``(rank, number of nodes)`` of this Slurm task: one task per node, so the task rank is the node's.
    Outside Slurm (no job, no task variables) this machine is the one node: ``(0, 1)``."""
    rank = env.get("SLURM_PROCID", env.get("SLURM_NODEID"))
    nnodes = env.get("SLURM_NNODES", env.get("SLURM_JOB_NUM_NODES"))
    if rank is None and nnodes is None and "SLURM_JOB_ID" not in env:
        return 0, 1
    if rank is None or nnodes is None:
        raise RayClusterError(
            "SLURM_PROCID and SLURM_NNODES are not set: run this under `srun` (one task per node) or set them by hand"
        )
    rank_, nnodes_ = int(rank), int(nnodes)
    if not 0 <= rank_ < nnodes_:
        raise RayClusterError(f"rank {rank_} is outside 0..{nnodes_ - 1}")
    return rank_, nnodes_


def _ray_executable() -> str:
    # The `ray` script of this interpreter's environment, so every node runs the same Ray as the driver.
    script = Path(sys.executable).with_name("ray")
    return str(script) if script.exists() else "ray"


def ray_start_argv(
    *,
    node_ip: str,
    temp_dir: Path,
    node_name: str,
    head_address: str | None = None,
    port: int | None = None,
    client_port: int | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: Mapping[str, float] | None = None,
    object_store_memory: int | None = None,
) -> list[str]:
    """``ray start ... --block`` for the head (``head_address`` None: give ``port`` and ``client_port``)
    or a worker joining ``head_address``."""
    if len(os.fsencode(temp_dir)) > MAX_TEMP_DIR_LEN:
        raise RayClusterError(
            f"Ray temp dir {temp_dir} is longer than {MAX_TEMP_DIR_LEN} bytes: Ray's socket paths "
            "under it would exceed the AF_UNIX limit; use a shorter --temp-root"
        )
    argv = [_ray_executable(), "start"]
    if head_address is None:
        if port is None or client_port is None:
            raise ValueError("the head needs its GCS port and Ray-client port")
        argv += ["--head", "--port", str(port), "--ray-client-server-port", str(client_port)]
        # No dashboard: nothing reads it, and on a CPU node its processes cost start-up time and memory.
        argv += ["--include-dashboard=false"]
    else:
        argv += ["--address", head_address]
    argv += [
        "--node-ip-address",
        node_ip,
        "--node-name",
        node_name,
        "--temp-dir",
        str(temp_dir),
        "--dashboard-agent-listen-port",
        "0",
        "--min-worker-port",
        "0",
        "--max-worker-port",
        "0",
        "--disable-usage-stats",
        "--block",
    ]
    for flag, value in (
        ("--num-cpus", num_cpus),
        ("--num-gpus", num_gpus),
        ("--object-store-memory", object_store_memory),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if resources:
        argv += ["--resources", json.dumps(dict(resources), sort_keys=True)]
    return argv


def interface_ipv4(interface: str, addresses: Mapping[str, Sequence] | None = None, host: str | None = None) -> str:
    """The IPv4 address of network interface ``interface`` (``addresses``: :func:`psutil.net_if_addrs`' mapping,
    read when None); a :class:`RayClusterError` naming the node and its interfaces if it has no such address.

    >>> from types import SimpleNamespace as A
    >>> interface_ipv4("ib0", {"ib0": [A(family=socket.AF_INET6, address="fe80::1"),
    ...                                A(family=socket.AF_INET, address="10.1.0.7")]})
    '10.1.0.7'
    """
    addresses = psutil.net_if_addrs() if addresses is None else addresses
    ipv4 = {name: [a.address for a in entries if a.family == socket.AF_INET] for name, entries in addresses.items()}
    if ipv4.get(interface):
        return ipv4[interface][0]
    host = host or socket.gethostname()
    have = ", ".join(f"{name} ({', '.join(ips) or 'no IPv4'})" for name, ips in sorted(ipv4.items())) or "none"
    why = "has no IPv4 address" if interface in ipv4 else "does not exist"
    raise RayClusterError(
        f"node {host}: network interface {interface!r} ({NODE_IP_INTERFACE_ENV} or --node-ip-interface) {why} "
        f"there; its interfaces: {have}"
    )


def node_ip_address(node_ip: str | None, interface: str | None, nnodes: int) -> str:
    """This node's address for Ray: ``node_ip``, else ``interface``'s IPv4 address, else Ray's guess (the
    default route's), with a warning when that is a loopback address other nodes cannot reach."""
    if node_ip and interface:
        raise RayClusterError(f"give a node IP ({node_ip}) or an interface ({interface}), not both")
    if node_ip:
        return node_ip
    if interface:
        address = interface_ipv4(interface)
        logger.info("node %s: Ray uses %s of interface %s", socket.gethostname(), address, interface)
        return address
    address = ray.util.get_node_ip_address()
    if nnodes > 1 and ipaddress.ip_address(address).is_loopback:
        logger.warning(
            "node %s: Ray's guess of this node's address is %s, a loopback address the other nodes cannot reach; "
            "set %s to the interface of the cluster's network (e.g. ib0 or eth0)",
            socket.gethostname(),
            address,
            NODE_IP_INTERFACE_ENV,
        )
    return address


def slurm_num_cpus(env: Mapping[str, str] = os.environ) -> int | None:
    """The CPUs Slurm gave this task (one task per node): ``SLURM_CPUS_PER_TASK``, else ``SLURM_CPUS_ON_NODE``;
    None outside Slurm, where Ray counts the machine's. Ray's own count ignores Slurm's cpuset: it sees every
    CPU of the host.

    >>> slurm_num_cpus({"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "32", "SLURM_CPUS_ON_NODE": "64"})
    32
    >>> slurm_num_cpus({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "64"}), slurm_num_cpus({})
    (64, None)
    """
    if "SLURM_JOB_ID" not in env:
        return None
    for name in ("SLURM_CPUS_PER_TASK", "SLURM_CPUS_ON_NODE"):
        if env.get(name, "").strip().isdigit():
            return int(env[name])
    return None


def ray_temp_dir(root: str | os.PathLike, cluster_id: str, rank: int) -> Path:
    """This node's Ray temp dir, ``<root>/ray-<cluster id>-<rank>``; if that is too long for Ray's socket paths
    (:data:`MAX_TEMP_DIR_LEN` bytes: an AF_UNIX path holds 107, and Ray adds 64 below it), one under
    :data:`SHORT_TEMP_ROOT` (node-local), logged.

    >>> str(ray_temp_dir("/tmp", "42.1", 0))
    '/tmp/ray-42.1-0'
    >>> str(ray_temp_dir("/scratch/local/slurm-job-1234567/tmp/very/deep", "1234567", 1))
    '/tmp/ray-1234567-1'
    """
    wanted = Path(root) / f"ray-{cluster_id}-{rank}"
    if len(os.fsencode(wanted)) <= MAX_TEMP_DIR_LEN:
        return wanted
    short = SHORT_TEMP_ROOT / f"ray-{cluster_id}-{rank}"
    if len(os.fsencode(short)) > MAX_TEMP_DIR_LEN:
        short = SHORT_TEMP_ROOT / f"ray-{hashlib.sha256(cluster_id.encode()).hexdigest()[:10]}-{rank}"
    logger.warning(
        "Ray temp dir %s is %d bytes, more than the %d Ray's socket paths leave (AF_UNIX: %d): using %s; give "
        "--temp-root (or TMPDIR) a short node-local folder to choose another",
        wanted,
        len(os.fsencode(wanted)),
        MAX_TEMP_DIR_LEN,
        AF_UNIX_PATH_MAX,
        short,
    )
    return short


def raise_open_files_limit(rlimit=resource) -> tuple[int, int]:
    """Raise the soft limit of open files (``ulimit -n``) to the hard limit, for the Ray processes this one
    starts (each raylet and worker holds many sockets); returns ``(old, new)``. Linux caps an unlimited
    hard limit at ``fs.nr_open``. ``rlimit`` is the :mod:`resource` module (a stand-in in tests)."""
    soft, hard = rlimit.getrlimit(rlimit.RLIMIT_NOFILE)
    target = hard
    if hard == rlimit.RLIM_INFINITY:
        try:
            target = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            target = 1 << 20
    if soft == rlimit.RLIM_INFINITY or soft >= target:
        return soft, soft
    try:
        rlimit.setrlimit(rlimit.RLIMIT_NOFILE, (target, hard))
    except (OSError, ValueError) as err:
        logger.warning("could not raise the open files limit (ulimit -n) from %d to %d: %s", soft, target, err)
        return soft, soft
    logger.info("open files limit (ulimit -n) raised from %d to %d (the hard limit) for Ray", soft, target)
    return soft, target


def _write_token(path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(secrets.token_hex(32))
    os.replace(tmp, path)


def _start_node(argv: list[str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    # On SIGTERM Ray first drains the node for up to 30 s so serving traffic can move; when we stop a
    # node the job is over, so there is nothing to drain.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    logger.info("starting Ray node: %s (log %s)", " ".join(argv), log_path)
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def _node_processes(proc: subprocess.Popen) -> list[psutil.Process]:
    """The processes of the node ``proc`` (a ``ray start --block``) started, while it runs."""
    try:
        return psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
    except psutil.NoSuchProcess:
        return []


def _stop_node(proc: subprocess.Popen, known: Sequence[psutil.Process] = ()) -> None:
    """SIGTERM to our own ``ray start --block``: it stops its node's processes and exits. Whatever of its
    process tree outlives it (Ray's agents hang when the GCS is already gone) is killed by PID, and so are the
    process groups its workers started in sessions of their own (a rollout server's vLLM and its engine:
    Ray kills a worker's children, which orphans their own children). ``known``: its processes as last seen,
    for a ``ray start`` that has exited already and left them orphaned."""
    tree = _node_processes(proc)
    tree += [p for p in known if p not in tree]
    groups = {_pgid(p) for p in tree} - {None, os.getpgid(0)}
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            logger.warning("ray start (pid %d) did not stop within %.0f s: killing it", proc.pid, STOP_TIMEOUT_S)
            proc.kill()
            proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=5)
    if alive:
        logger.warning("killing Ray processes left behind by ray start (pid %d): %s", proc.pid, alive)
        for leftover in alive:
            leftover.kill()
        psutil.wait_procs(alive, timeout=5)
    for pgid in groups:
        _stop_group(pgid)


def _pgid(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except OSError:
        return None


def _stop_group(pgid: int, timeout_s: float = 30.0) -> None:
    """SIGTERM process group ``pgid``, SIGKILL what is left of it after ``timeout_s``."""
    members = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if _pgid(process) == pgid and process.status() != psutil.STATUS_ZOMBIE:
                members.append(process)
    if not members:
        return
    logger.info("stopping process group %d started by the node's workers: %s", pgid, [p.pid for p in members])
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    _, alive = psutil.wait_procs(members, timeout=timeout_s)
    if alive:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        psutil.wait_procs(alive, timeout=10)


class HeadStartError(RayClusterError):
    """The head's ``ray start`` exited before its GCS and its Ray client server listened."""


def _wait_for_ports(proc: subprocess.Popen, ports: Sequence[int], log_path: Path, deadline: float) -> None:
    """Until the head's own processes listen on every one of ``ports`` (its GCS's and its Ray client server's): a
    connection alone could reach a process that took a port after it was picked. The head's ray start then exits
    (after about 40 s of Ray's retries for the GCS port; at once when the client server cannot bind, which once
    happened after the GCS was up, and the run failed when its driver connected)."""
    while True:
        if proc.poll() is not None:
            raise HeadStartError(
                f"the Ray head exited with {proc.returncode} while starting; {log_path}:\n{tail(log_path, 20) or '(no log)'}"
            )
        processes = _node_processes(proc)
        missing = [port for port in ports if not any(_listens(p, port) for p in processes)]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RayClusterError(f"the Ray head did not listen on port {missing[0]} in time; see {log_path}")
        time.sleep(POLL_S)


def _listens(process: psutil.Process, port: int) -> bool:
    try:
        connections = process.net_connections(kind="tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr.port == port for c in connections)


def _start_head(node_argv: dict, port: int | None, log_path: Path, deadline: float) -> tuple[subprocess.Popen, int]:
    """The head's ``ray start`` with its GCS and its Ray client server listening, and the GCS port. Ports it picks
    itself are free when picked and bound seconds later; another process can take one meanwhile (a vLLM server
    starting beside it once did, and once an outgoing connection's source port took the client server's), and the
    head then exits: it is started again on ports picked anew, up to :data:`HEAD_START_ATTEMPTS` times, unless
    ``port`` was given."""
    node_ip = node_argv["node_ip"]
    for attempt in range(1, HEAD_START_ATTEMPTS + 1):
        gcs_port = port or free_port(node_ip)
        client_port = free_port(node_ip)
        proc = _start_node(ray_start_argv(port=gcs_port, client_port=client_port, **node_argv), log_path)
        try:
            _wait_for_ports(proc, (gcs_port, client_port), log_path, deadline)
            return proc, gcs_port
        except HeadStartError as err:
            _stop_node(proc)
            if port is not None or attempt == HEAD_START_ATTEMPTS or time.monotonic() > deadline:
                raise
            logger.warning("%s\nstarting the head again on other ports (attempt %d)", err, attempt + 1)
        except BaseException:
            _stop_node(proc)
            raise
    raise AssertionError("unreachable")


def _wait_for_nodes(files: ClusterFiles, nnodes: int, deadline: float, timeout: float, joined: set[int]) -> None:
    """Poll ``ray.nodes()`` (from a connected driver) until ``nnodes`` are alive; ``joined`` is kept up to
    date with the ranks seen so far, for the caller's clean-up."""
    while True:
        alive = sorted(node["NodeName"] for node in ray.nodes() if node["Alive"])
        joined |= {int(m.group(1)) for name in alive if (m := re.search(r"rank(\d+)$", name))}
        if len(alive) >= nnodes:
            logger.info("all %d Ray nodes joined: %s", nnodes, ", ".join(alive))
            return
        if time.monotonic() > deadline:
            missing = [r for r in range(nnodes) if r not in joined]
            logs = ", ".join(str(files.log(r)) for r in missing)
            raise RayClusterError(
                f"only {len(alive)} of {nnodes} Ray nodes joined within {timeout:.0f} s: joined {alive}, "
                f"missing ranks {missing} (their logs: {logs})"
            )
        time.sleep(POLL_S)


def _wait_for_workers(files: ClusterFiles, ranks: Sequence[int]) -> None:
    """Wait until the worker ranks whose nodes joined have stopped them: a raylet stopping after the
    head cannot unregister from the GCS and leaves its agents behind."""
    deadline = time.monotonic() + STOP_TIMEOUT_S
    pending = [r for r in ranks if not files.stopped(r).exists()]
    while pending and time.monotonic() < deadline:
        time.sleep(POLL_S)
        pending = [r for r in pending if not files.stopped(r).exists()]
    if pending:
        logger.warning("ranks %s did not report their Ray node stopped; stopping the head anyway", pending)


def _run_head(
    command: Sequence[str],
    files: ClusterFiles,
    nnodes: int,
    node_argv: dict,
    port: int | None,
    timeout: float,
) -> int:
    deadline = time.monotonic() + timeout
    for stale in (files.head, files.stop, *(files.stopped(r) for r in range(1, nnodes))):
        if stale.exists():
            logger.warning("removing %s left by an earlier run with cluster id %s", stale, files.cluster_id)
            stale.unlink()
    _write_token(files.token)
    proc: subprocess.Popen | None = None
    exit_code = 1
    joined: set[int] = set()
    seen: list[psutil.Process] = []  # the head's processes, kept up to date while the command runs
    waiting = _start_gated(command)
    try:
        proc, port = _start_head(node_argv, port, files.log(0), deadline)
        address = f"{node_argv['node_ip']}:{port}"
        on_sigterm = signal.getsignal(signal.SIGTERM)
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        try:
            write_json_atomic(files.head, {"address": address, "cluster_id": files.cluster_id, "nnodes": nnodes})
            _wait_for_nodes(files, nnodes, deadline, timeout, joined)
        finally:
            ray.shutdown()
            # ray.init installs its own SIGTERM handler and shutdown leaves the default one: a cancelled job
            # would then die at once, leaving its Ray node and the trainer running. Ours stops them.
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGTERM, on_sigterm)
        logger.info("running on the Ray cluster at %s: %s", address, " ".join(command))
        exit_code = _run_command(command, address, proc, files.log(0), seen, waiting)
        logger.info("command exited with %d", exit_code)
        return exit_code
    finally:
        if waiting is not None and waiting.poll() is None:  # the cluster did not start: the command never runs
            waiting.kill()
            waiting.wait()
        # Also on failure: the other ranks wait for this file.
        write_json_atomic(files.stop, {"exit_code": exit_code})
        _wait_for_workers(files, sorted(joined - {0}))
        if proc is not None:
            _stop_node(proc, seen)


def _start_gated(command: Sequence[str]) -> subprocess.Popen | None:
    """A ``python -m MODULE ...`` command started through :mod:`memupdate.training.ray_gate`, importing its module
    while the cluster starts; it runs once :func:`_run_command` gives it the address. Other commands: None (they
    start then)."""
    if len(command) < 3 or command[1] != "-m":
        return None
    return subprocess.Popen([command[0], "-m", GATE_MODULE, *command[2:]], stdin=subprocess.PIPE, text=True)


def _run_command(
    command: Sequence[str],
    address: str,
    head: subprocess.Popen,
    head_log: Path,
    seen: list[psutil.Process],
    waiting: subprocess.Popen | None,
) -> int:
    """Run ``command`` on the cluster at ``address`` (``waiting``, its gated start, if there is one) and return its
    exit code; end it and raise if the head's ``ray start --block`` exits meanwhile (one of the head's processes
    died). The command's driver would otherwise wait for the GCS for Ray's reconnection timeout: a run once sat 14
    minutes on a dead head. ``seen`` is kept up to date with the head's processes, which a ``ray start`` that exits
    this way leaves behind."""
    if waiting is None:
        child = subprocess.Popen(list(command), env={**os.environ, "RAY_ADDRESS": address})
    else:
        child = waiting
        with contextlib.suppress(BrokenPipeError):  # it exited already (an import failed): its exit code says so
            child.stdin.write(f"{address}\n")
            child.stdin.close()
    next_look = 0.0
    try:
        while (code := child.poll()) is None:
            if time.monotonic() >= next_look:
                seen[:] = [*seen, *(p for p in _node_processes(head) if p not in seen)]
                next_look = time.monotonic() + 5.0
            if head.poll() is not None:
                logger.error("the Ray head stopped under the command: stopping the command (pid %d)", child.pid)
                stop_process(child, STOP_TIMEOUT_S)
                raise RayClusterError(
                    f"the Ray head's node stopped while the command ran (ray start exited with {head.returncode}); "
                    f"{head_log}:\n{tail(head_log, 20) or '(no log)'}"
                )
            time.sleep(POLL_S)
        return code
    finally:
        if child.poll() is None:  # this process is being stopped (SIGTERM, Ctrl-C): the command goes with it
            child.kill()
            child.wait()


def _wait_for_head(files: ClusterFiles, rank: int, deadline: float) -> str:
    while not files.head.exists():
        if files.stop.exists():
            raise RayClusterError(f"rank {rank}: rank 0 stopped before its head started; see {files.log(0)}")
        if time.monotonic() > deadline:
            raise RayClusterError(f"rank {rank}: no Ray head address in {files.head} in time; see {files.log(0)}")
        time.sleep(POLL_S)
    return json.loads(files.head.read_text())["address"]


def _run_worker(files: ClusterFiles, rank: int, node_argv: dict, timeout: float) -> int:
    try:
        address = _wait_for_head(files, rank, time.monotonic() + timeout)
        proc = _start_node(ray_start_argv(head_address=address, **node_argv), files.log(rank))
        try:
            while not files.stop.exists():
                if proc.poll() is not None:
                    raise RayClusterError(
                        f"rank {rank}: ray start exited with {proc.returncode}; {files.log(rank)}:\n"
                        f"{tail(files.log(rank), 20) or '(no log)'}"
                    )
                time.sleep(POLL_S)
            return 0
        finally:
            _stop_node(proc)
    finally:
        # Rank 0 stops the head only after every rank reported (see _wait_for_workers).
        write_json_atomic(files.stopped(rank), {"rank": rank})


def run_ray_cluster(
    command: Sequence[str],
    *,
    shared_dir: str | os.PathLike,
    rank: int,
    nnodes: int,
    cluster_id: str = "local",
    port: int | None = None,
    node_ip: str | None = None,
    node_ip_interface: str | None = None,
    num_cpus: int | None = None,
    num_gpus: int | None = None,
    resources: Mapping[str, float] | None = None,
    object_store_memory: int | None = None,
    temp_root: str | os.PathLike | None = None,
    timeout: float = 300.0,
) -> int:
    """Run this rank's part of the cluster (see the module docstring); rank 0 returns the command's exit
    code, other ranks 0 once rank 0 says stop.

    ``shared_dir`` must be visible to every node; ``cluster_id`` (the Slurm job id) keeps the files of
    different jobs apart. ``timeout`` bounds the start-up: the head coming up and every node joining.
    ``node_ip_interface`` names the interface whose address this node gives Ray (:func:`node_ip_address`);
    ``num_cpus`` None is Slurm's count under Slurm (:func:`slurm_num_cpus`).
    """
    cluster_id = re.sub(r"[^\w.-]", "_", cluster_id)
    files = ClusterFiles(Path(shared_dir).resolve(), cluster_id)
    files.shared_dir.mkdir(parents=True, exist_ok=True)
    try:
        node_ip = node_ip_address(node_ip, node_ip_interface, nnodes)
    except RayClusterError as err:
        # Rank 0's start-up error names the missing ranks' logs: the reason is there too.
        with open(files.log(rank), "a", encoding="utf-8") as log:
            log.write(f"{err}\n")
        raise
    if num_cpus is None and (num_cpus := slurm_num_cpus()) is not None:
        logger.info("Ray node of rank %d offers the %d CPUs Slurm gave its task", rank, num_cpus)
    raise_open_files_limit()
    # Ray reads its authentication settings only from the environment. Set here, in the launcher's own
    # process, they reach the Ray nodes it starts, its readiness check and the command it runs; Ray caches
    # its config on import, so it is read again (what ray.init does when it turns token auth on itself).
    os.environ.update(files.auth_env())
    ray._raylet.Config.initialize("")
    node_argv = {
        "node_ip": node_ip,
        "temp_dir": ray_temp_dir(temp_root or tempfile.gettempdir(), cluster_id, rank),
        # Ends in "rank<r>" so a failed start-up can tell which ranks are missing.
        "node_name": f"{socket.gethostname()}-rank{rank}",
        "num_cpus": num_cpus,
        "num_gpus": num_gpus,
        "resources": resources,
        "object_store_memory": object_store_memory,
    }
    if rank == 0:
        if not command:
            raise ValueError("rank 0 needs a command to run on the cluster")
        return _run_head(command, files, nnodes, node_argv, port, timeout)
    return _run_worker(files, rank, node_argv, timeout)


def cluster_command(
    command: Sequence[str], *, shared_dir: str | os.PathLike, python: str = sys.executable, **options: object
) -> list[str]:
    """``python -m memupdate.training.ray_cluster ... -- <command>``, for ``srun`` to start on every node.

    ``options`` are the CLI flags by their :func:`run_ray_cluster` names (``port=6380``, ``num_gpus=4``,
    ``resources={"cpu_slot": 2}``); None leaves a flag out.
    """
    argv = [python, "-m", MODULE, "--shared-dir", os.path.abspath(shared_dir)]
    for name, value in options.items():
        if value is not None:
            text = json.dumps(dict(value), sort_keys=True) if isinstance(value, Mapping) else str(value)
            argv += [f"--{name.replace('_', '-')}", text]
    return [*argv, "--", *command]


def _default_cluster_id() -> str:
    # A requeued job keeps its id; the restart count keeps the new attempt off the old attempt's files.
    job = os.environ.get("SLURM_JOB_ID")
    if job is None:
        return "local"
    restart = os.environ.get("SLURM_RESTART_COUNT")
    return f"{job}.{restart}" if restart else job


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"python -m {MODULE}", description=__doc__.split("\n\n")[0] if __doc__ else None
    )
    parser.add_argument("--shared-dir", required=True, help="folder every node sees (head address, stop file, logs)")
    parser.add_argument("--cluster-id", default=_default_cluster_id(), help="default: the Slurm job id, or 'local'")
    parser.add_argument("--port", type=int, help="the head's GCS port (default: a free port)")
    parser.add_argument("--node-ip", help="this node's address (default: Ray's guess)")
    parser.add_argument(
        "--node-ip-interface",
        default=os.environ.get(NODE_IP_INTERFACE_ENV) or None,
        help=f"network interface whose IPv4 address each node gives Ray, e.g. ib0 (default: ${NODE_IP_INTERFACE_ENV}; "
        "unset: Ray's guess, the default route's)",
    )
    parser.add_argument("--num-cpus", type=int, help="default: Slurm's CPUs of the task, else Ray's count")
    parser.add_argument("--num-gpus", type=int)
    parser.add_argument("--resources", type=json.loads, help="custom Ray resources of each node, as JSON")
    parser.add_argument("--object-store-memory", type=int, help="bytes")
    parser.add_argument("--temp-root", help="parent of each node's short Ray temp dir (default: $TMPDIR or /tmp)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for the head to start and all to join")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command rank 0 runs")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Slurm cancels and time limits send SIGTERM; setup_logging makes it exit through SystemExit, which runs the
    # `finally` blocks that stop this rank's Ray node and, on rank 0, tell the other ranks to stop.
    setup_logging()
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        rank, nnodes = slurm_rank()
        return run_ray_cluster(
            command,
            shared_dir=args.shared_dir,
            rank=rank,
            nnodes=nnodes,
            cluster_id=args.cluster_id,
            port=args.port,
            node_ip=args.node_ip,
            node_ip_interface=args.node_ip_interface,
            num_cpus=args.num_cpus,
            num_gpus=args.num_gpus,
            resources=args.resources,
            object_store_memory=args.object_store_memory,
            temp_root=args.temp_root,
            timeout=args.timeout,
        )
    except RayClusterError as err:
        logger.error("%s", err)
        return 1


if __name__ == "__main__":
    sys.exit(main())
