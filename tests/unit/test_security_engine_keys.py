"""Engine keys without a process: key files are checked and never echoed, the Bearer check, and
launch specs that hand the key over in the environment only (the attacks against real engine
processes are tests/integration/test_security_engine.py)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from support.engines import local_plan_engine, write_key

from tether.config import resolve
from tether.rollout.engine_api.auth import ENGINE_KEY_ENV, authorized
from tether.rollout.engine_api.launch import EngineLaunchConfig, build_launch
from tether.rollout.routing.sglang_router import RouterLaunchConfig, router_spec
from tether.runtime.errors import ConfigError
from tether.runtime.rpc.secret import read_key_file


def test_key_file_is_checked_and_never_echoed(tmp_path: Path) -> None:
    good = write_key(tmp_path / "good", "k" * 32)
    assert read_key_file(good, "--x") == "k" * 32
    cases = [
        (write_key(tmp_path / "open", "k" * 32, 0o644), "chmod 600"),
        (write_key(tmp_path / "short", "k" * 8), "at least 16"),
        (write_key(tmp_path / "space", "k" * 16 + " k"), "without spaces"),
        (tmp_path / "missing", "cannot read"),
    ]
    for path, why in cases:
        with pytest.raises(ConfigError, match=why) as err:
            read_key_file(path, "--engine-api-key-file")
        assert err.value.key == "--engine-api-key-file" and "k" * 16 not in str(err.value)


def test_run_flag_refuses_a_bad_key_file_at_parse_time(tmp_path: Path) -> None:
    loose = write_key(tmp_path / "loose", "s" * 40, 0o640)
    with pytest.raises(ConfigError) as err:
        resolve(["--engine-api-key-file", str(loose)])
    assert err.value.key == "--engine-api-key-file" and "0640" in str(err.value)
    good = write_key(tmp_path / "good", "s" * 40)
    cfg = resolve(["--engine-api-key-file", str(good), "--engine-allow-nonfinite-weights"])
    assert cfg.rollout.engine_api_key_file == str(good) and cfg.rollout.engine_allow_nonfinite_weights
    assert b"s" * 40 not in cfg.to_json()  # the receipt names the file, never the key


def test_bearer_check() -> None:
    key = "k" * 20
    assert authorized(f"Bearer {key}", key) and authorized(f"bearer {key}", key)
    for header in (None, "", key, f"Basic {key}", f"Bearer {key}x", "Bearer ", f"Bearer {key[:-1]}"):
        assert not authorized(header, key), header


@pytest.mark.parametrize("backend", ["cpu", "sglang"])
def test_launch_hands_the_key_over_in_the_environment_only(backend: str) -> None:
    key = "launch-key-" + "x" * 20
    cfg = EngineLaunchConfig(
        model_path="/models/m", backend=backend, device_kind="cpu", sglang_python="/venv/python", api_key=key
    )
    launch = build_launch(local_plan_engine(), cfg)
    (spec,) = launch.specs
    assert spec.env[ENGINE_KEY_ENV] == key and not spec.run_secret
    assert not any(key in arg for arg in spec.argv)  # `ps` shows argv to every user
    assert key not in repr(cfg) and key not in repr(launch)
    if backend == "cpu":  # `tether run --engine-allow-nonfinite-weights` reaches the CPU engine
        assert "--allow-nonfinite-weights" not in spec.argv
        allowing = msgspec.structs.replace(cfg, allow_nonfinite_weights=True)
        assert "--allow-nonfinite-weights" in build_launch(local_plan_engine(), allowing).specs[0].argv
    if backend == "sglang":
        # The shim moves the key from the environment into SGLang's own argv.
        assert spec.argv[1].endswith("key_shim.py") and spec.argv[2] == "sglang.launch_server"
        assert spec.argv[3] == "--api-key,--admin-api-key"
        with pytest.raises(ConfigError, match="engine-api-key-file"):
            build_launch(local_plan_engine(), msgspec.structs.replace(cfg, sglang_args=["--api-key", "mine"]))
    router = router_spec([launch], RouterLaunchConfig(port=9000, python="/venv/python", api_key=key))
    assert router.env[ENGINE_KEY_ENV] == key and not router.run_secret
    assert not any(key in arg for arg in router.argv)
    assert router.argv[2:4] == ["sglang_router.launch_router", "--api-key"]
    with pytest.raises(ConfigError):
        router_spec(
            [launch],
            RouterLaunchConfig(port=9000, python="/p", api_key=key, sglang_args=["--router-api-key", "x"]),
        )
