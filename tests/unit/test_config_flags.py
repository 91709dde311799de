"""The configuration's flags: every slice has defaults and help, slime's flags parse unchanged and
round-trip, bad input names key and value (YAML files: test_config_yaml.py)."""

from __future__ import annotations

import msgspec
import pytest

from tether.config import SLICES, Config, flag_specs, help_text, resolve
from tether.runtime.errors import ConfigError

# Flags from a slime launch script (GRPO on a Qwen-style model), as users write them.
SLIME_SCRIPT = """
--actor-num-nodes 1 --actor-num-gpus-per-node 4 --rollout-num-gpus 4 --rollout-num-gpus-per-engine 2
--num-gpus-per-node 8 --hf-checkpoint /models/qwen --ref-load /ckpt/ref --load /ckpt/run --save /ckpt/run
--save-interval 20 --prompt-data /data/train.jsonl --input-key prompt --label-key label --apply-chat-template
--rollout-shuffle --rollout-seed 42 --num-rollout 3000 --rollout-batch-size 32 --n-samples-per-prompt 8
--rollout-max-response-len 8192 --rollout-temperature 0.8 --global-batch-size 256 --num-steps-per-rollout 1
--over-sampling-batch-size 64 --partial-rollout --rm-type math --reward-key acc --sglang-server-concurrency 512
--advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --kl-loss-type low_var_kl --entropy-coef 0.00
--eps-clip 0.2 --eps-clip-high 0.28 --use-tis --lr 1e-6 --micro-batch-size 1 --use-dynamic-batch-size
--max-tokens-per-gpu 9216 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 1
--context-parallel-size 1 --use-distributed-optimizer --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--num-layers 28 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 16 --swiglu
--update-weight-buffer-size 536870912 --use-fault-tolerance --rollout-health-check-interval 10
--sglang-mem-fraction-static 0.7 --sglang-enable-dp-attention --sglang-dp-size 2 --rollout-stop </s> <eos>
"""


def test_every_slice_has_defaults_and_help() -> None:
    for name, cls in SLICES.items():
        assert msgspec.convert({}, cls) == cls(), name
    specs = flag_specs()
    assert len(specs) > 120
    missing = [s.flag for s in specs if not s.help]
    assert not missing, f"flags without a one-line help text: {missing}"
    text = help_text()
    for flag in [
        "--rollout-batch-size",
        "--eps-clip-high",
        "--update-weight-delta-encoding",
        "--debug-train-only",
    ]:
        assert flag in text


def test_slime_script_parses_and_round_trips() -> None:
    cfg = resolve(SLIME_SCRIPT.split())
    assert cfg.cluster.actor_num_gpus_per_node == 4
    assert cfg.data.n_samples_per_prompt == 8 and cfg.data.global_batch_size == 256
    assert cfg.rollout.rollout_stop == ["</s>", "<eos>"]
    assert cfg.algorithm.eps_clip_high == pytest.approx(0.28) and cfg.algorithm.use_kl_loss
    assert cfg.megatron.tensor_model_parallel_size == 2 and cfg.megatron.sequence_parallel
    assert cfg.sglang_args == ["--mem-fraction-static", "0.7", "--enable-dp-attention", "--dp-size", "2"]
    assert Config.from_json(cfg.to_json()) == cfg


@pytest.mark.parametrize(
    ("argv", "key", "value"),
    [
        (["--n-samples-per-prompt", "0"], "--n-samples-per-prompt", "0"),
        (["--rollout-batch-size", "many"], "--rollout-batch-size", "many"),
        (["--no-such-flag", "1"], "--no-such-flag", None),
        (["--advantage-estimator", "ppo9"], "--advantage-estimator", "ppo9"),
        (
            ["--debug-rollout-only", "--debug-train-only", "--load-debug-rollout-data", "r{rollout_id}"],
            "--debug-rollout-only",
            True,
        ),
        (
            ["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--global-batch-size", "16"],
            "--global-batch-size",
            16,
        ),
        (
            ["--rollout-batch-size", "4", "--n-samples-per-prompt", "3", "--global-batch-size", "5"],
            "--global-batch-size",
            5,
        ),
        (
            [
                "--update-weight-mode",
                "delta",
                "--update-weight-transport",
                "disk",
                "--update-weight-disk-dir",
                "/w",
                "--update-weight-local-checkpoint-dir",
                "/l",
                "--colocate",
            ],
            "--update-weight-mode",
            "delta",
        ),
        (["--loop", "async", "--colocate"], "--loop", "async"),
    ],
)
def test_bad_input_names_key_and_value(argv: list[str], key: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        resolve(argv)
    assert info.value.key == key
    assert key in str(info.value)
    if value is not None:
        assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_colocate_refuses_an_update_interval_above_one_naming_both_flags() -> None:
    # Colocated engines are released every train step and only a sync resumes them.
    with pytest.raises(ConfigError) as info:
        resolve(["--colocate", "--update-weights-interval", "2"])
    assert info.value.key == "--update-weights-interval"
    assert info.value.value == 2
    assert "--colocate" in str(info.value) and "--update-weights-interval=2" in str(info.value)
    assert resolve(["--colocate", "--update-weights-interval", "1"]).cluster.colocate
    assert resolve(["--update-weights-interval", "2"]).weight_sync.update_weights_interval == 2


def test_the_trainer_layout_must_tile_the_trainer_ranks_at_plan_time() -> None:
    """TP x PP x CP and the experts' EP x ETP x PP must divide each trainer group's ranks (Megatron's
    initialize_model_parallel raises otherwise): refused when the flags are read, naming the flag."""
    one_node = ["--actor-num-nodes", "1", "--actor-num-gpus-per-node", "8"]
    with pytest.raises(ConfigError, match=r"TP x PP x CP = 16 must divide the 8 trainer ranks") as info:
        resolve([*one_node, "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "2"])
    assert info.value.key == "--tensor-model-parallel-size"
    experts = ["--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "8"]
    with pytest.raises(ConfigError, match=r"EP x ETP x PP = 16 must divide the 8 trainer ranks") as info:
        resolve([*one_node, *experts])
    assert info.value.key == "--expert-model-parallel-size"
    assert resolve(["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8", *experts])
    # A critic shares the layout on its own ranks (here 1 x 4 of the actor's 2 x 8).
    ppo = ["--advantage-estimator", "ppo", "--critic-num-nodes", "1", "--critic-num-gpus-per-node", "4"]
    with pytest.raises(ConfigError, match=r"TP x PP x CP = 8 must divide the 4 trainer ranks"):
        resolve(["--actor-num-nodes", "2", "--tensor-model-parallel-size", "8", *ppo])
    # Without a trainer (--debug-rollout-only) there is no layout to place.
    assert resolve([*one_node, "--tensor-model-parallel-size", "16", "--debug-rollout-only"])
