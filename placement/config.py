"""Configuration slice for placement: how many devices each role gets and where processes may run.

Field names are slime's cluster flags (flag = `--` + name with `_` → `-`) with slime's defaults,
so a slime launch script parses unchanged; tether's additions have self-explaining names.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from tether.runtime.errors import ConfigError


class ClusterConfig(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Where processes run: device counts per role, colocation, offload, engine groups and ports."""

    actor_num_nodes: Annotated[int, Meta(ge=0, description="Number of nodes for the training actor.")] = 1
    actor_num_gpus_per_node: Annotated[
        int, Meta(ge=0, description="Devices (GPUs, or CPU slots) per node for the training actor.")
    ] = 8
    rollout_num_gpus: Annotated[
        Annotated[int, Meta(ge=0)] | None,
        Meta(
            description="Devices for rollout engines in total; default: the actor's under --colocate, "
            "else every device the trainer groups leave free.",
        ),
    ] = None
    rollout_num_gpus_per_engine: Annotated[
        int, Meta(ge=1, description="Devices per rollout engine (the engine's tensor-parallel size).")
    ] = 1
    num_gpus_per_node: Annotated[
        int, Meta(ge=1, description="Devices per node for rollout (used when discovery cannot see a node).")
    ] = 8
    colocate: Annotated[
        bool, Meta(description="Train and generate on the same devices (implies both offloads).")
    ] = False
    offload: Annotated[bool, Meta(description="Same as --offload-train plus --offload-rollout.")] = False
    offload_train: Annotated[
        bool | None,
        Meta(
            description="Move the trainer's memory to host RAM while engines generate (default: --colocate)."
        ),
    ] = None
    offload_rollout: Annotated[
        bool | None,
        Meta(description="Release the engines' memory while the trainer trains (default: --colocate)."),
    ] = None
    critic_num_nodes: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Nodes for a critic training group; unset means no critic group."),
    ] = None
    critic_num_gpus_per_node: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Devices per node for the critic (default: the actor's)."),
    ] = None
    critic_separate_gpus: Annotated[
        bool,
        Meta(description="Give the critic its own devices instead of sharing the actor's (slime shares)."),
    ] = False
    ref_num_nodes: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Nodes for a separate reference-model group; unset: the actor ranks hold it."),
    ] = None
    ref_num_gpus_per_node: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Devices per node for the reference group (default: the actor's)."),
    ] = None
    cpu_devices: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(description="Plan on this many CPU device slots per node instead of GPUs (no CUDA)."),
    ] = None
    inventory: Annotated[
        str | None,
        Meta(description="JSON file declaring the cluster (nodes, addresses, GPUs); replaces discovery."),
    ] = None
    sglang_config: Annotated[
        str | None,
        Meta(
            description="YAML of engine server groups (worker_type, num_gpus, num_gpus_per_engine, overrides)."
        ),
    ] = None
    prefill_num_servers: Annotated[
        Annotated[int, Meta(ge=1)] | None,
        Meta(
            description="Prefill/decode disaggregation without a YAML (slime's legacy flag): this many "
            "prefill engines of --rollout-num-gpus-per-engine devices, the rest of the rollout devices "
            "decode engines (as --sglang-config's prefill and decode server groups)."
        ),
    ] = None
    rollout_external: Annotated[
        bool, Meta(description="Use engines started outside tether (see --rollout-external-engine-addrs).")
    ] = False
    rollout_external_engine_addrs: Annotated[
        list[str], Meta(description="host:port of each externally started engine; tether starts none.")
    ] = msgspec.field(default_factory=list)
    rollout_engines_may_span_nodes: Annotated[
        bool,
        Meta(
            description="Allow an engine that fits in a node to straddle two (SGLang --nnodes/--node-rank/"
            "--dist-init-addr); an engine wider than a node spans nodes without it, as in slime."
        ),
    ] = False
    node_port_first: Annotated[
        int, Meta(ge=1024, le=65535, description="First port tether may assign on each node.")
    ] = 20000
    node_port_last: Annotated[
        int, Meta(ge=1024, le=65535, description="Last port tether may assign on each node.")
    ] = 29999
    head_network_interface: Annotated[
        str | None,
        Meta(description="Network interface (e.g. eth0) whose address nodes use toward the head."),
    ] = None

    def __post_init__(self) -> None:
        if self.node_port_last < self.node_port_first:
            raise ConfigError(
                "--node-port-last", self.node_port_last, f"is below --node-port-first={self.node_port_first}"
            )
        if self.rollout_external and not self.rollout_external_engine_addrs:
            raise ConfigError(
                "--rollout-external-engine-addrs",
                [],
                "--rollout-external needs at least one engine host:port",
            )
        for addr in self.rollout_external_engine_addrs:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError("--rollout-external-engine-addrs", addr, "each address must be host:port")
        if self.rollout_external_engine_addrs and self.colocate:
            raise ConfigError(
                "--colocate",
                True,
                "external engines run on their own machines; they cannot share actor devices",
            )
        if self.prefill_num_servers is not None and (
            self.sglang_config is not None or self.rollout_external_engine_addrs
        ):
            raise ConfigError(
                "--prefill-num-servers",
                self.prefill_num_servers,
                "cannot be set with --sglang-config (use its prefill/decode server groups) or with "
                "external engines (slime's rule)",
            )
        if self.rollout_external_engine_addrs and self.sglang_config is not None:
            raise ConfigError(
                "--sglang-config", self.sglang_config, "server groups cannot be set with external engines"
            )
        if self.cpu_devices is not None and self.offloads_train and (self.offload_train or self.offload):
            # Asked for explicitly (--colocate's implied offload is moot on CPU: nothing to free).
            raise ConfigError(
                "--offload-train" if self.offload_train else "--offload",
                True,
                "moves the trainer's weights, gradients and optimizer state out of GPU memory while "
                "engines generate; it needs CUDA, and this run plans on CPU devices (--cpu-devices)"
                + ("" if self.offload_train else "; --offload-rollout alone releases the engines' memory"),
            )

    @property
    def uses_external_engines(self) -> bool:
        """Engines are given by address: tether starts none and reserves no devices for them."""
        return bool(self.rollout_external_engine_addrs)

    @property
    def offloads_train(self) -> bool:
        """Whether the trainer offloads between phases (slime: forced on by --colocate)."""
        if self.offload_train is not None:
            return self.offload_train
        return self.offload or self.colocate

    @property
    def offloads_rollout(self) -> bool:
        """Whether engines release memory between phases (slime: forced on by --colocate)."""
        if self.offload_rollout is not None:
            return self.offload_rollout
        return self.offload or self.colocate
