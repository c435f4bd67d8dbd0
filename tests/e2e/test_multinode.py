"""Two machines on this one: ``deepspeed --hostfile hostfile examples/run.py ...`` across two "hosts", and
``accelerate launch`` with ``num_machines: 2`` (one launcher per machine, no ssh needed).

The hostfile launch needs passwordless ssh to every host (pdsh runs the per-node launchers). This
module sets that up on the test machine: Debian's openssh-server and pdsh (installed with apt-get if
missing), a throwaway key pair, sshd on a free loopback port, and an ssh client drop-in that names
two host aliases, ``mtk-node-a`` and ``mtk-node-b``, for 127.0.0.1. Everything is removed afterwards.
Where that cannot be done the tests are skipped with a reason naming what is missing.
"""

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from mtk.spawn import free_port
from mtk.testing import assert_close_rel
from tests.e2e.launch import ROOT, step_losses

SSH_DROP_IN_DIR = Path("/etc/ssh/ssh_config.d")
HOSTS = ("mtk-node-a", "mtk-node-b")


def _ensure_packages() -> str | None:
    """Install openssh-server and pdsh when absent; returns why not, or None."""
    if shutil.which("pdsh") and Path("/usr/sbin/sshd").exists() and shutil.which("ssh-keygen"):
        return None
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "openssh-server/pdsh are not installed and cannot be (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
    out = subprocess.run(
        ["apt-get", "install", "-y", "-qq", "openssh-server", "pdsh"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if out.returncode != 0:
        return f"apt-get install openssh-server pdsh failed: {out.stderr.strip().splitlines()[-1:]}"
    return None


@pytest.fixture(scope="module")
def ssh_hosts(tmp_path_factory):
    missing = _ensure_packages()
    if missing:
        pytest.skip(missing)
    if not SSH_DROP_IN_DIR.is_dir() or not os.access(SSH_DROP_IN_DIR, os.W_OK):
        pytest.skip(f"{SSH_DROP_IN_DIR} is not writable: cannot name the test hosts for ssh")
    work = tmp_path_factory.mktemp("ssh")
    for name in ("host_key", "id_key"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(work / name)], check=True)
    shutil.copy(work / "id_key.pub", work / "authorized_keys")
    port = free_port()
    (work / "sshd_config").write_text(
        f"Port {port}\nListenAddress 127.0.0.1\nHostKey {work / 'host_key'}\n"
        f"AuthorizedKeysFile {work / 'authorized_keys'}\nPasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\nPermitRootLogin yes\nStrictModes no\nUsePAM no\n"
        f"PidFile {work / 'sshd.pid'}\n"
    )
    Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
    sshd = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(work / "sshd_config")],
        stdout=subprocess.DEVNULL,
        stderr=open(work / "sshd.log", "w"),
    )
    drop_in = SSH_DROP_IN_DIR / f"mtk-test-{os.getpid()}.conf"
    drop_in.write_text(
        f"Host {' '.join(HOSTS)}\n  HostName 127.0.0.1\n  Port {port}\n  IdentityFile {work / 'id_key'}\n"
        "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  BatchMode yes\n  LogLevel ERROR\n"
    )
    try:
        for _ in range(50):
            probe = subprocess.run(["ssh", HOSTS[0], "true"], capture_output=True, timeout=30)
            if probe.returncode == 0:
                break
            time.sleep(0.2)
        else:
            pytest.skip(
                f"sshd on 127.0.0.1:{port} did not accept the test key: {(work / 'sshd.log').read_text()[-300:]}"
            )
        hostfile = work / "hostfile"
        hostfile.write_text("".join(f"{host} slots=2\n" for host in HOSTS))
        yield hostfile
    finally:
        drop_in.unlink(missing_ok=True)
        sshd.terminate()
        sshd.wait(timeout=30)


RUN_ARGS = (
    "examples/run.py",
    "--deepspeed",
    "--deepspeed_config",
    "ds_configs/zero2.json",
    "--tp",
    "2",
    "--batch_size",
    "4",
    "--max_steps",
    "6",
)


@pytest.fixture(scope="module")
def reference(llama_tp1):
    return llama_tp1.losses  # the shared single-process run, same seed and global batch 8


def _check(losses: dict[int, float], reference: dict[int, float]) -> None:
    assert sorted(losses) == list(range(1, 7)), losses
    for step in range(1, 7):
        assert_close_rel(losses[step], reference[step], f"two-node loss at step {step}")


def test_hostfile_launch_over_ssh(ssh_hosts, reference, tmp_path):
    command = [
        "deepspeed",
        "--hostfile",
        str(ssh_hosts),
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        *RUN_ARGS,
        "--output_dir",
        str(tmp_path),
    ]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    text = out.stdout + out.stderr
    assert all(f"{host}:" in text for host in HOSTS), "processes ran on both hosts"
    _check(step_losses(out), reference)


def test_no_ssh_launch_one_launcher_per_node(ssh_hosts, reference, tmp_path):
    port = str(free_port())
    launchers = [
        subprocess.Popen(
            [
                "deepspeed",
                "--hostfile",
                str(ssh_hosts),
                "--no_ssh",
                "--node_rank",
                str(rank),
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                port,
                *RUN_ARGS,
                "--output_dir",
                str(tmp_path),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=900) for p in launchers]
    for proc, (stdout, stderr) in zip(launchers, outputs):
        assert proc.returncode == 0, stdout[-2000:] + stderr[-2000:]
    node0 = subprocess.CompletedProcess([], 0, outputs[0][0], outputs[0][1])
    _check(step_losses(node0), reference)


def _machine_config(tmp_path: Path, machine_rank: int, port: int) -> Path:
    """accelerate_configs/tp2_dp2.yaml as one of two machines, the main one on loopback."""
    text = (ROOT / "accelerate_configs" / "tp2_dp2.yaml").read_text()
    text = text.replace("num_machines: 1", "num_machines: 2")
    text = text.replace("machine_rank: 0", f"machine_rank: {machine_rank}")
    text += f"main_process_ip: 127.0.0.1\nmain_process_port: {port}\n"
    path = tmp_path / f"machine{machine_rank}.yaml"
    path.write_text(text)
    return path


def test_accelerate_two_machines_keep_tp_inside_a_node(reference, tmp_path):
    """``accelerate launch`` with ``num_machines: 2`` (one launcher per machine, as docs/plan.md's recipe): TP=2 x
    DP=2 over two "machines" of two processes, TP groups inside a machine, the TP=1 losses; the placement the
    run reports is the one ``mtk plan`` assumes (rank r on node r // processes per node)."""
    from mtk.parallel.layout import Layout
    from mtk.planner.cluster import Cluster

    port = free_port()
    launchers = [
        subprocess.Popen(
            [
                "accelerate",
                "launch",
                "--config_file",
                str(_machine_config(tmp_path, rank, port)),
                "examples/finetune.py",
                "--max_steps",
                "6",
                "--batch_size",
                "4",
                "--output_dir",
                str(tmp_path / "out"),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for rank in range(2)
    ]
    outputs = [p.communicate(timeout=900) for p in launchers]
    for proc, (stdout, stderr) in zip(launchers, outputs):
        assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    node0 = subprocess.CompletedProcess([], 0, outputs[0][0], outputs[0][1])
    _check(step_losses(node0), reference)
    text = outputs[0][0] + outputs[0][1]
    assert "mtk: 2 node(s): node 0 = ranks [0, 1]; node 1 = ranks [2, 3]; every TP group inside one node" in text
    cluster, layout = Cluster(gpus=4, nodes=2), Layout(world_size=4, tp_size=2, pp_size=1)
    assert all(cluster.within_node(group) for group in layout.groups("tp"))
    assert not any(cluster.within_node(group) for group in layout.groups("dp")), "DP crosses the machines"
