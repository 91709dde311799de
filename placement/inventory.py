"""The device inventory: which nodes a job has, their address toward the head, and their GPUs.

Discovery reads the local GPUs through NVML (nvidia-smi as the fallback), honours the
CUDA_VISIBLE_DEVICES / SLURM GPU binding, and takes the node list from SLURM when the job has
one. `--inventory FILE.json` replaces discovery with a declared cluster.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
import subprocess
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import hostlist
import msgspec

from tether.placement.config import ClusterConfig
from tether.runtime.errors import ConfigError

# Precedence of the variables that restrict which GPUs a process may use: CUDA's own wins,
# then the step's binding, then the job's (a step may narrow the job), then the generic ordinal.
GPU_BINDING_VARIABLES = ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "GPU_DEVICE_ORDINAL")


class Gpu(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One physical GPU of a node."""

    index: int  # physical index in PCI bus order (NVML's index, CUDA_DEVICE_ORDER=PCI_BUS_ID)
    uuid: str = ""
    pci_bus_id: str = ""
    memory_mib: int = 0


class Node(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One machine of the job."""

    hostname: str
    address: str  # how the head and the other nodes reach this node
    gpus: list[Gpu] = msgspec.field(default_factory=list)


class Inventory(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The nodes a plan may use, in any order (the sorter makes the order)."""

    nodes: list[Node]

    def __post_init__(self) -> None:
        if not self.nodes:
            raise ConfigError("inventory.nodes", [], "an inventory needs at least one node")
        seen: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if not node.address:
                raise ConfigError(f"inventory.nodes[{i}].address", node.address, "must not be empty")
            if node.address in seen:
                raise ConfigError(
                    f"inventory.nodes[{i}].address",
                    node.address,
                    f"duplicates inventory.nodes[{seen[node.address]}]",
                )
            seen[node.address] = i
            indices = [gpu.index for gpu in node.gpus]
            for gpu in node.gpus:
                if gpu.index < 0:
                    raise ConfigError(f"inventory.nodes[{i}].gpus.index", gpu.index, "must be >= 0")
            if len(set(indices)) != len(indices):
                raise ConfigError(f"inventory.nodes[{i}].gpus", indices, "lists a GPU index twice")


def load_inventory(path: str | Path) -> Inventory:
    """Read a declared cluster from JSON; errors name the file and the field."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError("--inventory", str(path), f"cannot be read: {exc.strerror}") from exc
    try:
        return msgspec.json.decode(data, type=Inventory)
    except msgspec.ValidationError as exc:
        raise ConfigError("--inventory", str(path), f"invalid inventory: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ConfigError("--inventory", str(path), f"is not valid JSON: {exc}") from exc


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed node list (`node[01-04,07]`, `a[1-2]-b[3-4]`) as host names."""
    try:
        return list(hostlist.expand_hostlist(nodelist))
    except hostlist.BadHostlist as exc:
        raise ConfigError("SLURM_JOB_NODELIST", nodelist, f"is not a valid node list: {exc}") from exc


def visible_gpu_filter(env: Mapping[str, str]) -> tuple[str, list[str]] | None:
    """The first set GPU binding variable and its entries (indices or UUIDs), or None if none is set."""
    for name in GPU_BINDING_VARIABLES:
        value = env.get(name)
        if value is None:
            continue
        entries = [entry.strip() for entry in value.split(",") if entry.strip()]
        return name, entries
    return None


def apply_visibility(gpus: Sequence[Gpu], env: Mapping[str, str]) -> list[Gpu]:
    """The GPUs the binding variables leave visible, each entry a physical index or a UUID (or its prefix)."""
    binding = visible_gpu_filter(env)
    if binding is None:
        return list(gpus)
    name, entries = binding
    by_index = {gpu.index: gpu for gpu in gpus}
    chosen: dict[int, Gpu] = {}
    for entry in entries:
        if entry.isdigit():
            gpu = by_index.get(int(entry))
            if gpu is None:
                raise ConfigError(
                    name, ",".join(entries), f"names GPU {entry}, but the node has {sorted(by_index)}"
                )
        else:
            # CUDA accepts any unique UUID prefix, with or without the "GPU-" part.
            matches = [
                g for g in gpus if g.uuid and (g.uuid.startswith(entry) or g.uuid[4:].startswith(entry))
            ]
            if len(matches) != 1:
                raise ConfigError(
                    name,
                    ",".join(entries),
                    f"entry {entry!r} matches {len(matches)} GPUs by UUID, not exactly one",
                )
            gpu = matches[0]
        chosen[gpu.index] = gpu
    return [chosen[i] for i in sorted(chosen)]


def read_gpus_nvml() -> list[Gpu] | None:
    """All GPUs of this machine through NVML, or None when NVML is unavailable."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        gpus = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(
                Gpu(
                    index=i,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else str(uuid),
                    pci_bus_id=bus.decode() if isinstance(bus, bytes) else str(bus),
                    memory_mib=int(memory) // (1 << 20),
                )
            )
        return gpus
    except pynvml.NVMLError:
        return None
    finally:
        pynvml.nvmlShutdown()


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of `nvidia-smi --query-gpu=index,uuid,pci.bus_id,memory.total --format=csv,noheader`."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        fields = [field.strip() for field in line.split(",")]
        if len(fields) != 4 or not fields[0].isdigit():
            raise ValueError(f"nvidia-smi printed an unexpected row: {line!r}")
        memory = fields[3].split()[0]
        gpus.append(
            Gpu(
                index=int(fields[0]),
                uuid=fields[1],
                pci_bus_id=fields[2],
                memory_mib=int(memory) if memory.isdigit() else 0,
            )
        )
    return gpus


def read_gpus_nvidia_smi() -> list[Gpu] | None:
    """All GPUs of this machine through nvidia-smi, or None when it is missing or fails."""
    cmd = ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id,memory.total", "--format=csv,noheader,nounits"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return parse_nvidia_smi(done.stdout)


def read_local_gpus() -> list[Gpu]:
    """This machine's GPUs: NVML first, nvidia-smi as the fallback, none on a CPU-only machine."""
    gpus = read_gpus_nvml()
    if gpus is None:
        gpus = read_gpus_nvidia_smi()
    return gpus or []


def interface_address(interface: str) -> str:
    """The IPv4 address of a network interface (Linux SIOCGIFADDR)."""
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), siocgifaddr, struct.pack("256s", interface.encode()[:15]))
        except OSError as exc:
            raise ConfigError("--head-network-interface", interface, f"has no IPv4 address: {exc}") from exc
    return socket.inet_ntoa(packed[20:24])


def resolve_host(name: str) -> str | None:
    """The first address a host name resolves to (IPv4 preferred), or None if it does not resolve."""
    try:
        ipaddress.ip_address(name)
        return name
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return None
    addresses = sorted({str(info[4][0]) for info in infos}, key=lambda a: (":" in a, a))
    return addresses[0] if addresses else None


def discover_local_node(cluster: ClusterConfig, env: Mapping[str, str] | None = None) -> Node:
    """This machine as an inventory node (node agents report this to the head)."""
    env = os.environ if env is None else env
    hostname = socket.gethostname()
    if cluster.head_network_interface is not None:
        address = interface_address(cluster.head_network_interface)
    else:
        address = resolve_host(hostname) or "127.0.0.1"
    gpus = [] if cluster.cpu_devices is not None else apply_visibility(read_local_gpus(), env)
    return Node(hostname=hostname, address=address, gpus=gpus)


def route_source_address(peer: str) -> str | None:
    """This machine's address on the route to `peer` (a UDP connect picks the route and sends
    nothing), or None when there is no route."""
    family = socket.AF_INET6 if ":" in peer else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as sock:
            sock.connect((peer, 9))
            return str(sock.getsockname()[0])
    except OSError:
        return None


def _is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def discover_inventory(
    cluster: ClusterConfig,
    env: Mapping[str, str] | None = None,
    local: Callable[[ClusterConfig, Mapping[str, str]], Node] = discover_local_node,
    resolve: Callable[[str], str | None] = resolve_host,
    route: Callable[[str], str | None] = route_source_address,
) -> Inventory:
    """The declared inventory if --inventory is set; else SLURM's node list, else this machine alone.

    The head sees only its own GPUs; SLURM allocates the same binding on every node of a job, so
    other nodes are assumed to have this node's GPUs (or --num-gpus-per-node GPUs when the head is
    not one of the job's nodes). Node agents report the real devices when they start.
    """
    if cluster.inventory is not None:
        return load_inventory(cluster.inventory)
    env = os.environ if env is None else env
    here = local(cluster, env)
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        return Inventory(nodes=[here])
    names = expand_nodelist(nodelist)
    short = here.hostname.split(".")[0]
    head_is_node = any(name == here.hostname or name == short for name in names)
    template = here.gpus if head_is_node else [Gpu(index=i) for i in range(cluster.num_gpus_per_node)]
    nodes = []
    for name in names:
        if name in (here.hostname, short):
            nodes.append(here)
        else:
            nodes.append(Node(hostname=name, address=resolve(name) or name, gpus=list(template)))
    # Debian and Ubuntu resolve a machine's own name to 127.0.1.1: the other nodes could not
    # reach a rendezvous or weight-sync address there. Take the address on the route to them.
    away = [n.address for n in nodes if n is not here and not _is_loopback(n.address)]
    if cluster.head_network_interface is None and _is_loopback(here.address) and away:
        found = route(away[0])
        if found is not None and not _is_loopback(found):
            moved = msgspec.structs.replace(here, address=found)
            nodes = [moved if n is here else n for n in nodes]
    return Inventory(nodes=nodes)
