"""--use-stateless-adam: Adam whose moments are zero at the start of every step (slime's flag).

The optimizer alone against torch's Adam/AdamW rebuilt before each step, then a real tiny llama
built through tether's model builder in this process (a one-rank gloo group, no process started):
its steps give the weights of Adam with --reset-optimizer-states' reset before every step, with no
optimizer state held, for Megatron's fp32 and distributed optimizers. And the flag's refusals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_train_mtp import one_rank  # noqa: F401  (the one-rank Megatron fixture)

from tether.config import resolve
from tether.runtime.errors import ConfigError
from tether.train.config import AlgorithmConfig, MegatronConfig
from tether.train.model.stateless_adam import StatelessAdam
from tether.train.state.optimizer_reset import reset_optimizer_states

S, B, STEPS = 12, 2, 3


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(6, 4)


def _grads(step: int, model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(step)
    for p in model.parameters():
        # Spread over magnitudes, some near eps, so |g| + eps is not just sign(g).
        p.grad = torch.randn(p.shape, generator=g) * 10.0 ** torch.randint(-9, 1, p.shape, generator=g)


@pytest.mark.parametrize("decoupled", [True, False])
def test_each_step_is_adams_first_step_from_zero_moments(decoupled: bool) -> None:
    kw: dict[str, Any] = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    fresh_adam = torch.optim.AdamW if decoupled else torch.optim.Adam
    ours, theirs = _linear(), _linear()
    stateless = StatelessAdam(ours.parameters(), decoupled_weight_decay=decoupled, **kw)
    for step in range(STEPS):
        _grads(step, ours)
        _grads(step, theirs)
        stateless.step()
        fresh_adam(theirs.parameters(), **kw).step()  # a new Adam each step: zero moments, step 1
        assert not stateless.state  # nothing kept between steps
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_loaded_state_is_dropped() -> None:
    model = _linear()
    adam = torch.optim.AdamW(model.parameters())
    _grads(0, model)
    adam.step()
    stateless = StatelessAdam(model.parameters())
    stateless.load_state_dict(adam.state_dict())
    assert not stateless.state and stateless.param_groups[0]["lr"] == adam.param_groups[0]["lr"]
    stateless.state[model.weight]["exp_avg"] = torch.zeros_like(model.weight)  # as a checkpoint load's
    stateless.step()
    assert not stateless.state


# ----- a real Megatron optimizer on one rank -----


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("llama") / "m", TinyModelSpec(seed=2))


def _train(topo: Any, hf: Path, *, distributed: bool, stateless: bool, reset: bool) -> tuple[Any, dict]:
    from tether.train.model import build as tm

    # A larger eps than the default: near-zero gradients would turn last-bit differences of the two
    # formulas into visible ones after a step (d/dg of g / (|g| + eps) is 1 / eps at 0). A weight
    # decay large enough that leaving it out would show.
    megatron = MegatronConfig(
        lr_decay_style="constant",
        adam_eps=1e-4,
        weight_decay=0.5,
        use_distributed_optimizer=distributed,
        use_stateless_adam=stateless,
    )
    opts = tm.ModelOptions(hf_checkpoint=str(hf), megatron=megatron, algorithm=AlgorithmConfig(lr=1e-2))
    actor = tm.build_actor(opts, topo)
    (ddp,) = actor.chunks
    mask = torch.triu(torch.ones(S, S, dtype=torch.bool), diagonal=1)[None, None]
    pos = torch.arange(S).expand(B, S)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        tokens, targets = torch.randint(0, 300, (2, B, S), generator=g)
        ddp.zero_grad_buffer()
        actor.optimizer.zero_grad()
        if reset:
            reset_optimizer_states(actor.optimizer)
        logits = ddp(tokens, pos, mask)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        ddp.finish_grad_sync()
        ok, _, _ = actor.optimizer.step()
        assert ok
    weights = {n: p.detach().clone() for n, p in ddp.named_parameters()}
    return actor, weights


def _inner(actor: Any) -> list[Any]:
    return [o.optimizer for o in getattr(actor.optimizer, "chained_optimizers", [actor.optimizer])]


def _state_bytes(actor: Any) -> int:
    return sum(
        t.numel() * t.element_size()
        for inner in _inner(actor)
        for st in inner.state.values()
        for t in st.values()
        if torch.is_tensor(t)
    )


# Megatron's and mbridge's import-time deprecations, as in test_train_mtp.py; the distributed
# optimizer's torch.distributed.reduce_scatter_tensor is deprecated too.
@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("distributed", [False, True], ids=["fp32_optimizer", "distributed_optimizer"])
def test_stateless_adam_trains_as_adam_reset_before_every_step_and_holds_no_state(
    one_rank: Any,  # noqa: F811
    llama_dir: Path,
    distributed: bool,
) -> None:
    stateless, got = _train(one_rank, llama_dir, distributed=distributed, stateless=True, reset=False)
    reset, want = _train(one_rank, llama_dir, distributed=distributed, stateless=False, reset=True)
    _, plain = _train(one_rank, llama_dir, distributed=distributed, stateless=False, reset=False)
    assert all(isinstance(inner, StatelessAdam) for inner in _inner(stateless))
    for name, value in want.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=5e-6, msg=name)
    # Adam that keeps its moments goes elsewhere after the first step: the comparison can fail.
    assert max(float((got[n] - plain[n]).abs().max()) for n in plain) > 1e-3
    assert _state_bytes(reset) > 0 and _state_bytes(stateless) == 0
    # Megatron's state allocation before a checkpoint load allocates nothing either.
    for megatron_optimizer in getattr(stateless.optimizer, "chained_optimizers", [stateless.optimizer]):
        megatron_optimizer.init_state_fn(megatron_optimizer.optimizer, megatron_optimizer.config)
    assert _state_bytes(stateless) == 0


# ----- the flag -----

RUN = ["--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2"]


def test_the_flag_reaches_the_megatron_slice() -> None:
    assert not resolve(RUN).megatron.use_stateless_adam
    assert resolve([*RUN, "--use-stateless-adam"]).megatron.use_stateless_adam
    saved = resolve([*RUN, "--use-stateless-adam", "--save", "/tmp/ckpt", "--no-save-optim"])
    assert saved.megatron.use_stateless_adam and saved.algorithm.no_save_optim


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--optimizer", "sgd"], "--optimizer is sgd"),
        (["--use-precision-aware-optimizer"], "--use-precision-aware-optimizer"),
        (["--save", "/tmp/ckpt"], "add --no-save-optim"),
    ],
)
def test_contradictions_are_refused_naming_the_flag(argv: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why) as err:
        resolve([*RUN, "--use-stateless-adam", *argv])
    assert (err.value.key, err.value.value) == ("--use-stateless-adam", True)
