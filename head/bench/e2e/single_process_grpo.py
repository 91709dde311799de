"""The same-run baseline of `tether bench e2e`: the demo's GRPO step in one process, plain torch.

What a user would write without a framework: one Python process holding the Hugging Face model,
sampling each group's answers with a KV cache, scoring them with the demo's verifier, and taking
one policy-gradient step on them: GRPO advantages (group mean and std), PPO's clipped ratio against
the sampling log-probs, AdamW (Megatron's defaults: weight decay 0.01, betas 0.9/0.999, eps 1e-8),
gradient clip. The demo's model, prompts, seed and recipe (lr, temperature, 8 new tokens); no
engine, no trainer ranks, no weight sync, no records. Its torch threads come from OMP_NUM_THREADS
(`tether bench e2e --baseline-threads`).

    python -m tether.bench.e2e.single_process_grpo --model DIR --prompts FILE --steps N --json

prints one JSON object: per-step seconds (rollout, train, step), `first_step_s`, seconds from
this module's start to the first step's start (imports and model load included), and
`first_step_at`, that start as wall-clock time: `tether bench e2e` measures it from the moment it
launched the process, as it measures a `tether run`'s.
"""

from __future__ import annotations

import time

STARTED = time.time()  # before the heavy imports: they count towards the time to the first step

import argparse  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from tether.commands import demo_task  # noqa: E402


@dataclass(frozen=True)
class Recipe:
    """The demo's GRPO step as `tether bench e2e` runs it (constant lr, no KL, no entropy bonus)."""

    prompts: int = 16
    samples: int = 8
    lr: float = 5e-4
    temperature: float = 0.5
    max_new_tokens: int = 8
    clip_grad: float = 1.0
    eps_clip: float = 0.2
    std_eps: float = 1e-6


@dataclass(frozen=True)
class StepTimes:
    rollout_s: float
    train_s: float
    reward_mean: float

    @property
    def step_s(self) -> float:
        return self.rollout_s + self.train_s


def group_advantages(rewards: torch.Tensor, group: int, eps: float) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, over the group's sample std (n - 1) + eps."""
    grouped = rewards.view(-1, group)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    std = grouped.std(dim=1, keepdim=True) if group > 1 else torch.zeros_like(centred)
    return (centred / (std + eps)).view(-1)


def clipped_pg_loss(
    log_probs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, eps_clip: float
) -> torch.Tensor:
    """PPO's clipped policy loss per token, averaged per sample over its response, then over samples."""
    ratio = torch.exp(log_probs - old)
    per_token = torch.maximum(-adv[:, None] * ratio, -adv[:, None] * ratio.clamp(1 - eps_clip, 1 + eps_clip))
    per_sample = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return per_sample.mean()


class SingleProcessGRPO:
    """The model, its tokenizer and optimizer; `step` runs one GRPO step on a batch of prompts."""

    def __init__(self, model_dir: Path, recipe: Recipe, seed: int) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(seed)
        self.recipe = recipe
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.eos = self.tok.eos_token_id
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=recipe.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01
        )

    def _left_padded(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = [self.tok.encode(t, add_special_tokens=False) for t in texts]
        width = max(len(i) for i in ids)
        tokens = torch.full((len(ids), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for row, seq in enumerate(ids):
            tokens[row, width - len(seq) :] = torch.tensor(seq)
            mask[row, width - len(seq) :] = 1
        return tokens, mask

    @torch.no_grad()
    def generate(
        self, tokens: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Sample `max_new_tokens` per row at the recipe's temperature with a KV cache; returns the
        new tokens, their log-probs and the response mask (tokens up to and with the first EOS)."""
        temperature = self.recipe.temperature
        self.model.eval()
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(input_ids=tokens, attention_mask=mask, position_ids=positions, use_cache=True)
        new, old, live = [], [], []
        alive = torch.ones(tokens.shape[0], dtype=torch.bool)
        for _ in range(self.recipe.max_new_tokens):
            logp = torch.log_softmax(out.logits[:, -1, :].float() / temperature, dim=-1)
            nxt = torch.multinomial(logp.exp(), 1).squeeze(1)
            new.append(nxt)
            old.append(logp.gather(1, nxt[:, None]).squeeze(1))
            live.append(alive.clone())
            alive &= nxt != self.eos
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            positions = positions[:, -1:] + 1
            out = self.model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=positions,
                cache=out.cache,
                use_cache=True,
            )
        return torch.stack(new, 1), torch.stack(old, 1), torch.stack(live, 1).float()

    def step(self, digits: list[str]) -> StepTimes:
        r = self.recipe
        started = time.perf_counter()
        group = [d for d in digits for _ in range(r.samples)]
        tokens, mask = self._left_padded([demo_task.PROMPT_TEMPLATE.format(digits=d) for d in group])
        new, old, response_mask = self.generate(tokens, mask)
        responses = [
            str(self.tok.decode(row[: int(m.sum())].tolist(), skip_special_tokens=True))
            for row, m in zip(new, response_mask, strict=True)
        ]
        rewards = torch.tensor([demo_task.score(d, text) for d, text in zip(group, responses, strict=True)])
        adv = group_advantages(rewards, r.samples, r.std_eps)
        rolled = time.perf_counter()

        self.model.train()
        full = torch.cat([tokens, new], dim=1)
        full_mask = torch.cat([mask, torch.ones_like(new)], dim=1)
        positions = (full_mask.cumsum(dim=1) - 1).clamp(min=0)
        logits = self.model(input_ids=full, attention_mask=full_mask, position_ids=positions).logits
        prompt_len = tokens.shape[1]
        # The logits at position t predict token t + 1: the response tokens' come from t - 1.
        response_logits = logits[:, prompt_len - 1 : -1, :].float() / r.temperature
        log_probs = torch.log_softmax(response_logits, dim=-1).gather(2, new[:, :, None]).squeeze(2)
        loss = clipped_pg_loss(log_probs, old, adv, response_mask, r.eps_clip)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), r.clip_grad)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        done = time.perf_counter()
        return StepTimes(rollout_s=rolled - started, train_s=done - rolled, reward_mean=float(rewards.mean()))


def read_digits(prompts: Path) -> list[str]:
    """The training inputs of a prompts file written by `demo_task.write_jsonl`."""
    return [json.loads(line)["label"] for line in prompts.read_text().splitlines() if line.strip()]


def run(model_dir: Path, prompts: Path, steps: int, seed: int, recipe: Recipe) -> dict[str, Any]:
    digits = read_digits(prompts)
    random.Random(seed).shuffle(digits)  # the data order: shuffled by the seed, as --rollout-shuffle
    trainer = SingleProcessGRPO(model_dir, recipe, seed)
    first_step = time.time()
    times = []
    for i in range(steps):
        start = (i * recipe.prompts) % max(1, len(digits) - recipe.prompts)
        times.append(trainer.step(digits[start : start + recipe.prompts]))
    return {**summary(times, first_step_s=first_step - STARTED), "first_step_at": first_step}


def summary(times: list[StepTimes], *, first_step_s: float) -> dict[str, Any]:
    if not times:
        raise ValueError("no steps: --steps must be at least 1")
    steps = [t.step_s for t in times]
    return {
        "steps": len(times),
        "threads": torch.get_num_threads(),
        "first_step_s": round(first_step_s, 3),
        "first_step_done_s": round(first_step_s + times[0].step_s, 3),
        "step_time_median_s": round(statistics.median(steps), 4),
        "step_time_mean_s": round(statistics.fmean(steps), 4),
        "rollout_time_mean_s": round(statistics.fmean(t.rollout_s for t in times), 4),
        "train_time_mean_s": round(statistics.fmean(t.train_s for t in times), 4),
        "reward_mean_last": round(times[-1].reward_mean, 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tether.bench.e2e.single_process_grpo", description=__doc__
    )
    parser.add_argument("--model", type=Path, required=True, help="The demo's HF model directory.")
    parser.add_argument("--prompts", type=Path, required=True, help="The training prompts (JSONL).")
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps.")
    parser.add_argument("--seed", type=int, default=1, help="Seed for the data order and sampling.")
    parser.add_argument("--prompts-per-step", type=int, default=Recipe.prompts, help="Prompts per step.")
    parser.add_argument("--samples", type=int, default=Recipe.samples, help="Samples per prompt.")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.prompts_per_step < 1 or args.samples < 1:
        parser.error("--steps, --prompts-per-step and --samples must be at least 1")
    recipe = Recipe(prompts=args.prompts_per_step, samples=args.samples)
    print(json.dumps(run(args.model, args.prompts, args.steps, args.seed, recipe)), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
