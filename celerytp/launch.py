"""`celerytp serve`: a group (an embedded LocalCluster, or running rank workers), the model on
it, the Celery front door as a child process, and the HTTP API in the foreground."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

from celerytp.client.leader import Leader
from celerytp.core.images import ImageLimits
from celerytp.core.secrets import mask_secrets
from celerytp.server.config import ServeConfig
from celerytp.server.limits import RequestLimits


def say(message: str) -> None:
    print(mask_secrets(message), file=sys.stderr, flush=True)


@contextlib.contextmanager
def group_for(config: ServeConfig) -> Iterator[Leader]:
    """The leader of running workers (`--broker`) or of a fresh LocalCluster, stopped on exit."""
    if config.broker:
        leader = Leader(config.broker, config.group, config.tp)
        pongs = leader.ping(timeout=10)
        if len({p.comm_id for p in pongs}) != 1 or pongs[0].comm_id is None:
            leader.init()  # the ranks have no common process group yet
        yield leader
        return
    from celerytp.cluster import LocalCluster

    say(f"starting a local cluster of {config.tp} rank(s)...")
    roots = sorted({os.path.dirname(p) for p in (config.model_path, config.mmproj) if p is not None})
    with LocalCluster(world_size=config.tp, group=config.group, model_roots=roots, device=config.device) as cluster:
        yield cluster.leader


def ensure_model(leader: Leader, config: ServeConfig) -> None:
    """Load the model unless the group holds it already (from the same path)."""
    record = leader.models().get(config.model_id)
    if record is not None and record["path"] == config.model_path and record["load"].get("mmproj") == config.mmproj:
        say(f"model {config.model_id} is loaded already")
        return
    if record is not None:
        leader.unload(config.model_id)
    say(f"loading {config.model_path} as {config.model_id!r} on {config.tp} rank(s)...")
    leader.load(config.model_id, config.model_path, quant=config.quant, max_batch=config.max_batch,
                max_context=config.max_context, kv_memory_fraction=config.kv_memory_fraction, progress=True,
                mmproj=config.mmproj)


@contextlib.contextmanager
def frontend_process(leader: Leader, limits: RequestLimits, images: ImageLimits) -> Iterator[subprocess.Popen]:
    """A `celerytp frontend` child consuming `celerytp.generate` tasks (the broker URL goes in its
    environment, not its command line, where `ps` would show a password)."""
    env = {**os.environ, "CELERYTP_BROKER": leader.broker_url, "CELERYTP_GROUP": leader.group,
           "CELERYTP_WORLD_SIZE": str(leader.world_size), **limits.as_env(), **images.as_env()}
    proc = subprocess.Popen([sys.executable, "-m", "celerytp", "frontend"], env=env, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def banner(config: ServeConfig, leader: Leader) -> str:
    url = f"http://{config.host}:{config.port}"
    key = f"{len(config.api_keys)} key(s)" if config.api_keys else "none (the API is open)"
    admin = "on (admin key)" if config.admin_key else "off (no admin key)"
    auth = ' -H "Authorization: Bearer $KEY"' if config.api_keys else ""
    return "\n".join([
        (f"celerytp serving {config.model_id!r} at {url}/v1 (tp={config.tp}, group {leader.group!r}, "
         f"broker {mask_secrets(leader.broker_url)})"),
        f"  API keys: {key}; /admin: {admin}; health: {url}/health; "
        f"metrics: {url}/metrics{' (metrics key)' if config.metrics_key else ''}",
        f"  try: curl {url}/v1/chat/completions{auth} -H 'Content-Type: application/json' \\",
        f"         -d '{{\"model\": \"{config.model_id}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Hi\"}}]}}'",
        f"  Celery: send_task('celerytp.generate', kwargs={{...}}, queue='celerytp.{leader.group}.requests')",
        "  Ctrl-C stops.",
    ])


def serve(config: ServeConfig) -> int:
    import uvicorn

    from celerytp.server.http import create_app
    from celerytp.server.metrics import Metrics
    from celerytp.server.service import Service

    # SIGTERM unwinds like Ctrl-C, so the embedded cluster and the front door are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with group_for(config) as leader:
        leader.generate_timeout = config.request_timeout
        ensure_model(leader, config)
        with contextlib.ExitStack() as stack:
            if config.frontend:
                stack.enter_context(frontend_process(leader, config.limits, config.images))
            app = create_app(Service(leader, Metrics(), config.limits, config.images), config.api_keys, config.admin_key,
                             config.payload_limit, config.metrics_key)
            server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                                                   timeout_graceful_shutdown=5))
            say(banner(config, leader))
            server.run()
    return 0
