"""job_secret.py: the job's secret and the sealed messages between the agents of a job,
and the environment a follower takes from a launch request (supervisor/nodes.py)."""

from __future__ import annotations

import os

import pytest

from ds_resilience.launch import CONTRACT_KEYS
from ds_resilience.job_secret import (SECRET_VAR, BadSignature, SecretError, load_secret, new_secret,
                                                 seal, unseal)
from ds_resilience.supervisor.nodes import refused_env


def test_a_sealed_value_opens_only_with_the_secret_and_under_its_own_key():
    secret = new_secret()
    raw = seal(secret, "dsr/nodes/launch/1/0", '{"rank": 2}')
    assert unseal(secret, "dsr/nodes/launch/1/0", raw.encode()) == '{"rank": 2}'
    with pytest.raises(BadSignature):
        unseal(new_secret(), "dsr/nodes/launch/1/0", raw)  # another job's secret
    with pytest.raises(BadSignature):
        unseal(secret, "dsr/nodes/launch/1/1", raw)  # moved to another key (a replayed request)
    with pytest.raises(BadSignature):
        unseal(secret, "dsr/nodes/launch/1/0", raw.replace('"rank": 2', '"rank": 3'))  # altered
    with pytest.raises(BadSignature):
        unseal(secret, "dsr/nodes/launch/1/0", '{"rank": 2}')  # never signed


def test_the_secret_comes_from_an_owner_only_file_or_the_environment(tmp_path):
    secret = new_secret()
    path = tmp_path / "secret"
    path.write_text(secret + "\n")
    os.chmod(path, 0o644)
    with pytest.raises(SecretError, match="readable by others.*chmod 600"):
        load_secret(path)
    os.chmod(path, 0o600)
    assert load_secret(path, env={SECRET_VAR: "ignored when a file is given" * 2}) == secret
    assert load_secret(None, env={SECRET_VAR: secret}) == secret
    assert load_secret(None, env={}) is None
    with pytest.raises(SecretError, match="at least 32"):
        load_secret(None, env={SECRET_VAR: "short"})
    with pytest.raises(SecretError, match="--secret_file"):
        load_secret(tmp_path / "missing")


def test_a_launch_request_may_set_only_the_launch_contract():
    contract = {"RANK": "2", "WORLD_SIZE": "4", "DSR_AGENT": "1", "GROUP_RANK": "1"}
    assert set(contract) <= CONTRACT_KEYS and refused_env(contract) is None
    why = refused_env({**contract, "LD_PRELOAD": "/tmp/evil.so", "PYTHONPATH": "/tmp/evil"})
    assert "LD_PRELOAD" in why and "PYTHONPATH" in why and "RANK" in why  # what is allowed is named too
    assert "malformed" in refused_env({"RANK": 2})
    assert "not a mapping" in refused_env(["RANK=2"])
