"""Where step metrics go: metrics.jsonl always; Prometheus, TensorBoard and W&B when asked."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from tether.records.run_dir import RunDir

log = logging.getLogger(__name__)


def _prom_name(key: str) -> str:
    return "tether_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


def tensorboard_dir(run_dir: Path, project: str | None = None, experiment: str | None = None) -> Path:
    """Where TensorBoard events go: <run dir>/tensorboard, or with slime's --tb-project-name
    tensorboard_log/<project>/<experiment> (experiment default: the run directory's name)."""
    if project is None:
        return run_dir / "tensorboard"
    return Path("tensorboard_log") / project / (experiment or run_dir.name)


class MetricsSink:
    """Fans each step's metrics out to every configured destination."""

    def __init__(
        self,
        run_dir: RunDir,
        *,
        metrics_port: int | None = None,
        use_tensorboard: bool = False,
        tb_project_name: str | None = None,
        tb_experiment_name: str | None = None,
        use_wandb: bool = False,
        wandb_project: str | None = None,
        wandb_group: str | None = None,
        wandb_team: str | None = None,
        wandb_host: str | None = None,
        wandb_key: str | None = None,
        wandb_mode: Literal["online", "offline", "disabled"] | None = None,
        wandb_dir: str | None = None,
        wandb_run_id: str | None = None,
        wandb_random_suffix: bool = False,
        tracker_step: Callable[[int], int] | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        """`wandb_random_suffix`: slime's default (off with --disable-wandb-random-suffix): the W&B
        group, and the run named after it, get a random suffix, so reruns do not merge.
        `tracker_step`: the step TensorBoard, W&B and Prometheus record for a rollout (with
        --wandb-always-use-train-step, the optimizer steps so far); metrics.jsonl keeps the rollout."""
        self.run_dir = run_dir
        self._tracker_step = tracker_step
        self._gauges: dict[str, Any] = {}
        self._registry: Any = None
        self._server: Any = None
        self._tb: Any = None
        self._wandb: Any = None
        if metrics_port is not None:
            import prometheus_client

            self._registry = prometheus_client.CollectorRegistry()
            self._server, _ = prometheus_client.start_http_server(
                metrics_port, addr="127.0.0.1", registry=self._registry
            )
        if use_tensorboard:
            if importlib.util.find_spec("tensorboard") is None:
                log.warning("--use-tensorboard: tensorboard is not installed; skipping TensorBoard events")
            else:
                from torch.utils.tensorboard import SummaryWriter

                log_dir = tensorboard_dir(run_dir.path, tb_project_name, tb_experiment_name)
                self._tb = SummaryWriter(log_dir=str(log_dir))
        if use_wandb:
            import wandb  # an optional dependency: installed by users who ask for it

            if wandb_key is not None or wandb_host is not None:
                wandb.login(key=wandb_key, host=wandb_host, relogin=wandb_key is not None)
            group, name = wandb_group, run_dir.path.name
            if wandb_group is not None:
                # slime's naming: the group (suffixed unless asked not to) names the run
                group = f"{wandb_group}_{secrets.token_hex(4)}" if wandb_random_suffix else wandb_group
                name = group
            self._wandb = wandb.init(
                project=wandb_project or "tether",
                group=group,
                entity=wandb_team,
                mode=wandb_mode,
                dir=wandb_dir or str(run_dir.path),
                id=wandb_run_id,
                resume="allow" if wandb_run_id is not None else None,
                config=config,
                name=name,
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        record = {"step": step, **metrics}
        self.run_dir.metric(record)
        if self._tracker_step is not None:
            step = self._tracker_step(step)
        numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        if self._registry is not None:
            import prometheus_client

            for key, value in {"step": float(step), **numeric}.items():
                gauge = self._gauges.get(key)
                if gauge is None:
                    gauge = self._gauges[key] = prometheus_client.Gauge(
                        _prom_name(key), key, registry=self._registry
                    )
                gauge.set(value)
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._server is not None:
            with contextlib.suppress(Exception):
                self._server.shutdown()
                self._server.server_close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
