"""What the e2e tests share: `dilocox` in a subprocess, its metrics, and the processes of a running launcher."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from dilocox.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]
DEBUG = str(REPO / "configs" / "debug.toml")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
"""torchrun with 2 workers on this machine; the program and its arguments follow."""


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on now (for a rendezvous the test starts next)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def torchrun_nodes(
    num_nodes: int, *args, node_args: dict[int, list[str]] | None = None, timeout: float = 240
) -> list[subprocess.CompletedProcess]:
    """`torchrun --nnodes num_nodes` on this machine, one process per node (a static rendezvous at 127.0.0.1 with
    node i given --node-rank=i), each node running `dilocox *args` plus `node_args[i]`; waits for every node and
    returns their results in node order."""
    port = free_port()
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={num_nodes}", "--nproc-per-node=1",
                "--master-addr=127.0.0.1", f"--master-port={port}"]  # fmt: skip
    procs = [
        subprocess.Popen(
            [*torchrun, f"--node-rank={node}", "-m", "dilocox", *map(str, args), *(node_args or {}).get(node, [])],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env=env,
        )
        for node in range(num_nodes)
    ]
    try:
        outputs = [proc.communicate(timeout=timeout) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [
        subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        for proc, (stdout, stderr) in zip(procs, outputs, strict=True)
    ]


def dilocox(*args, timeout=240, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dilocox", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
        cwd=REPO,
        **kwargs,
    )


def metrics(run_dir: Path) -> list[dict]:
    assert (run_dir / "metrics.jsonl").is_file(), f"{run_dir} has no metrics.jsonl"
    return read_metrics(run_dir)


def child_pids(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def rank_pids(launcher: int) -> list[int]:
    """The ranks of a local launcher: the children of its fork server (`launch_local`)."""
    servers = [pid for pid in child_pids(launcher) if "forkserver" in Path(f"/proc/{pid}/cmdline").read_text()]
    return [rank for server in servers for rank in child_pids(server)]


def descendant_pids(pid: int) -> list[int]:
    """Every process below `pid`: the launcher's fork server, its ranks, multiprocessing's resource tracker."""
    return [d for child in child_pids(pid) for d in (child, *descendant_pids(child))]


def wait_for_training(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text().strip():
            return
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError("training did not start")


def alive_pids(pids: list[int]) -> list[int]:
    return [
        pid
        for pid in pids
        if Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    ]


def wait_until_gone(pids: list[int], timeout: float = 120) -> list[int]:
    """Wait for `pids` to exit; returns those still alive after `timeout` (a hang guard, not a speed bound: processes
    that stop at all stop within seconds)."""
    deadline = time.monotonic() + timeout
    while (alive := alive_pids(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def start_long_run(run_dir: Path, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dilocox",
            "train",
            "--config",
            DEBUG,
            f"--run.out_dir={run_dir}",
            "--train.steps=100000",
            "--metrics.log_interval=1",
            "--eval.interval=0",
            "--checkpoint.interval=0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=env,
        # as from a terminal: a shell's background job (a CI script's `cmd &`) would hand down SIGINT ignored, and
        # Python then never raises KeyboardInterrupt, so Ctrl+C could not be tested
        preexec_fn=default_sigint,
    )


def default_sigint() -> None:
    """In a child before exec: SIGINT as a terminal hands it down (a background job inherits it ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def torchrun_workers(torchrun: int) -> list[int]:
    """The dilocox workers of a torchrun job: the children of torchrun or of its agent process."""
    return [
        pid
        for agent in [torchrun, *child_pids(torchrun)]
        for pid in child_pids(agent)
        if "dilocox" in Path(f"/proc/{pid}/cmdline").read_text()
    ]


LOOPBACK = ("127.0.0.1", "::1")


def listening_sockets(pid: int) -> list[tuple[str, int]]:
    """The (address, port) of every TCP socket `pid` listens on: its sockets' inodes (/proc/PID/fd) looked up in its
    network namespace's tables (/proc/PID/net/tcp, tcp6). A process that ended meanwhile has none."""
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # a descriptor closed meanwhile
                found = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
                if found:
                    inodes.add(found.group(1))
        tables = [Path(f"/proc/{pid}/net/{name}").read_text() for name in ("tcp", "tcp6")]
    except (FileNotFoundError, ProcessLookupError):
        return []
    listening = []
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # TCP_LISTEN
                listening.append(_proc_address(fields[1]))
    return sorted(listening)


def _proc_address(field: str) -> tuple[str, int]:
    """ "0100007F:1F90" -> ("127.0.0.1", 8080): the address is in 32-bit words of host (little-endian) order."""
    address, port = field.split(":")
    raw = bytes.fromhex(address)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw), int(port, 16)


def non_loopback_interface() -> str | None:
    """An interface with an IPv4 address other than the loopback's (what a user may keep in GLOO_SOCKET_IFNAME for
    torchrun jobs), or None when this machine has none."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address, bytes 20-24 of the ifreq
                request = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address
                continue
            if request[20] != 127:
                return name
    return None


@contextlib.contextmanager
def run_lock_held(run_dir: Path) -> Iterator[subprocess.Popen]:
    """A live process that holds `run_dir`'s lock (`RunLock`) until the block ends: a live run, as the lock sees it,
    that writes nothing else while it holds it."""
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD_LOCK, str(run_dir)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held", "the lock holder did not start"
        yield holder
    finally:
        holder.stdin.close()  # the holder releases the lock and exits
        holder.wait(timeout=60)


_HOLD_LOCK = """import sys
from dilocox.runlock import RunLock
lock = RunLock.acquire(sys.argv[1])
print("held", flush=True)
sys.stdin.read()
lock.release()
"""


def train_refusal(*args: str) -> str | None:
    """What `dilocox train ARGS` says after `dilocox: error:` when it refuses to start, found in this process by the
    launcher's own steps up to the first rank (the config, the run directory's choice, `preflight`); None when it
    would start. The CLI's one line and exit code 2 around it are tested where `dilocox train` runs."""
    from dilocox.cli import _take_option, _train_config
    from dilocox.launch.preflight import preflight
    from dilocox.launch.rundir import choose_run_dir

    config_path, rest = _take_option(list(args), "--config")
    try:
        cfg = _train_config(config_path, rest)
        cfg.validate()
        choose_run_dir(cfg)
        preflight(cfg)
    except ValueError as exc:
        return str(exc)
    return None
