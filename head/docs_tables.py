"""The tables of docs/ that are generated from the code, so they cannot drift from it.

Each table sits in a page between `<!-- generated: NAME -->` and `<!-- end generated -->`;
bin/gen-docs rewrites those blocks and tests/unit/test_docs.py checks that the committed pages equal
what `render` makes of them. Only bin/gen-docs and the tests import this module.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

SLIME_COMMIT = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
"""The THUDM/slime commit whose parser `SLIME_FLAGS` lists (2026-08-21)."""

SLIME_FLAGS: frozenset[str] = frozenset(
    """
--actor-num-gpus-per-node --actor-num-nodes --advantage-estimator --allgather-cp
--apply-chat-template --apply-chat-template-kwargs --async-save --balance-by-flops --balance-data
--buffer-filter-path --calculate-per-token-loss --check-weight-update-equal --ci-disable-kl-checker
--ci-load-grad-norm --ci-save-grad-norm --ci-test --ci-train-rollout-logprob-abs-diff-threshold
--clip-grad --colocate --custom-advantage-function-path --custom-config-path
--custom-convert-samples-to-train-data-path --custom-eval-rollout-log-function-path
--custom-generate-function-path --custom-loss-function-path
--custom-megatron-before-log-prob-hook-path --custom-megatron-before-train-step-hook-path
--custom-megatron-init-path --custom-model-provider-path --custom-pg-loss-reducer-function-path
--custom-reward-post-process-path --custom-rm-path --custom-rollout-log-function-path
--custom-tis-function-path --custom-update-weight-post-write-path --data-pad-size-multiplier
--data-source-path --debug-rollout-only --debug-train-only --disable-compute-advantages-and-returns
--disable-grpo-std-normalization --disable-rewards-normalization --disable-rollout-global-dataset
--disable-wandb-random-suffix --distributed-backend --distributed-timeout-minutes --dump-details
--dynamic-sampling-filter-path --enable-mtp-training --entropy-coef --eps-clip --eps-clip-c
--eps-clip-high --eval-config --eval-function-path --eval-input-key --eval-interval --eval-label-key
--eval-max-context-len --eval-max-prompt-len --eval-max-response-len --eval-min-new-tokens
--eval-prompt-data --eval-reward-key --eval-temperature --eval-tool-key --eval-top-k --eval-top-p
--fetch-trajectory-retry-times --freeze-indexer --freeze-params-name-list --gamma
--get-mismatch-metrics --global-batch-size --group-rm --hf-checkpoint --http-proxy --input-key
--keep-old-actor --kl-coef --kl-loss-coef --kl-loss-type --label-key --lambd --load
--load-debug-rollout-data --load-debug-rollout-data-subsample --load-forge-rollout-data
--log-correct-samples --log-multi-turn --log-passrate --log-probs-chunk-size
--log-probs-max-tokens-per-gpu --log-reward-category --loss-mask-type --loss-type --lr
--mask-offpolicy-in-partial-rollout --max-tokens-per-gpu --megatron-config-path
--megatron-deepgemm-forward-layers --megatron-deepgemm-forward-modules
--megatron-deepgemm-moe-forward-layers --megatron-deepgemm-moe-forward-modules --memory-recorder
--memory-snapshot-dir --memory-snapshot-num-steps --metadata-key --micro-batch-size
--min-batch-collection-ratio --model-name --mtp-loss-scaling-factor --mtp-num-layers
--multimodal-keys --n-samples-per-eval-prompt --n-samples-per-prompt --no-save-optim
--normalize-advantages --num-critic-only-steps --num-epoch --num-gpus-per-node --num-rollout
--num-steps-per-rollout --offload --offload-rollout --offload-train --only-train-params-name-list
--opd-kl-coef --opd-teacher-ckpt-step --opd-teacher-load --opd-type --opsm-delta
--over-sampling-batch-size --padded-vocab-size --partial-rollout --prefill-num-servers --profile-target --prompt-data
--qwen-gdn-backend --recompute-loss-function --record-memory-history --ref-ckpt-step --ref-load
--ref-update-interval --release-train --reset-optimizer-states --reward-key --rm-type --rm-url
--rollout-all-samples-process-path --rollout-batch-size --rollout-buffer-url
--rollout-data-postprocess-path --rollout-data-transport --rollout-external-engine-addrs
--rollout-function-path --rollout-health-check-first-wait --rollout-health-check-interval
--rollout-health-check-timeout --rollout-max-context-len --rollout-max-prompt-len
--rollout-max-response-len --rollout-num-gpus --rollout-num-gpus-per-engine
--rollout-sample-filter-path --rollout-sample-hook-path --rollout-seed --rollout-shuffle
--rollout-skip-special-tokens --rollout-stop --rollout-stop-token-ids --rollout-task-type
--rollout-temperature --rollout-top-k --rollout-top-p --save --save-debug-rollout-data
--save-debug-train-data --save-hf --save-interval --seed --skip-eval-before-train --start-rollout-id
--tb-experiment-name --tb-project-name --tis-clip --tis-clip-low --tool-key --train-backend
--train-env-vars --update-weight-buffer-size --update-weight-delta-checksum
--update-weight-delta-encoding --update-weight-disk-dir --update-weight-disk-keep-files
--update-weight-local-checkpoint-dir --update-weight-mode --update-weight-transport
--update-weights-interval --use-distributed-post --use-dynamic-batch-size --use-fault-tolerance
--use-kl-loss --use-opd --use-opsm --use-rollout-entropy --use-rollout-logprobs
--use-rollout-routing-replay --use-routing-replay --use-stateless-adam --use-tensorboard --use-tis
--use-unbiased-kl --use-wandb --value-clip --wandb-always-use-train-step --wandb-dir --wandb-group
--wandb-host --wandb-key --wandb-mode --wandb-project --wandb-run-id --wandb-team
""".split()
)
"""Every flag slime's own parser declares (slime/utils/arguments.py at SLIME_COMMIT, including
the Megatron flags it redefines), names only: each must be a tether flag or refused with a reason."""

HOOK_NOTES: dict[str, str] = {
    "--rollout-function-path": "produces each rollout (tether's default rollout when unset); slime's "
    "`slime.rollout.fully_async_rollout.generate_rollout_fully_async` selects `--loop fully-async`",
    "--custom-generate-function-path": "generates one sample, in place of the default generate",
    "--custom-rm-path": "scores one sample; with `--group-rm`, a whole group",
    "--dynamic-sampling-filter-path": "keeps or drops each finished group",
    "--buffer-filter-path": "picks the samples a rollout takes from the buffer",
    "--rollout-sample-hook-path": "given once per hook: each generated sample passes through them in "
    "order before its reward, with `rollout_id`/`evaluation` as their signatures take",
    "--rollout-sample-filter-path": "at the end of the default rollout: a sample it marks "
    "`remove_sample` stays in the batch and its group's normalisation with an all-zero loss mask",
    "--rollout-all-samples-process-path": "after the sample filter: every finished group, the "
    "dynamically filtered ones too",
    "--custom-rollout-log-function-path": "after each rollout; a True return drops tether's own "
    "rollout/perf figures of that step",
    "--custom-eval-rollout-log-function-path": "after each evaluation; a True return drops tether's "
    "own eval figures of that step",
    "--eval-function-path": "produces each evaluation",
    "--data-source-path": "a class serving the prompts: `load(start_rollout_id - 1)` before the first "
    "rollout, `save(rollout_id)` at each checkpoint",
    "--custom-reward-post-process-path": "on the head, returns `(raw_rewards, rewards)`, replacing the "
    "group normalisation",
    "--custom-advantage-function-path": "on the head, sets `advantages` and `returns` per sample",
    "--custom-convert-samples-to-train-data-path": "on the head: slime's train-data dict becomes the "
    "training batch",
    "--rollout-data-postprocess-path": "per data-parallel shard, after the log-prob passes and advantages",
    "--custom-tis-function-path": "on the trainer ranks, in place of the built-in TIS",
    "--custom-pg-loss-reducer-function-path": "on the trainer ranks: reduces the pg term",
    "--custom-model-provider-path": "on the trainer ranks, builds each model chunk (actor, critic, reference, "
    "teacher) in place of tether's GPTModel; the HF weights still load through the bridge by Megatron "
    "parameter name, so it must name and shape parameters as GPTModel does; a function naming `config` "
    "also gets tether's TransformerConfig (there is no Megatron-LM `get_args()`)",
    "--custom-megatron-init-path": "on every trainer rank once its process groups are up, before any model "
    "is built",
    "--custom-megatron-before-log-prob-hook-path": "before every log-prob pass, the chunks in eval mode; "
    "`store_prefix` `''` (actor, critic values), `'ref_'`, `'teacher_'`",
    "--custom-megatron-before-train-step-hook-path": "after the gradients are zeroed, before each train "
    "step's forward; `step_id` counts from 0 within the rollout",
}
"""When tether calls each hook; the calls themselves come from the hook checks."""

DATA_SOURCE_CALL = "cls(args), with get_samples, add_samples, save, load, __len__"
"""`--data-source-path` names a class, checked by its methods rather than one call."""


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell: no pipe, no HTML tag, no emphasis marker."""
    text = " ".join(text.split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace("*", "\\*")


def _table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def hook_calls() -> list[tuple[str, str]]:
    """(flag, call) of every hook whose call `tether plan` checks, in the checks' order."""
    from tether.checks import loss_hooks, megatron_hooks
    from tether.rollout.hooks import checks
    from tether.run import train_data_hooks

    found = [
        (v.flag, v.call)
        for module in (checks, train_data_hooks)
        for v in vars(module).values()
        if isinstance(v, checks.HookCall)
    ]
    found += [(c.flag, c.call) for c in loss_hooks.hook_calls()]
    found += [(v.flag, v.call) for v in vars(megatron_hooks).values() if isinstance(v, checks.HookCall)]
    found.append(("--data-source-path", DATA_SOURCE_CALL))
    return found


def slime_hooks() -> str:
    calls: dict[str, list[str]] = {}
    for flag, call in hook_calls():
        calls.setdefault(flag, []).append(call)
    if set(calls) != set(HOOK_NOTES):
        raise ValueError(
            f"HOOK_NOTES and the hook checks disagree: no note for {sorted(set(calls) - set(HOOK_NOTES))}, "
            f"no hook for {sorted(set(HOOK_NOTES) - set(calls))}"
        )
    rows = [
        (f"`{flag}`", "; ".join(f"`{c}`" for c in calls[flag]), _cell(HOOK_NOTES[flag])) for flag in calls
    ]
    return _table(("flag", "call", "when"), rows)


def refused() -> dict[str, tuple[str, str]]:
    """Every refused flag (or `--spec` value): whose it is and why tether refuses it."""
    from tether.checks.slime_flags import MEGATRON_NOT_IMPLEMENTED, NOT_IMPLEMENTED
    from tether.train.config import UNBUILT_LAYER_SPECS

    rows = {flag: ("slime", why) for flag, why in NOT_IMPLEMENTED.items()}
    rows |= {flag: ("Megatron-LM", why) for flag, why in MEGATRON_NOT_IMPLEMENTED.items()}
    rows |= {f"--spec {module}": ("slime's plugin", why) for module, why in UNBUILT_LAYER_SPECS.items()}
    return rows


def slime_refused() -> str:
    rows = [(f"`{flag}`", whose, _cell(why)) for flag, (whose, why) in refused().items()]
    return _table(("flag", "whose", "why tether refuses it"), rows)


def slime_flags() -> str:
    """Every flag: tether's parser's (accepted), the refused ones, and slime's, each on one row."""
    from tether.config import flag_specs

    accepted = {s.flag: s for s in flag_specs()}
    refusals = {flag: why for flag, (_whose, why) in refused().items() if " " not in flag}
    unknown = sorted(SLIME_FLAGS - set(accepted) - set(refusals))
    if unknown:
        raise ValueError(f"slime's flags neither accepted nor refused by tether: {unknown}")
    rows = []
    for flag in sorted(set(accepted) | set(refusals), key=lambda f: f.lstrip("-")):
        slime = "✓" if flag in SLIME_FLAGS else ""
        if flag in accepted:
            spec = accepted[flag]
            # A flag slime's hooks read through `args` but whose every value tether refuses says so first.
            status = "refused" if spec.help.startswith("Refused") else "✓"
            rows.append((f"`{flag}`", slime, status, f"`{spec.slice}`", _cell(spec.help)))
        else:
            rows.append((f"`{flag}`", slime, "refused", "", _cell(refusals[flag])))
    return _table(("flag", "slime's", "tether", "YAML section", "meaning, or why refused"), rows)


def yaml_sections() -> str:
    from tether.config import SLICES, flag_specs

    counts: dict[str, int] = {}
    for spec in flag_specs():
        counts[spec.slice] = counts.get(spec.slice, 0) + 1
    rows = [
        (f"`{name}`", _cell((cls.__doc__ or "").strip().splitlines()[0]), str(counts.get(name, 0)))
        for name, cls in SLICES.items()
    ]
    return _table(("section", "holds", "keys"), rows)


def status_columns() -> str:
    """The columns `tether status` prints, table by table (tether.records.run_status.COLUMNS)."""
    from tether.records.run_status import COLUMNS

    rows = [
        (f"{table}", f"`{column}`", _cell(meaning))
        for table, columns in COLUMNS.items()
        for column, meaning in columns.items()
    ]
    return _table(("table", "column", "meaning"), rows)


TABLES: dict[str, Callable[[], str]] = {
    "status-columns": status_columns,
    "slime-hooks": slime_hooks,
    "slime-refused": slime_refused,
    "slime-flags": slime_flags,
    "yaml-sections": yaml_sections,
}

_BLOCK = re.compile(r"(<!-- generated: ([\w-]+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def render(text: str) -> str:
    """`text` with every generated block holding its table now; an unknown name is a ValueError."""

    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in TABLES:
            raise ValueError(f"<!-- generated: {name} --> names no table; known: {sorted(TABLES)}")
        return match.group(1) + TABLES[name]() + match.group(4)

    return _BLOCK.sub(fill, text)
