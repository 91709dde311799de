"""On-policy distillation end to end (`tether run --use-opd --opd-type sglang`), as a slime user runs
it: a separate teacher server (here a CPU engine serving another tiny model, started by the test on
loopback with --no-api-key, as an SGLang teacher is usually served without a key) at --rm-url; slime's rollout hooks
(slime.rollout.on_policy_distillation, by slime's module paths) ask it to score every sample's
tokens during the rollout (`/generate` with `logprob_start_len` 0 and `max_new_tokens` 0), the
Samples carry the teacher's log-probs to the trainer, and each step trains on
A = 0 - (student - teacher) (zero task reward, as slime's hooks return) with the trainer's own
log-probs as the student; opd_reverse_kl is what the shards carried."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from support.e2e import Workspace, check_run, tether
from support.engines import cpu_engine, hf_logprobs

from tether.rollout.cpu_engine.modeling.tiny_model import TinyModelSpec, write_tiny_model
from tether.run.train_dump import load_train_data

STEPS = 2
SAMPLES = 16  # --rollout-batch-size 4 x --n-samples-per-prompt 4


def test_sglang_teacher_log_probs_reach_the_trainer(ws: Workspace, tmp_path: Path, run_dir: Path) -> None:
    dump = tmp_path / "train_{rollout_id}.msgpack"
    # The student's shape and tokenizer (ws.model's spec), other weights: a teacher that disagrees.
    teacher_dir = str(
        write_tiny_model(
            tmp_path / "teacher",
            TinyModelSpec(hidden=64, layers=2, heads=4, kv_heads=2, bpe_merges=0, seed=7),
        )
    )
    # No key, as an SGLang teacher is served (slime's reward_func sends none): --no-api-key, loopback.
    with cpu_engine(teacher_dir, tmp_path, "--no-api-key", api_key=None) as teacher:
        flags = ws.flags(
            run_dir,
            "--num-rollout",
            str(STEPS),
            "--use-opd",
            "--opd-type",
            "sglang",
            "--opd-kl-coef",
            "1.0",
            "--custom-reward-post-process-path",
            "slime.rollout.on_policy_distillation.post_process_rewards",
            "--rm-url",
            f"{teacher.url}/generate",
            "--save-debug-train-data",
            str(dump),
        )
        at = flags.index("--custom-rm-path")
        flags[at + 1] = "slime.rollout.on_policy_distillation.reward_func"
        tether("run", *flags)
    metrics = check_run(run_dir, transport="distributed", steps=STEPS)
    for rollout_id, m in enumerate(metrics):
        (step,) = load_train_data(str(dump).format(rollout_id=rollout_id)).steps
        total, count, samples = 0.0, 0.0, 0
        for shard in step:
            tokens, offsets, lengths = shard["tokens"], shard["offsets"], shard["response_lengths"]
            teacher_lps = []
            for i, n in enumerate(lengths):
                ids = [int(t) for t in tokens[offsets[i] : offsets[i + 1]]]
                full = hf_logprobs(teacher_dir, ids)  # row p predicts token p + 1
                teacher_lps += [float(full[p - 1, ids[p]]) for p in range(len(ids) - n, len(ids))]
            samples += len(lengths)
            # the teacher model's log-probs of exactly the response tokens reached the trainer's shard
            np.testing.assert_allclose(shard["teacher_log_probs"], teacher_lps, rtol=0, atol=1e-5)
            rkl = shard["old_log_probs"] - shard["teacher_log_probs"]
            # zero task reward: the advantage is the distillation penalty alone
            np.testing.assert_allclose(shard["advantages"], -rkl, atol=1e-6)
            total += float((rkl * shard["loss_masks"]).sum())
            count += float(shard["loss_masks"].sum())
        assert samples == SAMPLES  # every sample was scored by the teacher and trained on
        assert m["train/opd_reverse_kl"] == pytest.approx(total / count, rel=1e-5, abs=1e-7)
        assert math.isfinite(m["train/opd_reverse_kl"]) and m["train/opd_reverse_kl"] != 0
