"""Multi-node Ray start-up for Slurm, tested without Slurm: two local processes play the two tasks that
`srun` starts inside a 2-node allocation (SLURM_PROCID=0/1, SLURM_NNODES=2) on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from memupdate.training import ray_cluster as rc
from memupdate.utils.system import free_port


def test_slurm_rank_reads_the_task_environment():
    assert rc.slurm_rank({"SLURM_PROCID": "1", "SLURM_NNODES": "2"}) == (1, 2)
    assert rc.slurm_rank({"SLURM_NODEID": "0", "SLURM_JOB_NUM_NODES": "4"}) == (0, 4)
    # Outside Slurm this machine is the one node; inside a job the task variables must be there.
    assert rc.slurm_rank({}) == (0, 1)
    with pytest.raises(rc.RayClusterError, match="srun"):
        rc.slurm_rank({"SLURM_JOB_ID": "7"})
    with pytest.raises(rc.RayClusterError, match="outside"):
        rc.slurm_rank({"SLURM_PROCID": "2", "SLURM_NNODES": "2"})


def test_ray_start_argv_avoids_fixed_ports():
    common = {"node_ip": "127.0.0.1", "temp_dir": Path("/tmp/ray-7-0"), "node_name": "h-rank0"}
    head = rc.ray_start_argv(port=6400, client_port=6401, num_cpus=1, num_gpus=0, **common)
    assert head[1:3] == ["start", "--head"] and "--block" in head
    flags = dict(zip(head[3::2], head[4::2], strict=False))
    assert (flags["--port"], flags["--ray-client-server-port"]) == ("6400", "6401")
    assert "--include-dashboard=false" in head
    worker = rc.ray_start_argv(head_address="10.0.0.1:6400", **common)
    assert worker[1:4] == ["start", "--address", "10.0.0.1:6400"]
    for argv in (head, worker):
        text = " ".join(argv)
        assert "--min-worker-port 0 --max-worker-port 0" in text
        assert "--dashboard-agent-listen-port 0" in text and "--temp-dir /tmp/ray-7-0" in text
    assert "--num-cpus" not in worker  # None leaves Ray's own detection


def test_ray_start_argv_rejects_a_temp_dir_too_long_for_unix_sockets():
    with pytest.raises(rc.RayClusterError, match="AF_UNIX"):
        rc.ray_start_argv(head_address="h:1", node_ip="h", temp_dir=Path("/" + "x" * 60), node_name="n")


def test_cluster_command_is_the_srun_payload(tmp_path):
    argv = rc.cluster_command(["python", "-c", "pass"], shared_dir=tmp_path, port=6400, num_gpus=4, node_ip=None)
    assert argv == [
        sys.executable,
        "-m",
        "memupdate.training.ray_cluster",
        "--shared-dir",
        str(tmp_path),
        "--port",
        "6400",
        "--num-gpus",
        "4",
        "--",
        "python",
        "-c",
        "pass",
    ]


def _nic(family, address):
    return SimpleNamespace(family=family, address=address)


NICS = {
    "lo": [_nic(socket.AF_INET, "127.0.0.1")],
    "eth0": [_nic(socket.AF_INET6, "fe80::1"), _nic(socket.AF_INET, "192.168.1.5")],
    "ib0": [_nic(socket.AF_INET, "10.10.0.5")],
    "ib1": [_nic(socket.AF_INET6, "fe80::2")],
}


def test_the_node_ip_is_the_named_interfaces_ipv4_address():
    assert rc.interface_ipv4("ib0", NICS) == "10.10.0.5"
    assert rc.interface_ipv4("eth0", NICS) == "192.168.1.5"
    # A node without it says which node and which interfaces it has.
    with pytest.raises(rc.RayClusterError, match=r"node gpu17: network interface 'ib2'.*does not exist") as err:
        rc.interface_ipv4("ib2", NICS, host="gpu17")
    assert "eth0 (192.168.1.5)" in str(err.value) and "ib0 (10.10.0.5)" in str(err.value)
    assert rc.NODE_IP_INTERFACE_ENV in str(err.value)
    with pytest.raises(rc.RayClusterError, match="'ib1'.*has no IPv4 address"):
        rc.interface_ipv4("ib1", NICS, host="gpu17")
    # An address given outright wins; both at once is a mistake.
    assert rc.node_ip_address("10.0.0.9", None, 2) == "10.0.0.9"
    with pytest.raises(rc.RayClusterError, match="not both"):
        rc.node_ip_address("10.0.0.9", "ib0", 2)


def test_the_interface_comes_from_the_environment_the_workflow_started_in(monkeypatch, tmp_path):
    monkeypatch.setenv(rc.NODE_IP_INTERFACE_ENV, "ib0")
    assert rc._parser().parse_args(["--shared-dir", str(tmp_path), "--", "true"]).node_ip_interface == "ib0"
    monkeypatch.delenv(rc.NODE_IP_INTERFACE_ENV)
    assert rc._parser().parse_args(["--shared-dir", str(tmp_path), "--", "true"]).node_ip_interface is None
    argv = rc.cluster_command(["true"], shared_dir=tmp_path, node_ip_interface="ib0")
    assert argv[argv.index("--node-ip-interface") + 1] == "ib0"


def test_a_node_without_the_interface_fails_before_ray_starts_saying_why_in_its_log(tmp_path):
    with pytest.raises(rc.RayClusterError, match="no-such-nic0"):
        rc.run_ray_cluster(
            ["true"], shared_dir=tmp_path, rank=1, nnodes=2, cluster_id="9", node_ip_interface="no-such-nic0"
        )
    # Rank 0's start-up error names the missing ranks' logs: the reason is there.
    assert "no-such-nic0" in (tmp_path / "9.rank1.ray.log").read_text()


def test_ray_counts_the_cpus_slurm_gave_the_task():
    assert rc.slurm_num_cpus({"SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "32", "SLURM_CPUS_ON_NODE": "64"}) == 32
    assert rc.slurm_num_cpus({"SLURM_JOB_ID": "7", "SLURM_CPUS_ON_NODE": "64"}) == 64
    # Outside Slurm, or when Slurm does not say, Ray counts the machine's CPUs itself.
    assert rc.slurm_num_cpus({"SLURM_CPUS_PER_TASK": "32"}) is None
    assert rc.slurm_num_cpus({"SLURM_JOB_ID": "7"}) is None


def test_a_temp_dir_too_long_for_rays_sockets_moves_under_tmp(caplog):
    assert rc.ray_temp_dir("/tmp", "42", 0) == Path("/tmp/ray-42-0")
    deep = "/local/scratch/slurm-1234567.batch/tmp/ray-cluster"
    with caplog.at_level("WARNING", logger=rc.__name__):
        short = rc.ray_temp_dir(deep, "1234567.2", 1)
    assert short == Path("/tmp/ray-1234567.2-1")
    assert deep in caplog.text and "/tmp/ray-1234567.2-1" in caplog.text and "--temp-root" in caplog.text
    # A cluster id too long for /tmp too is shortened to a hash of it, still one folder per job and rank.
    long_id = "x" * 60
    hashed = rc.ray_temp_dir(deep, long_id, 3)
    assert hashed.parent == Path("/tmp") and hashed.name.endswith("-3")
    assert len(str(hashed)) <= rc.MAX_TEMP_DIR_LEN and hashed != rc.ray_temp_dir(deep, "y" * 60, 3)
    # What remains is a path ray start accepts (it refuses a longer one).
    rc.ray_start_argv(head_address="h:1", node_ip="h", temp_dir=hashed, node_name="n")


class FakeRlimit:
    """The part of the resource module raise_open_files_limit uses, with its calls recorded."""

    RLIMIT_NOFILE = resource.RLIMIT_NOFILE
    RLIM_INFINITY = resource.RLIM_INFINITY

    def __init__(self, soft, hard, fail=False):
        self.limits, self.fail, self.set = (soft, hard), fail, []

    def getrlimit(self, which):
        assert which == self.RLIMIT_NOFILE
        return self.limits

    def setrlimit(self, which, limits):
        if self.fail:
            raise ValueError("not allowed")
        self.set.append(limits)
        self.limits = limits


def test_the_open_files_limit_is_raised_to_the_hard_limit(caplog):
    low = FakeRlimit(1024, 131072)
    with caplog.at_level("INFO", logger=rc.__name__):
        assert rc.raise_open_files_limit(low) == (1024, 131072)
    assert low.set == [(131072, 131072)] and "raised from 1024 to 131072" in caplog.text
    already = FakeRlimit(4096, 4096)
    assert rc.raise_open_files_limit(already) == (4096, 4096) and already.set == []
    # An unlimited hard limit: Linux allows at most fs.nr_open open files.
    unlimited = FakeRlimit(1024, resource.RLIM_INFINITY)
    old, new = rc.raise_open_files_limit(unlimited)
    assert old == 1024 and new > 1024 and unlimited.set == [(new, resource.RLIM_INFINITY)]
    # A refusal is logged, and Ray starts with the limit it has.
    assert rc.raise_open_files_limit(FakeRlimit(1024, 2048, fail=True)) == (1024, 1024)


# Run as `python -m check`: the launcher imports it while the head starts (the stamp of its first import), then
# runs it as __main__ on the cluster.
CHECK = textwrap.dedent(
    """
    import json, os, pathlib, sys, time
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    stamp = pathlib.Path(__file__).with_name("imported")
    if not stamp.exists():
        stamp.write_text(repr(time.time()))


    def main():
        ray.init(address="auto", logging_level="WARNING")
        nodes = [n for n in ray.nodes() if n["Alive"]]

        @ray.remote(num_cpus=1)
        def where():
            return ray.get_runtime_context().get_node_id()

        ran = ray.get([
            where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
            for n in nodes
        ])
        result = {
            "names": sorted(n["NodeName"] for n in nodes),
            "ran_on_each": ran == [n["NodeID"] for n in nodes],
            "imported": float(stamp.read_text()),
            "ran": time.time(),
        }
        json.dump(result, open(sys.argv[1], "w"))
        sys.exit(3)  # rank 0 must hand this exit code on


    if __name__ == "__main__":
        main()
    """
)


def _alive(procs: dict[tuple[int, float], psutil.Process]) -> list[psutil.Process]:
    return [p for p in procs.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
@pytest.mark.serial
def test_two_ranks_form_one_cluster_and_stop_it(tmp_path):
    # Ray's socket paths must stay under 107 characters, so the node temp dirs live in a short folder.
    temp_root = Path(tempfile.mkdtemp(prefix="mu-ray-", dir="/tmp"))
    shared, result = tmp_path / "shared", tmp_path / "result.json"
    (tmp_path / "check.py").write_text(CHECK)
    command = rc.cluster_command(
        [sys.executable, "-m", "check", str(result)],
        shared_dir=shared,
        node_ip="127.0.0.1",
        num_cpus=1,
        num_gpus=0,
        object_store_memory=100 * 1024 * 1024,
        temp_root=temp_root,
        timeout=120,
    )
    # A token left in ~/.ray by any local ray.init() (Ray 2.60 writes one) used to split the cluster: the
    # head turned authentication on, the joining node and the driver did not.
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "auth_token").write_text("0" * 64)
    env = {**os.environ, "HOME": str(home), "SLURM_NNODES": "2", "SLURM_JOB_ID": "t2", "PYTHONPATH": str(tmp_path)}
    ranks = [
        subprocess.Popen(command, env={**env, "SLURM_PROCID": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for r in (0, 1)
    ]
    # Every process the ranks start (ray start, raylets, GCS, agents, workers), by PID and start time,
    # so the check below and the clean-up touch only this test's processes.
    seen: dict[tuple[int, float], psutil.Process] = {}
    try:
        deadline = time.monotonic() + 180
        while any(p.poll() is None for p in ranks) and time.monotonic() < deadline:
            for rank in ranks:
                try:
                    for child in psutil.Process(rank.pid).children(recursive=True):
                        seen.setdefault((child.pid, child.create_time()), child)
                except psutil.NoSuchProcess:
                    pass
            time.sleep(0.2)
        outputs = [p.communicate(timeout=10)[0].decode(errors="replace") for p in ranks]
        assert [p.returncode for p in ranks] == [3, 0], "\n---\n".join(outputs)

        checked = json.loads(result.read_text())
        assert checked["names"] == [f"{os.uname().nodename}-rank{r}" for r in (0, 1)] and checked["ran_on_each"]
        # The command's imports ran while the head started (before it wrote its address); the command itself
        # once both nodes had joined.
        head_up = (shared / "t2.head.json").stat().st_mtime
        assert checked["imported"] < head_up < checked["ran"], checked
        assert len(seen) > 4, "the ranks should have started Ray processes"
        assert _alive(seen) == [], "Ray processes outlived their cluster"
        assert {f.name for f in shared.iterdir()} >= {"t2.head.json", "t2.stop", "t2.rank1.stopped"}
        assert json.loads((shared / "t2.stop").read_text()) == {"exit_code": 3}
    finally:
        for proc in [*ranks, *_alive(seen)]:
            try:
                proc.kill()
            except (psutil.NoSuchProcess, ProcessLookupError):
                pass
        shutil.rmtree(temp_root, ignore_errors=True)


def test_a_port_another_process_answers_on_does_not_pass_for_the_heads_gcs(tmp_path):
    """A port picked for the head and taken before Ray binds it: the other process answers there, and only one of
    the head's own processes listening on it counts."""
    head = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with socket.socket() as other:
            other.bind(("127.0.0.1", 0))
            other.listen()
            with pytest.raises(rc.RayClusterError, match="did not listen on port"):
                rc._wait_for_ports(head, [other.getsockname()[1]], tmp_path / "head.log", time.monotonic() + 1)
    finally:
        head.kill()
        head.wait()


def test_the_head_counts_as_started_only_when_its_client_server_listens_too(tmp_path):
    """The GCS listening is not enough: the head's Ray client server binds its own picked port later, and once
    an outgoing connection had taken it (the head exited, and the run failed when its driver connected). Both of
    the head's ports must be its own processes' listening sockets."""
    gcs, client = free_port(), free_port()
    # A stand-in for ray start: its child listens on the GCS port only.
    listen = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {gcs})); s.listen(); time.sleep(60)"
    head = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {listen!r}]); time.sleep(60)",
        ],
        start_new_session=True,
    )
    try:
        rc._wait_for_ports(head, [gcs], tmp_path / "head.log", time.monotonic() + 20)
        with pytest.raises(rc.RayClusterError, match=f"did not listen on port {client} "):
            rc._wait_for_ports(head, [gcs, client], tmp_path / "head.log", time.monotonic() + 1)
    finally:
        os.killpg(head.pid, signal.SIGKILL)
        head.wait()


@pytest.mark.slow
@pytest.mark.serial
def test_a_head_that_exits_while_starting_starts_again_on_ports_picked_anew(tmp_path, monkeypatch, caplog):
    """The head's ports are picked free and bound seconds later; a head whose GCS port was taken meanwhile exits
    (after about 40 s of Ray's own retries, which this test spares: its first ray start exits at once). The head
    starts again on ports picked anew."""
    temp_root = Path(tempfile.mkdtemp(prefix="mu-ray-", dir="/tmp"))
    ray_start_argv, ports = rc.ray_start_argv, []

    def first_exits(**argv):
        ports.append(argv["port"])
        return ray_start_argv(**argv) if len(ports) > 1 else [sys.executable, "-c", "raise SystemExit(1)"]

    monkeypatch.setattr(rc, "ray_start_argv", first_exits)
    node_argv = {
        "node_ip": "127.0.0.1",
        "temp_dir": rc.ray_temp_dir(temp_root, "t4", 0),
        "node_name": "h-rank0",
        "num_cpus": 1,
        "num_gpus": 0,
        "object_store_memory": 100 * 1024 * 1024,
    }
    proc = None
    try:
        proc, port = rc._start_head(node_argv, None, tmp_path / "head.log", time.monotonic() + 120)
        assert len(ports) == 2 and port == ports[1] and proc.poll() is None
        assert "starting the head again on other ports (attempt 2)" in caplog.text
    finally:
        if proc is not None:
            rc._stop_node(proc)
        shutil.rmtree(temp_root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.serial
def test_a_rank_that_never_joins_fails_the_start_up_naming_it(tmp_path):
    temp_root = Path(tempfile.mkdtemp(prefix="mu-ray-", dir="/tmp"))
    try:
        env = {**os.environ, "SLURM_NNODES": "2", "SLURM_PROCID": "0", "SLURM_JOB_ID": "t3"}
        command = rc.cluster_command(
            [sys.executable, "-c", "pass"],
            shared_dir=tmp_path,
            node_ip="127.0.0.1",
            num_cpus=1,
            num_gpus=0,
            object_store_memory=100 * 1024 * 1024,
            temp_root=temp_root,
            timeout=20,
        )
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150)
        assert proc.returncode == 1
        assert "only 1 of 2 Ray nodes joined" in proc.stderr and "missing ranks [1]" in proc.stderr
        assert json.loads((tmp_path / "t3.stop").read_text()) == {"exit_code": 1}
    finally:
        shutil.rmtree(temp_root, ignore_errors=True)


@contextlib.contextmanager
def a_launcher_running_its_command(tmp_path):
    """The launcher outside Slurm (the machine is the one node), its command started (it sleeps); yields the launcher
    and its processes by PID and start time, which are killed afterwards if they outlived the test."""
    temp_root = Path(tempfile.mkdtemp(prefix="mu-ray-", dir="/tmp"))
    started = tmp_path / "started"
    command = rc.cluster_command(
        [sys.executable, "-c", f"import pathlib, time; pathlib.Path({str(started)!r}).touch(); time.sleep(600)"],
        shared_dir=tmp_path / "shared",
        node_ip="127.0.0.1",
        num_cpus=1,
        object_store_memory=100 * 1024 * 1024,
        temp_root=temp_root,
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: dict[tuple[int, float], psutil.Process] = {}
    try:
        deadline = time.monotonic() + 120
        while not started.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert started.exists(), launcher.communicate(timeout=30)[0].decode(errors="replace")
        for child in psutil.Process(launcher.pid).children(recursive=True):
            seen.setdefault((child.pid, child.create_time()), child)
        yield launcher, seen
    finally:
        if launcher.poll() is None:
            launcher.kill()
        for proc in _alive(seen):
            proc.kill()
        shutil.rmtree(temp_root, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.serial
def test_sigterm_outside_slurm_stops_the_command_and_the_ray_node(tmp_path):
    """A cancelled job (Snakemake stopping, scancel) must not leave its Ray node or its trainer running;
    ray.init replaces the launcher's SIGTERM handler, which the launcher puts back."""
    with a_launcher_running_its_command(tmp_path) as (launcher, seen):
        launcher.terminate()
        output = launcher.communicate(timeout=120)[0].decode(errors="replace")
        assert launcher.returncode == 128 + 15, output
        psutil.wait_procs(list(seen.values()), timeout=10)
        assert _alive(seen) == [], f"outlived the cancelled launcher: {_alive(seen)}\n{output}"


@pytest.mark.slow
@pytest.mark.serial
def test_a_head_that_dies_under_the_command_fails_the_run_in_seconds(tmp_path):
    """One of the head's processes died while the trainer ran (a port another process took, once): `ray start
    --block` exits, and the launcher stops the command and fails, where the driver had waited 14 minutes on the
    GCS."""
    with a_launcher_running_its_command(tmp_path) as (launcher, seen):
        trainer = next(p for p in seen.values() if "time.sleep(600)" in " ".join(p.cmdline()))
        next(p for p in seen.values() if p.name().startswith("gcs_server")).kill()
        start = time.monotonic()
        output = launcher.communicate(timeout=120)[0].decode(errors="replace")
        assert launcher.returncode == 1 and time.monotonic() - start < 60, output
        assert "the Ray head's node stopped while the command ran" in output
        assert not trainer.is_running() or trainer.status() == psutil.STATUS_ZOMBIE
        psutil.wait_procs(list(seen.values()), timeout=10)
        assert _alive(seen) == [], f"outlived the failed launcher: {_alive(seen)}\n{output}"
