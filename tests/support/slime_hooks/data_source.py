"""A data source class in slime's API (--data-source-path): built as `cls(args)`, it reads
`args.prompt_data` itself and hands out groups of slime Samples with the prompt text only (no
tokens: the consumer tokenizes, as slime's generate does). Its position (the offset into the
prompts) is saved by `save(rollout_id)` under `args.save` and read back by `load(rollout_id)` from
`args.load`, as slime's own data source does. Calls are logged to $TETHER_TEST_HOOK_LOG.
"""

import json
import os

from slime.rollout.data_source import DataSource
from slime.utils.types import Sample


def _log(event, **fields):
    with open(os.environ["TETHER_TEST_HOOK_LOG"], "a") as fh:
        fh.write(json.dumps({"event": event, **fields}) + "\n")


def _state_path(root, rollout_id):
    return os.path.join(root, "rollout", f"prompt_source_{rollout_id}.json")


class PromptSource(DataSource):
    def __init__(self, args):
        self.args = args
        with open(args.prompt_data) as fh:
            self.records = [json.loads(line) for line in fh if line.strip()]
        self.offset = 0
        self.buffer = []
        _log("source_init", prompts=len(self.records))

    def get_samples(self, num_samples):
        groups = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        while len(groups) < num_samples:
            record = self.records[self.offset % len(self.records)]
            group = [
                Sample(prompt=record[self.args.input_key], label=record.get(self.args.label_key))
                for _ in range(self.args.n_samples_per_prompt)
            ]
            groups.append(group)
            self.offset += 1
        _log("source_get", n=num_samples, offset=self.offset)
        return groups

    def add_samples(self, samples):
        self.buffer.extend(samples)

    def save(self, rollout_id):
        path = _state_path(self.args.save, rollout_id)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump({"offset": self.offset}, fh)
        _log("source_save", rollout_id=rollout_id, offset=self.offset)

    def load(self, rollout_id=None):
        root = self.args.load
        path = None if root is None else _state_path(root, rollout_id)
        if path is not None and os.path.exists(path):
            with open(path) as fh:
                self.offset = json.load(fh)["offset"]
        _log("source_load", rollout_id=rollout_id, offset=self.offset)

    def __len__(self):
        return len(self.records)
