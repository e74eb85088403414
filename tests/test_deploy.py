"""Deployment files, checked without Docker: compose.yaml's services run real CLI commands, one
distinct rank each with one world size, Redis has a password and no published port, and every
service restarts and has a health check."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import jsonschema
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
    assert "requirepass" in " ".join(redis["command"]) and "healthcheck" in redis


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


def test_flower_runs_the_module_app_with_basic_auth(services, monkeypatch):
    """`celerytp flower` (it execs `celery -A celerytp.app flower` with queue lengths on its Broker page)."""
    flower = services["flower"]
    monkeypatch.setenv("CELERYTP_BROKER", flower["environment"]["CELERYTP_BROKER"])  # as compose sets it
    args = parsed(flower["command"])
    assert "entrypoint" not in flower and args.func.__name__ == "_flower" and args.address == "0.0.0.0"
    assert "FLOWER_BASIC_AUTH" in flower["environment"] and "--basic-auth" not in flower["command"]


# The compose-spec schema (draft 7), vendored: its source and commit are in tests/data/README.md.
SCHEMA = jsonschema.Draft7Validator(json.loads((ROOT / "tests" / "data" / "compose-spec.json").read_text()))


@pytest.mark.parametrize("name", ["compose.yaml", "compose.gpu.yaml"])
def test_compose_files_follow_the_compose_spec(name):
    SCHEMA.validate(yaml.safe_load((ROOT / name).read_text()))


def test_the_schema_check_can_fail(services):
    doc = yaml.safe_load((ROOT / "compose.yaml").read_text())
    doc["services"]["rank0"]["shm-size"] = "1g"  # a misspelt key
    with pytest.raises(jsonschema.ValidationError):
        SCHEMA.validate(doc)


def ranks_of(services: dict) -> dict:
    return {name: s for name, s in services.items() if s.get("command", [""])[0] == "worker"}


def test_ranks_share_ipc_stop_gracefully_and_have_limits(services):
    for name, rank in ranks_of(services).items():
        assert rank.get("ipc") == "host", name  # one /dev/shm for the shm collectives; NCCL wants it
        assert rank["stop_grace_period"] and rank["deploy"]["resources"]["limits"]["memory"], name
        assert "reservations" not in rank["deploy"]["resources"], name  # the default runs without a GPU
    for name, service in services.items():
        assert service.get("stop_grace_period"), name
        assert service.get("deploy", {}).get("resources", {}).get("limits"), name


def test_gpu_override_reserves_one_gpu_per_rank(services):
    gpu = yaml.safe_load((ROOT / "compose.gpu.yaml").read_text())["services"]
    ranks = ranks_of(services)
    assert set(gpu) == set(ranks)
    ids = []
    for name, override in gpu.items():
        (device,) = override["deploy"]["resources"]["reservations"]["devices"]
        assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
        ids += device["device_ids"]
        args = parsed(override["command"])
        assert args.device.startswith("cuda") and args.rank == parsed(ranks[name]["command"]).rank
    assert len(set(ids)) == len(ranks)


def test_serve_waits_for_healthy_ranks_and_is_closed_by_default(services):
    serve = services["serve"]
    for name, rank in ranks_of(services).items():
        assert serve["depends_on"][name] == {"condition": "service_healthy"}
        # the rank's health check runs workers/healthcheck.sh: its heartbeat key in Redis
        assert rank["healthcheck"]["test"] == ["CMD", "celerytp-healthcheck"]
    assert "owner" in (ROOT / "workers" / "healthcheck.sh").read_text()
    key = serve["environment"]["CELERYTP_API_KEY"]
    assert key.startswith("${CELERYTP_API_KEY:?"), key  # compose refuses to start without a key
    assert not any(arg.startswith("--api-key") for arg in serve["command"])


def test_redis_password_is_on_no_command_line(services):
    redis = services["redis"]
    assert redis["environment"]["REDISCLI_AUTH"].startswith("${REDIS_PASSWORD")
    assert " -a " not in " ".join(redis["healthcheck"]["test"]) and "--requirepass" not in " ".join(redis["command"])
    assert "requirepass" in " ".join(redis["command"])  # written to a 0600 config file


def test_images_are_pinned(services):
    for name, service in services.items():
        image = service["image"]
        if image != "celerytp:latest":  # built here
            assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", image), (name, image)
    base = re.search(r"^FROM (\S+)", (ROOT / "workers" / "Dockerfile").read_text(), re.M).group(1)
    assert re.fullmatch(r"[\w./-]+:\d+\.\d+\.\d+[\w.-]*", base), base


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
