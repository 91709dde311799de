"""Checkpoint layouts on disk, trackers, TE/local parameter names, slime's start choice,
--save-hf paths and `tether convert`'s argument checks: pure functions over paths."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tether.runtime.errors import ConfigError
from tether.train.checkpoint import layout as cl
from tether.train.checkpoint.layout import Layout, StartKind, choose_start, start_attempts
from tether.train.checkpoint.names import alternative_keys, is_extra_state, rename_for_checkpoint


def megatron_dir(path: Path) -> Path:
    """A checkpoint directory as Megatron-LM (or slime's converter) leaves it."""
    path.mkdir(parents=True)
    (path / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    (path / "__0_0.distcp").write_bytes(b"x")
    return path


def tether_dir(path: Path) -> Path:
    megatron_dir(path)
    (path / "tether").mkdir()
    (path / "tether" / "run_state.msgpack").write_bytes(b"\x80")
    return path


def legacy_dir(path: Path) -> Path:
    (path / "model_optim").mkdir(parents=True)
    (path / "run_state.msgpack").write_bytes(b"\x80")
    return path


def hf_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"")
    return path


def test_layouts_are_told_apart(tmp_path: Path) -> None:
    assert cl.layout_of(megatron_dir(tmp_path / "a")) is Layout.MEGATRON
    assert cl.layout_of(tether_dir(tmp_path / "b")) is Layout.TETHER
    assert cl.layout_of(legacy_dir(tmp_path / "c")) is Layout.LEGACY
    half = tmp_path / "d"
    (half / "tether").mkdir(parents=True)  # a save cut short before dist_checkpointing finished
    assert cl.layout_of(half) is None
    assert cl.digests_name(tmp_path / "b") == "tether/digests.msgpack"
    assert cl.digests_name(tmp_path / "c") == "digests.msgpack"
    assert cl.model_dir(tmp_path / "c") == tmp_path / "c" / "model_optim"
    assert cl.model_dir(tmp_path / "b") == tmp_path / "b"


@pytest.mark.parametrize(("text", "want"), [("12", 12), (" 7\n", 7), ("release", None), ("release\n", None)])
def test_tracker_text(text: str, want: int | None) -> None:
    assert cl.parse_tracker(text) == want


@pytest.mark.parametrize("text", ["", "-1", "12a", "Release", "latest"])
def test_a_bad_tracker_names_its_file(text: str) -> None:
    with pytest.raises(ValueError, match=r"latest_checkpointed_iteration\.txt"):
        cl.parse_tracker(text)


def test_the_tracker_names_the_first_candidate_then_tethers_newest_first(tmp_path: Path) -> None:
    for step in (1, 3, 5):
        tether_dir(tmp_path / cl.iter_dir_name(step))
    megatron_dir(tmp_path / "iter_0000009")  # another tool's, not named: never a candidate
    (tmp_path / cl.TRACKER).write_text("3")
    assert cl.candidates(tmp_path) == [tmp_path / f"iter_000000{i}" for i in (3, 5, 1)]
    (tmp_path / cl.TRACKER).write_text("9")
    assert cl.candidates(tmp_path)[0] == tmp_path / "iter_0000009"
    (tmp_path / cl.TRACKER).write_text("8")  # names nothing complete: the newest complete one
    assert cl.first_candidate(tmp_path) == tmp_path / "iter_0000005"
    assert cl.complete_steps(tmp_path) == [1, 3, 5]


def test_release_and_a_directory_named_itself(tmp_path: Path) -> None:
    root = tmp_path / "Qwen3-4B_torch_dist"
    megatron_dir(root / "release")
    (root / cl.TRACKER).write_text("release")
    assert cl.candidates(root) == [root / "release"]
    assert cl.holds_megatron_checkpoint(root)
    assert cl.candidates(root / "release") == [root / "release"]
    one = megatron_dir(tmp_path / "run" / "iter_0000004")
    assert (
        cl.candidates(one) == [one]
        and cl.iteration_of(one) == 4
        and cl.iteration_of(root / "release") is None
    )


def test_tethers_previous_tracker_is_read(tmp_path: Path) -> None:
    for step in (1, 2):
        legacy_dir(tmp_path / cl.iter_dir_name(step))
    (tmp_path / cl.LEGACY_TRACKER).write_text("1")
    assert cl.first_candidate(tmp_path) == tmp_path / "iter_0000001"
    tether_dir(tmp_path / "iter_0000003")  # a resumed run saves the new layout beside the old
    (tmp_path / cl.TRACKER).write_text("3")
    assert cl.candidates(tmp_path) == [tmp_path / f"iter_000000{i}" for i in (3, 2, 1)]


def test_hf_directory_detection(tmp_path: Path) -> None:
    assert cl.is_hf_checkpoint(hf_dir(tmp_path / "hf"))
    assert not cl.is_hf_checkpoint(megatron_dir(tmp_path / "mg"))
    no_weights = tmp_path / "cfg"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    assert not cl.is_hf_checkpoint(no_weights)


def test_slime_start_choice(tmp_path: Path) -> None:
    ref = str(megatron_dir(tmp_path / "ref" / "release").parent)
    (Path(ref) / cl.TRACKER).write_text("release")
    save = tmp_path / "save"
    # --load holding a Megatron checkpoint: resume from it.
    tether_dir(save / "iter_0000002")
    (save / cl.TRACKER).write_text("2")
    got = choose_start(str(save), ref)
    assert (got.kind, got.path, got.flag, got.finetune) == (StartKind.RESUME, str(save), "--load", False)
    # --load an HF directory: its weights, a fresh run.
    hf = str(hf_dir(tmp_path / "hf"))
    got = choose_start(hf, ref)
    assert (got.kind, got.path, got.finetune) == (StartKind.HF_LOAD, hf, True)
    # --load holding nothing (a first launch with --load = --save): --ref-load, fresh.
    empty = tmp_path / "empty"
    empty.mkdir()
    got = choose_start(str(empty), ref)
    assert (got.kind, got.path, got.flag, got.finetune) == (StartKind.REF_LOAD, ref, "--ref-load", True)
    assert "holds no checkpoint" in got.reason
    assert choose_start(None, ref).kind is StartKind.REF_LOAD
    assert choose_start(None, None).kind is StartKind.HF_CHECKPOINT
    assert choose_start(str(empty), None).kind is StartKind.HF_CHECKPOINT
    # --auto-resume: --save once it holds a checkpoint, else as without it.
    got = choose_start(None, ref, auto_resume=True, save=str(save))
    assert (got.kind, got.path, got.flag) == (StartKind.RESUME, str(save), "--save")
    assert choose_start(None, ref, auto_resume=True, save=str(empty)).kind is StartKind.REF_LOAD
    # An iter directory named itself resumes from it.
    assert choose_start(str(save / "iter_0000002"), None).kind is StartKind.RESUME


@pytest.mark.parametrize(
    ("key", "alts"),
    [
        (
            "decoder.layers.input_layernorm.weight",
            ["decoder.layers.self_attention.linear_qkv.layer_norm_weight"],
        ),
        (
            "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
            ["decoder.layers.input_layernorm.weight"],
        ),
        ("decoder.layers.pre_mlp_layernorm.weight", ["decoder.layers.mlp.linear_fc1.layer_norm_weight"]),
        ("decoder.layers.3.mlp.linear_fc1.layer_norm_bias", ["decoder.layers.3.pre_mlp_layernorm.bias"]),
        (
            "decoder.layers.self_attention.q_layernorm.weight",
            ["decoder.layers.self_attention.linear_q_up_proj.layer_norm_weight"],
        ),
        (
            "decoder.layers.self_attention.linear_kv_up_proj.layer_norm_weight",
            ["decoder.layers.self_attention.kv_layernorm.weight"],
        ),
        (
            "mtp.layers.0.transformer_layer.input_layernorm.weight",
            ["mtp.layers.0.transformer_layer.self_attention.linear_qkv.layer_norm_weight"],
        ),
        ("decoder.layers.self_attention.linear_qkv.weight", []),
        ("embedding.word_embeddings.weight", []),
    ],
)
def test_te_and_local_names(key: str, alts: list[str]) -> None:
    assert alternative_keys(key) == alts


def test_renames_ask_the_name_the_checkpoint_has() -> None:
    have = {"decoder.layers.input_layernorm.weight", "decoder.layers.self_attention.linear_qkv.weight"}
    want = [
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight",
        "decoder.layers.self_attention.linear_qkv.weight",
    ]
    assert rename_for_checkpoint(want, have) == {want[0]: "decoder.layers.input_layernorm.weight"}
    with pytest.raises(KeyError, match=r"output_layer\.weight"):
        rename_for_checkpoint(["output_layer.weight"], have)
    assert is_extra_state("decoder.layers.self_attention.linear_qkv._extra_state")
    assert is_extra_state("decoder.layers.mlp.linear_fc1._extra_state/shard_0_2")
    assert not is_extra_state("decoder.layers.mlp.linear_fc1.weight")


def test_save_hf_paths_are_slimes_template() -> None:
    assert cl.save_hf_path("/out/hf_{rollout_id}", 19) == "/out/hf_19"
    assert cl.save_hf_path("/out/hf", 19) == "/out/hf"
    with pytest.raises(ConfigError, match="--save-hf"):
        cl.save_hf_path("/out/{step}", 1)


def test_save_hf_template_is_refused_at_parse_time() -> None:
    from tether.config import Config, RunConfig

    with pytest.raises(ConfigError, match="--save-hf"):
        Config(run=RunConfig(save_hf="/out/{step}"))


def _convert_args(**kw: object) -> argparse.Namespace:
    return argparse.Namespace(**{"nproc": 1, **kw})


def test_convert_checks_name_the_flag(tmp_path: Path) -> None:
    from tether.commands.convert import check

    hf = hf_dir(tmp_path / "hf")
    with pytest.raises(ConfigError, match="--nproc"):
        check(_convert_args(direction="hf-to-megatron", hf_checkpoint=hf, save=tmp_path / "o", nproc=0))
    with pytest.raises(ConfigError, match="--hf-checkpoint"):
        check(_convert_args(direction="hf-to-megatron", hf_checkpoint=tmp_path, save=tmp_path / "o"))
    check(_convert_args(direction="hf-to-megatron", hf_checkpoint=hf, save=tmp_path / "new"))
    with pytest.raises(ConfigError, match="--load"):
        check(
            _convert_args(
                direction="megatron-to-hf", hf_checkpoint=hf, load=tmp_path / "none", output=tmp_path / "x"
            )
        )


def test_start_attempts_let_the_trainer_say_whether_a_resume_finds_something(tmp_path: Path) -> None:
    """The head may not see the ranks' file system: a resume is tried first, --ref-load after."""
    kinds = lambda attempts: [(a.kind, a.path, a.flag, a.finetune) for a in attempts]  # noqa: E731
    assert kinds(start_attempts("/nfs/ckpt", "/nfs/ref")) == [
        (StartKind.RESUME, "/nfs/ckpt", "--load", False),
        (StartKind.REF_LOAD, "/nfs/ref", "--ref-load", True),
    ]
    assert kinds(start_attempts(None, "/r", auto_resume=True, save="/s")) == [
        (StartKind.RESUME, "/s", "--save", False),
        (StartKind.REF_LOAD, "/r", "--ref-load", True),
    ]
    assert kinds(start_attempts(None, None, auto_resume=False, save="/s")) == []
    # An HF --load is the start, whatever --ref-load says.
    assert kinds(start_attempts("/hf", "/r", load_is_hf=True)) == [(StartKind.HF_LOAD, "/hf", "--load", True)]
    assert kinds(start_attempts(str(hf_dir(tmp_path / "hf")), None)) == [
        (StartKind.HF_LOAD, str(tmp_path / "hf"), "--load", True)
    ]


def test_an_hf_ref_load_is_loaded_as_hf_weights(tmp_path: Path) -> None:
    hf = str(hf_dir(tmp_path / "hf"))
    (ref,) = start_attempts(None, hf)
    assert (ref.kind, ref.hf, ref.finetune) == (StartKind.REF_LOAD, True, True)
    (mg,) = start_attempts(None, str(tmp_path / "ckpt"))
    assert mg.hf is False
