"""torchrun, with the rendezvous store listening on the rendezvous address alone.

`python -m tether.train.rank.torchrun ARGS` is `python -m torch.distributed.run ARGS`, except on
node rank 0 of a static rendezvous (`--master-addr`, `--master-port`, `--node-rank`): there
torchrun's TCP store would listen on every interface of the machine. This module starts the
store's server first, bound to the master address only (runtime/netif.py), and keeps it for
the launch; torchrun's own store (multi-tenant, same port) then uses that server. Where the
address cannot be bound here, torchrun runs exactly as it would by itself.

When the command is tether's worker, the ranks are forked from a zygote that imported their
modules once (`tether.train.rank.zygote`); it starts before anything else here, which is why
torch is imported in the functions below.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

from tether.runtime.netif import bound_listener
from tether.runtime.process.gc_tuning import imports_without_gc
from tether.train.rank import zygote as rank_zygote

if TYPE_CHECKING:
    import torch.distributed as dist

# torchrun's default static-rendezvous timeout; it bounds this store's own calls only.
RENDEZVOUS_TIMEOUT = timedelta(seconds=600)


def rendezvous_store(argv: Sequence[str]) -> dist.TCPStore | None:
    """On node rank 0 of a static rendezvous: the store server torchrun will join, listening on
    the master address alone; else None (torchrun makes its store as usual)."""
    import torch.distributed as dist
    from torch.distributed.run import parse_args

    args = parse_args(list(argv))  # torchrun's own parser: the same reading of the same flags
    static = args.rdzv_backend == "static" and not args.rdzv_endpoint and not args.standalone
    if not static or args.node_rank != 0 or not args.master_addr or not args.master_port:
        return None
    listener = bound_listener(args.master_addr, args.master_port)
    if listener is None:
        return None
    return dist.TCPStore(
        args.master_addr,
        args.master_port,
        None,
        is_master=True,
        timeout=RENDEZVOUS_TIMEOUT,
        wait_for_workers=False,
        multi_tenant=True,
        master_listen_fd=listener.detach(),  # the store owns the descriptor now
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    forked = rank_zygote.wanted(args)
    if forked:
        rank_zygote.start()  # first: before this process starts a thread or opens the store
    with imports_without_gc():
        import torch.distributed.run  # noqa: F401  # the agent's own import of torch
    store = rendezvous_store(args)  # referenced until torchrun returns: the server lives as long
    if not (forked and rank_zygote.launch(args)):
        from torch.distributed.run import main as torchrun_main

        torchrun_main(args)
    del store


if __name__ == "__main__":
    main()
