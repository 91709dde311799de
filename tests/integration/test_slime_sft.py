"""slime's SFT recipe (scripts/run-qwen3-4B-base-sft.sh) as a `tether run`: messages records, its
rollout function `slime.rollout.sft_rollout.generate_rollout`, `--loss-type sft_loss
--calculate-per-token-loss --disable-compute-advantages-and-returns --debug-train-only`, run for
`--num-epoch` passes with its cosine schedule (`--lr-decay-style cosine --min-lr --lr-warmup-fraction`)
and no --num-rollout: the run counts the steps from the prompts before the trainer starts. No engine
starts; each step trains on whole conversations with the loss on the assistant's tokens only, and the
loss falls as the same conversations come round again."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from support.e2e import check_clean_exit, jsonl, tether
from transformers import AutoTokenizer

from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.run.train_dump import load_train_data

CONVERSATIONS = [
    [{"role": "user", "content": f"{a}+{b}"}, {"role": "assistant", "content": str(a + b)}]
    for a, b in [(1, 2), (3, 4), (2, 5), (6, 1)]
]
EPOCHS = 2
BATCH = 1  # --rollout-batch-size (= --global-batch-size): one conversation a step
STEPS = EPOCHS * (len(CONVERSATIONS) // BATCH)
LR, MIN_LR, WARMUP_FRACTION = 1e-2, 1e-3, 0.1


def megatron_cosine(step: int, horizon: int) -> float:
    """The LR Megatron's OptimizerParamScheduler gives at `step` (warm-up from 0 over
    WARMUP_FRACTION x horizon, then cosine decay to MIN_LR at `horizon`)."""
    warmup = WARMUP_FRACTION * horizon
    if step <= warmup:
        return LR * step / warmup
    ratio = (step - warmup) / (horizon - warmup)
    return MIN_LR + (LR - MIN_LR) * 0.5 * (math.cos(math.pi * ratio) + 1.0)


def test_slimes_sft_script_trains_on_the_assistants_tokens_without_engines(tmp_path: Path) -> None:
    model = write_tiny_model(tmp_path / "model", TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2))
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS))
    run, dumps = tmp_path / "run", tmp_path / "train_data"
    # slime's SFT_ARGS (the script's order), then the tiny run's sizes.
    tether(
        "run",
        "--rollout-function-path", "slime.rollout.sft_rollout.generate_rollout",
        "--prompt-data", str(data),
        "--input-key", "messages",
        "--num-epoch", str(EPOCHS),
        "--rollout-batch-size", str(BATCH),
        "--global-batch-size", str(BATCH),
        "--loss-type", "sft_loss",
        "--calculate-per-token-loss",
        "--disable-compute-advantages-and-returns",
        "--debug-train-only",
        "--hf-checkpoint", str(model),
        "--n-samples-per-prompt", "1",
        "--cpu-devices", "1",
        "--actor-num-gpus-per-node", "1",
        "--lr", str(LR),
        "--lr-decay-style", "cosine",
        "--min-lr", str(MIN_LR),
        "--lr-warmup-fraction", str(WARMUP_FRACTION),
        "--save-debug-train-data", f"{dumps}/{{rollout_id}}.msgpack",
        "--run-dir", str(run),
        "--progress", "plain",
    )  # fmt: skip
    check_clean_exit(run)
    assert not (run / "logs" / "engine0.log").exists()  # no engine was started
    metrics = [m for m in jsonl(run / "metrics.jsonl") if m["step"] >= 0]
    loss = [m["train/loss"] for m in metrics]
    assert len(loss) == STEPS and loss[-1] < 0.7 * loss[0], loss
    # The horizon was counted before the trainer started: epochs x whole batches of the prompts.
    receipt = json.loads((run / "receipt.json").read_text())["config"]
    assert (receipt["data"]["num_rollout"], receipt["megatron"]["train_iters"]) == (STEPS, STEPS)
    counted = [e for e in jsonl(run / "events.jsonl") if e["event"] == "epochs_counted"]
    assert [(e["prompts"], e["num_rollout"], e["train_iters"]) for e in counted] == [
        (len(CONVERSATIONS), STEPS, STEPS)
    ]
    # Each step's LR is Megatron's cosine schedule over that horizon: 0 at the first step (warm-up
    # from --lr-warmup-init 0), the peak right after, then down towards --min-lr, which the schedule
    # reaches at the horizon (the step after the last).
    lrs = [m["train/lr"] for m in metrics]
    assert lrs == pytest.approx([megatron_cosine(k, STEPS) for k in range(STEPS)], rel=1e-6), lrs
    assert lrs[0] == 0.0 and lrs[1:] == sorted(lrs[1:], reverse=True) and lrs[-1] > MIN_LR
    assert megatron_cosine(STEPS, STEPS) == pytest.approx(MIN_LR)
    tokenizer = AutoTokenizer.from_pretrained(model)
    trained = []
    for rollout_id in range(len(CONVERSATIONS) // BATCH):  # the first epoch: every conversation once
        shard = load_train_data(dumps / f"{rollout_id}.msgpack").steps[0][0]
        offsets, lengths, masks = shard["offsets"], shard["response_lengths"], shard["loss_masks"]
        starts = np.concatenate([[0], np.cumsum(lengths)])
        for i in range(len(lengths)):
            conversation = shard["tokens"][offsets[i] : offsets[i + 1]]
            response = conversation[len(conversation) - lengths[i] :]
            mask = masks[starts[i] : starts[i + 1]]
            trained.append(tokenizer.decode([int(t) for t, m in zip(response, mask, strict=True) if m]))
    answers = sorted(m[1]["content"] for m in CONVERSATIONS)
    # The loss mask covers the assistant's answer (and its end-of-turn), nothing of the prompt.
    assert sorted(t.strip().split(tokenizer.eos_token or "\n")[0].strip() for t in trained) == answers, (
        trained
    )
