"""Metrics go to metrics.jsonl and, when asked, to a Prometheus endpoint on the head (TensorBoard and
W&B offline, whose client starts a service process: tests/integration/test_head_metrics_wandb.py)."""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest

from tether.records.metrics import MetricsSink
from tether.records.run_dir import RunDir, read_jsonl


def test_jsonl_and_prometheus(tmp_path: Path, free_port: int) -> None:
    run = RunDir(tmp_path / "run")
    port = free_port
    sink = MetricsSink(run, metrics_port=port)
    try:
        sink.log(0, {"rollout/reward_mean": 0.25, "train/loss": 1.5, "note": "text is kept in the file"})
        sink.log(1, {"rollout/reward_mean": 0.5, "train/loss": float("nan")})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    finally:
        sink.close()
    assert "tether_rollout_reward_mean 0.5" in text and "tether_step 1.0" in text
    assert "tether_train_loss 1.5" in text  # a NaN is not exported; the last finite value stays
    records = read_jsonl(run.metrics_path)
    assert [r["step"] for r in records] == [0, 1] and records[0]["note"] == "text is kept in the file"


def test_torn_last_line_is_skipped(tmp_path: Path) -> None:
    run = RunDir(tmp_path / "run")
    run.metric({"step": 0, "x": 1.0})
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 1, "x"')  # a crash mid-append
    records = read_jsonl(run.metrics_path)
    assert len(records) == 1 and records[0]["step"] == 0 and records[0]["x"] == 1.0


class FakeWandb:
    """Records what the sink asks of the W&B client (the real one starts a service process)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, object]]] = []

    def login(self, **kwargs: object) -> None:
        self.calls.append(("login", kwargs))

    def init(self, **kwargs: object) -> FakeWandb:
        self.calls.append(("init", kwargs))
        return self

    def log(self, data: dict[str, float], step: int) -> None:
        self.calls.append(("log", {"data": data, "step": step}))

    def finish(self) -> None:
        self.calls.append(("finish", {}))


def test_slime_wandb_flags_reach_the_client(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tether.config import resolve

    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    argv = ["--use-wandb", "--wandb-project", "p", "--wandb-group", "g", "--wandb-team", "glm-zero"]
    argv += ["--wandb-host", "https://wandb.example", "--wandb-key", "k" * 40, "--wandb-mode", "offline"]
    argv += ["--wandb-dir", str(tmp_path / "wb"), "--wandb-run-id", "abc123"]
    run = resolve(argv).run
    sink = MetricsSink(
        RunDir(tmp_path / "run"),
        use_wandb=run.use_wandb,
        wandb_project=run.wandb_project,
        wandb_group=run.wandb_group,
        wandb_team=run.wandb_team,
        wandb_host=run.wandb_host,
        wandb_key=run.wandb_key,
        wandb_mode=run.wandb_mode,
        wandb_dir=run.wandb_dir,
        wandb_run_id=run.wandb_run_id,
    )
    sink.log(3, {"train/loss": 1.0})
    sink.close()
    (login, login_kw), (init, init_kw), (log, log_kw), (finish, _) = fake.calls
    assert (login, init, log, finish) == ("login", "init", "log", "finish")
    assert login_kw == {"key": "k" * 40, "host": "https://wandb.example", "relogin": True}
    assert init_kw["project"] == "p" and init_kw["group"] == "g" and init_kw["entity"] == "glm-zero"
    assert init_kw["mode"] == "offline" and init_kw["dir"] == str(tmp_path / "wb")
    assert init_kw["id"] == "abc123" and init_kw["resume"] == "allow"
    assert log_kw == {"data": {"train/loss": 1.0}, "step": 3}


def test_without_slime_wandb_flags_nothing_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    MetricsSink(RunDir(tmp_path / "run"), use_wandb=True).close()
    (init, init_kw), _ = fake.calls  # no login: the client's own credentials
    assert init == "init" and init_kw["entity"] is None and init_kw["mode"] is None
    assert init_kw["dir"] == str(tmp_path / "run") and init_kw["id"] is None and init_kw["resume"] is None


def test_the_receipt_keeps_no_wandb_key() -> None:
    """What write_receipt stores of the command line and the config (it asks git and uname itself)."""
    import msgspec

    from tether.config import resolve
    from tether.records.run_dir import redact_argv, redact_config

    key = "k" * 40
    argv = ["--wandb-key", key, "--wandb-project", "p", f"--wandb-key={key}"]
    cfg = resolve(argv)
    assert cfg.run.wandb_key == key  # the sink logs in with it
    stored = json.dumps({"argv": redact_argv(argv), "config": redact_config(msgspec.to_builtins(cfg))})
    assert key not in stored
    receipt = json.loads(stored)
    assert receipt["argv"] == ["--wandb-key", "<redacted>", "--wandb-project", "p", "--wandb-key=<redacted>"]
    assert receipt["config"]["run"]["wandb_key"] == "<redacted>"
    assert receipt["config"]["run"]["wandb_project"] == "p"


def test_slime_tensorboard_names_choose_the_event_directory(tmp_path: Path) -> None:
    from tether.config import resolve
    from tether.records.metrics import tensorboard_dir

    run = tmp_path / "runs" / "20260101-000000"
    assert tensorboard_dir(run) == run / "tensorboard"
    cfg = resolve(["--use-tensorboard", "--tb-project-name", "slime-dev", "--tb-experiment-name", "e1"]).run
    assert tensorboard_dir(run, cfg.tb_project_name, cfg.tb_experiment_name) == Path(
        "tensorboard_log/slime-dev/e1"
    )
    assert tensorboard_dir(run, "slime-dev") == Path("tensorboard_log/slime-dev/20260101-000000")


def test_wandb_random_suffix_and_train_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """slime's defaults: the group gets a random suffix and names the run; with
    --disable-wandb-random-suffix it is used as given. --wandb-always-use-train-step: the trackers
    count optimizer steps, metrics.jsonl keeps the rollout."""
    from tether.config import resolve
    from tether.records.run_dir import read_jsonl

    groups = []
    for extra in ([], ["--disable-wandb-random-suffix"]):
        fake = FakeWandb()
        monkeypatch.setitem(sys.modules, "wandb", fake)
        argv = [
            "--use-wandb",
            "--wandb-group",
            "exp",
            "--rollout-batch-size",
            "4",
            "--n-samples-per-prompt",
            "8",
        ]
        cfg = resolve([*argv, "--global-batch-size", "16", "--wandb-always-use-train-step", *extra])
        run = cfg.run
        sink = MetricsSink(
            RunDir(tmp_path / f"run{len(groups)}"),
            use_wandb=True,
            wandb_group=run.wandb_group,
            wandb_random_suffix=not run.disable_wandb_random_suffix,
            tracker_step=cfg.data.train_step_of if run.wandb_always_use_train_step else None,
        )
        sink.log(3, {"x": 1.0})
        sink.close()
        init_kw = fake.calls[0][1]
        assert init_kw["name"] == init_kw["group"]
        groups.append(init_kw["group"])
        assert fake.calls[1] == ("log", {"data": {"x": 1.0}, "step": 6})  # 3 rollouts x 32 samples / 16
        assert read_jsonl(tmp_path / f"run{len(groups) - 1}" / "metrics.jsonl")[0]["step"] == 3
    suffixed, plain = groups
    assert suffixed.startswith("exp_") and len(suffixed) > len("exp_") and plain == "exp"
