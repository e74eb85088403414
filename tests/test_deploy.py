"""Deployment files, checked without Docker: compose.yaml's services run real CLI commands, one
distinct rank each with one world size, Redis has a password and no published port, and every
service restarts and has a health check."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from celerytp.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def services() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]


def parsed(command: list[str]):
    return build_parser().parse_args(command)


def test_ranks_are_distinct_and_agree_on_world_size(services):
    ranks = {name: parsed(s["command"]) for name, s in services.items() if s.get("command", [""])[0] == "worker"}
    world = {args.world_size for args in ranks.values()}
    assert len(world) == 1 and sorted(a.rank for a in ranks.values()) == list(range(world.pop()))
    for name, args in ranks.items():
        env = services[name]["environment"]
        assert env["CELERYTP_RANK"] == str(args.rank)  # the image's health check reads it
        assert "${REDIS_PASSWORD" in env["CELERYTP_BROKER"] and "--broker" not in services[name]["command"]


def test_serve_attaches_to_the_ranks(services):
    serve = services["serve"]
    args = parsed(serve["command"])
    assert args.func.__name__ == "_serve" and args.tp == len([s for s in services.values()
                                                              if s.get("command", [""])[0] == "worker"])
    assert serve["environment"]["CELERYTP_BROKER"].startswith("redis://:${REDIS_PASSWORD")
    assert str(args.port) == serve["environment"]["CELERYTP_PORT"]


def test_redis_has_a_password_and_no_published_port(services):
    redis = services["redis"]
    assert "ports" not in redis
    assert "--requirepass" in " ".join(redis["command"]) and "healthcheck" in redis


def test_every_service_restarts_and_is_health_checked(services):
    dockerfile = (ROOT / "workers" / "Dockerfile").read_text()
    assert "\nHEALTHCHECK " in dockerfile and "\nUSER celerytp" in dockerfile
    for name, service in services.items():
        assert service.get("restart") == "unless-stopped", name
        assert "healthcheck" in service or service.get("image") == "celerytp:latest", name
        if service.get("image") == "celerytp:latest":
            # models read-only; the compile cache (owned by the image's user) outlives containers
            assert service["volumes"] == ["${MODELS_DIR:-./models}:/models:ro", "compile-cache:/cache"]
            assert "mkdir /cache && chown celerytp /cache" in dockerfile


def test_flower_runs_the_module_app_with_basic_auth(services):
    flower = services["flower"]
    assert flower["entrypoint"] == ["celery"] and flower["command"][:3] == ["-A", "celerytp.app", "flower"]
    assert "FLOWER_BASIC_AUTH" in flower["environment"]


def test_systemd_entrypoint_runs_a_real_command(tmp_path):
    """The entrypoint's expanded command line (a stub `celerytp` records it) parses as `celerytp worker`."""
    stub = tmp_path / "celerytp"
    stub.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:{os.environ['PATH']}", "CELERYTP_RANK": "1", "CELERYTP_WORLD_SIZE": "2",
           "CELERYTP_BROKER": "redis://:pw@redis:6379/0", "CELERYTP_MODEL_ROOT": "/models"}
    out = subprocess.run(["sh", str(ROOT / "workers" / "entrypoint.sh")], env=env, capture_output=True, text=True,
                         check=True).stdout
    args = parsed(out.splitlines())
    assert (args.rank, args.world_size, args.device, args.model_root) == (1, 2, "auto", ["/models"])
    assert "pw" not in out  # the broker URL stays in the environment
