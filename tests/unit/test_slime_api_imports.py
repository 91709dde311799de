"""`import slime` on tether: the import hook (never over a real slime), Ray-only names, and the
hook checks `tether plan` and `tether run` make before anything starts."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.rollout import make_config

from tether.commands.plan import main_argv as plan_main
from tether.rollout.hooks.calls import load_function
from tether.rollout.hooks.checks import check_hooks
from tether.rollout.slime_api import finder
from tether.rollout.slime_api.finder import RayRequired
from tether.runtime.errors import ConfigError


def _forget_slime() -> None:
    finder.uninstall()
    for name in [n for n in sys.modules if n == "slime" or n.startswith("slime.")]:
        del sys.modules[name]
    importlib.invalidate_caches()


@pytest.fixture(autouse=True)
def no_slime() -> Iterator[None]:
    _forget_slime()
    yield
    _forget_slime()


def _fake_slime(root: Path) -> None:
    """A stand-in for an installed slime: a package on sys.path that says it is the real one."""
    (root / "slime" / "utils").mkdir(parents=True)
    (root / "slime" / "__init__.py").write_text("REAL = True\n")
    (root / "slime" / "utils" / "__init__.py").write_text("")
    (root / "slime" / "utils" / "types.py").write_text("class Sample:\n    real = True\n")


def test_without_slime_the_names_resolve_to_tethers_api() -> None:
    assert finder.install() is True and finder.installed()
    assert finder.install() is True  # once is enough
    assert [type(f).__name__ for f in sys.meta_path].count("SlimeFinder") == 1
    import slime.utils.types
    from slime.rollout.filter_hub.base_types import DynamicFilterOutput
    from slime.rollout.sglang_rollout import GenerateState, generate, generate_and_rm, generate_and_rm_group
    from slime.utils.http_utils import get, init_http_client, post

    import tether.rollout.slime_api.utils.types as ours

    assert slime.utils.types.Sample is ours.Sample
    assert ours.__spec__ is not None and ours.__spec__.name == "tether.rollout.slime_api.utils.types"
    assert DynamicFilterOutput(keep=True).keep
    assert all(callable(f) for f in (GenerateState, generate, generate_and_rm, generate_and_rm_group))
    assert all(callable(f) for f in (get, post, init_http_client))
    # Of slime's trainer, only the CP helpers loss hooks import (mis.py's) are there.
    from slime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp

    assert callable(all_gather_with_cp) and callable(slice_log_prob_with_cp)
    with pytest.raises(
        ModuleNotFoundError, match=r"slime\.backends\.megatron_utils\.actor is not part of tether"
    ):
        importlib.import_module("slime.backends.megatron_utils.actor")


def test_an_installed_slime_is_never_shadowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_slime(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert finder.install() is False and not finder.installed()
    hook = tmp_path / "hook.py"
    hook.write_text(
        "from slime.utils.types import Sample\ndef reward(args, sample):\n    return Sample.real\n"
    )
    assert load_function(f"{hook}:reward", "--custom-rm-path")(None, None) is True
    assert not finder.installed()
    import slime

    assert slime.REAL


def test_a_slime_that_appears_later_wins_over_the_installed_hook(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert finder.install() is True
    _fake_slime(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    import slime.utils.types

    assert slime.REAL and slime.utils.types.Sample.real  # type: ignore[attr-defined]


def test_names_that_need_ray_import_and_refuse_when_used() -> None:
    finder.install()
    from slime.ray.buffer import Buffer
    from slime.ray.rollout import RolloutManager
    from slime.utils.http_utils import init_http_client
    from slime.utils.misc import get_current_node_ip

    def annotated(data_buffer: Buffer) -> None:  # naming it in a signature works
        return None

    assert annotated.__annotations__
    with pytest.raises(
        RayRequired,
        match=r"slime\.ray\.buffer\.Buffer\.remote needs Ray's rollout buffer actor; tether has no Ray",
    ):
        Buffer.remote()
    with pytest.raises(RayRequired, match=r"slime\.ray\.rollout\.RolloutManager\(\) needs Ray"):
        RolloutManager()
    with pytest.raises(RayRequired, match=r"get_current_node_ip\(\) needs Ray"):
        get_current_node_ip()
    with pytest.raises(RayRequired, match="use_distributed_post"):
        init_http_client(type("Args", (), {"use_distributed_post": True})())
    init_http_client(type("Args", (), {"use_distributed_post": False})())  # tether's client needs no set-up


def _hooks(tmp_path: Path) -> Path:
    path = tmp_path / "hooks.py"
    path.write_text(
        "from slime.utils.types import Sample\n"
        "async def generate(args, sample, sampling_params):\n    return sample\n"
        "async def reward(args, sample, **kwargs):\n    return 1.0\n"
        "async def reward_needs_more(args, sample, tokenizer):\n    return 1.0\n"
        "def keep(args, samples, **kwargs):\n    return True\n"
        "async def keep_async(args, samples):\n    return True\n"
        "def pick(args, rollout_id, buffer, num_samples):\n    return []\n"
        "def rollout(args, rollout_id, data_source):\n    return []\n"
        "def process_all(args, all_samples, data_source):\n    pass\n"
        "def log_rollout(rollout_id, args, samples, rollout_extra_metrics, rollout_time):\n    return False\n"
        "def log_eval(rollout_id, args, data, extra_metrics):\n    return False\n"
        "NOT_CALLABLE = 3\n"
    )
    return path


def test_hook_checks_pass_good_hooks(tmp_path: Path) -> None:
    hooks = _hooks(tmp_path)
    check_hooks(
        make_config(
            rollout={
                "custom_generate_function_path": f"{hooks}:generate",
                "custom_rm_path": f"{hooks}:reward",
                "dynamic_sampling_filter_path": f"{hooks}:keep",
                "buffer_filter_path": f"{hooks}:pick",
                "rollout_function_path": "slime.rollout.sglang_rollout.generate_rollout",
                "rollout_sample_filter_path": f"{hooks}:keep",
                "rollout_all_samples_process_path": f"{hooks}:process_all",
                "custom_rollout_log_function_path": f"{hooks}:log_rollout",
                "custom_eval_rollout_log_function_path": f"{hooks}:log_eval",
            }
        ).rollout
    )


@pytest.mark.parametrize(
    ("field", "target", "message"),
    [
        ("custom_rm_path", "no_such_module_xyz.reward", "cannot be imported: ModuleNotFoundError"),
        ("custom_rm_path", "{hooks}:nope", "has no attribute 'nope'"),
        ("custom_rm_path", "{hooks}:NOT_CALLABLE", "is not callable"),
        ("custom_rm_path", "{hooks}:reward_needs_more", r"cannot be called as await fn\(args, sample\)"),
        ("dynamic_sampling_filter_path", "{hooks}:keep_async", "is async, but it is called without await"),
        (
            "buffer_filter_path",
            "{hooks}:keep",
            r"cannot be called as fn\(args, rollout_id, buffer, num_samples\)",
        ),
        ("rollout_function_path", "{hooks}:rollout", "unexpected keyword argument 'evaluation'"),
        ("rollout_sample_filter_path", "{hooks}:keep_async", "is async, but it is called without await"),
        (
            "rollout_all_samples_process_path",
            "{hooks}:keep",
            r"cannot be called as fn\(args, all_samples, data_source\)",
        ),
        (
            "custom_rollout_log_function_path",
            "{hooks}:log_eval",
            r"cannot be called as fn\(rollout_id, args, samples, rollout_extra_metrics, rollout_time\)",
        ),
        (
            "custom_eval_rollout_log_function_path",
            "{hooks}:log_rollout",
            r"cannot be called as fn\(rollout_id, args, data, extra_metrics\)",
        ),
    ],
)
def test_hook_checks_refuse_naming_flag_path_and_reason(
    tmp_path: Path, field: str, target: str, message: str
) -> None:
    path = target.format(hooks=_hooks(tmp_path))
    flag = "--" + field.replace("_", "-")
    with pytest.raises(ConfigError, match=message) as err:
        check_hooks(make_config(rollout={field: path}).rollout)
    assert err.value.key == flag and err.value.value == path


def test_tether_plan_refuses_a_bad_hook_before_planning(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hooks = _hooks(tmp_path)
    assert plan_main(["--custom-rm-path", f"{hooks}:reward_needs_more"]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("tether plan: --custom-rm-path=")
        and "reward_needs_more(args, sample, tokenizer)" in err
    )
