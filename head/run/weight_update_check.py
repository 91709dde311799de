"""--check-weight-update-equal: a weight update must reproduce the engines' weights exactly.

slime (train.py, slime/ray/placement_group.py): once the engines are up, each snapshots the
weights it loaded and overwrites them with noise (SGLang's /weights_checker, actions `snapshot`
then `reset_tensors`); the trainer then publishes its weights, which slime always does before
the first rollout; then each engine compares its weights with the snapshot (`compare`). Any
tensor that differs fails the run, named with its error.

tether publishes nothing at a fresh start (the engines loaded the same --hf-checkpoint), so with
this flag it publishes the trainer's weights as the next version before the first rollout, as
slime does; a resumed or re-started run publishes anyway.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from tether.rollout.engine_api.client import EngineClient, EngineError

if TYPE_CHECKING:
    from tether.rollout.routing.router import Router
    from tether.run.steps import Steps


class WeightUpdateMismatch(RuntimeError):
    """An engine's weights after the update differ from what it loaded."""


async def _compare(client: EngineClient) -> str | None:
    try:
        await client.check_weights("compare")
    except EngineError as exc:
        return exc.message
    return None


async def snapshot_engine_weights(router: Router) -> None:
    """slime's first half: each engine snapshots the weights it loaded, then overwrites them."""
    await router.broadcast(lambda client: client.check_weights("snapshot"))
    await router.broadcast(lambda client: client.check_weights("reset_tensors"))


async def resume_checking_weight_update(
    steps: Steps, resume: Callable[[], Awaitable[int]], *, snapshot: bool = True
) -> int:
    """`resume()` (which may publish weights), framed by slime's snapshot/reset and compare; the
    first rollout id `resume` returns. `snapshot=False`: taken already (colocated engines take it
    at launch, before they release their weights)."""
    router = steps.rollouts.router
    if router is None or steps.trainer is None or steps.engines is None:
        raise RuntimeError("--check-weight-update-equal needs engines and a trainer")  # refused at parse time
    if snapshot:
        await snapshot_engine_weights(router)
    published = steps.version
    start = await resume()
    if steps.version == published:  # nothing published yet: publish the trainer's weights now
        await steps.sync_weights(-1)
    failures = {name: msg for name, msg in (await router.broadcast(_compare)).items() if msg is not None}
    if failures:
        detail = "\n".join(f"engine {name}: {msg}" for name, msg in failures.items())
        raise WeightUpdateMismatch(
            f"--check-weight-update-equal: after weight update v{steps.version} the engines' weights differ "
            f"from those they loaded:\n{detail}"
        )
    steps.run_dir.event("weight_update_equal", version=steps.version, engines=len(steps.engines.urls))
    return start
