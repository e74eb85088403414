"""Signed messages end to end: with a deployment's key, only holders of a trusted certificate
can drive the ranks; unsigned messages and messages signed with another key are refused and the
worker lives on. Runs in subprocesses: Celery's signing setup is process-wide."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow


def _key_and_cert(directory, name: str) -> tuple[str, str]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(subject).public_key(key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=2)).sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / f"{name}.key", directory / f"{name}.pem"
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return str(key_path), str(cert_path)


CLIENT = """
import json, sys
from celerytp import Leader
from celerytp.core.errors import CeleryTPError
try:
    Leader(sys.argv[1], "signed", 1, timeout=4).sanity_check()  # an op (ping only reads, unsigned)
    print(json.dumps("ok"))
except CeleryTPError as exc:
    print(json.dumps(str(exc.kind)))
"""

SCENARIO = """
import json, os, subprocess, sys
from celerytp.cluster import LocalCluster
signing = {k: os.environ[k] for k in os.environ if k.startswith("CELERYTP_SIGNING_")}
with LocalCluster(world_size=1, group="signed", env=signing) as cluster:
    outcome = {"trusted": [s.observed_sum for s in cluster.leader.sanity_check()]}
    for who, env in (("other_key", json.loads(sys.argv[1])), ("unsigned", {})):
        clean = {k: v for k, v in os.environ.items() if not k.startswith("CELERYTP_SIGNING_")}
        run = subprocess.run([sys.executable, "-c", sys.argv[2], cluster.broker_url], env={**clean, **env},
                             capture_output=True, text=True, timeout=120)
        outcome[who] = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else run.stderr[-500:]
    outcome["alive"] = all(p.poll() is None for p in cluster.workers)
    outcome["after"] = [s.observed_sum for s in cluster.leader.sanity_check()]
    outcome["log"] = cluster.log(0)[-20000:]
print(json.dumps(outcome))
"""


def test_only_trusted_signers_drive_the_ranks(tmp_path):
    store = tmp_path / "trusted"
    store.mkdir()
    key, cert = _key_and_cert(store, "deployment")
    other_key, other_cert = _key_and_cert(tmp_path, "intruder")
    env = {**os.environ, "CELERYTP_SIGNING_KEY": key, "CELERYTP_SIGNING_CERT": cert,
           "CELERYTP_SIGNING_CERT_STORE": str(store / "*.pem")}
    # The intruder signs with its own key and certificate, and even trusts the real one.
    intruder = {"CELERYTP_SIGNING_KEY": other_key, "CELERYTP_SIGNING_CERT": other_cert,
                "CELERYTP_SIGNING_CERT_STORE": str(store / "*.pem")}
    run = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(SCENARIO), json.dumps(intruder), textwrap.dedent(CLIENT)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    outcome = json.loads(run.stdout.strip().splitlines()[-1])
    assert outcome["trusted"] == [1] and outcome["after"] == [1] and outcome["alive"], outcome
    assert outcome["other_key"] == "timeout" and outcome["unsigned"] == "timeout", outcome
    log = outcome["log"].lower()
    assert "certificate" in log or "signature" in log or "security" in log, outcome["log"][-3000:]
