"""--eval-config: slime's evaluation datasets file, each dataset's settings resolved as slime does."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.rollout import make_config

from tether.rollout.data.eval_config import resolve_eval_datasets
from tether.runtime.errors import ConfigError

CONFIG = """
eval:
  defaults:
    temperature: 0.6
    max_response_len: 64
  datasets:
    - name: aime
      path: ${oc.env:EVAL_DIR}/aime.jsonl
      n_samples_per_eval_prompt: 4
      rm_type: math
      input_key: problem
    - name: gsm
      path: gsm.jsonl
      temperature: 0.0
      metadata_overrides: {source: gsm}
      stop: ["\\n\\n"]
"""


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "eval.yaml"
    path.write_text(text)
    return str(path)


def test_each_setting_resolves_dataset_then_defaults_then_flags(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EVAL_DIR", "/data")
    cfg = make_config(
        rollout={"rollout_top_p": 0.9, "rollout_temperature": 1.0, "reward_key": "score"},
        data={
            "eval_config": _write(tmp_path, CONFIG),
            "eval_top_k": 20,
            "eval_prompt_data": ["ignored", "x.jsonl"],  # slime: --eval-config wins
            "input_key": "question",
            "eval_min_new_tokens": 2,
        },
    )
    aime, gsm = resolve_eval_datasets(cfg.data, cfg.rollout)
    assert (aime.name, aime.path, gsm.path) == ("aime", "/data/aime.jsonl", "gsm.jsonl")  # interpolation
    assert (aime.n_samples_per_eval_prompt, gsm.n_samples_per_eval_prompt) == (4, 1)
    assert (aime.temperature, gsm.temperature) == (0.6, 0.0)  # defaults, then the dataset's own
    assert aime.top_p == gsm.top_p == 0.9 and aime.top_k == 20  # rollout's flag, eval flag
    assert aime.max_response_len == 64 and aime.min_new_tokens == 2
    assert (aime.input_key, gsm.input_key) == ("problem", "question")
    assert aime.reward_key == "score" and gsm.stop == ["\n\n"]
    assert aime.sample_metadata() == {"rm_type": "math"} and gsm.sample_metadata() == {"source": "gsm"}
    assert cfg.data.eval_datasets() == [("aime", "/data/aime.jsonl"), ("gsm", "gsm.jsonl")]


def test_eval_prompt_data_pairs_still_resolve() -> None:
    cfg = make_config(
        rollout={"rollout_max_response_len": 8},
        data={"eval_prompt_data": ["a", "a.jsonl"], "eval_temperature": 0.3, "n_samples_per_eval_prompt": 2},
    )
    (only,) = resolve_eval_datasets(cfg.data, cfg.rollout)
    assert (only.name, only.temperature, only.max_response_len, only.n_samples_per_eval_prompt) == (
        "a",
        0.3,
        8,
        2,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("eval:\n  datasets: []\n", "defines no datasets"),
        ("eval:\n  datasets:\n    - path: a.jsonl\n", "dataset #0 has no `name`"),
        ("eval:\n  datasets:\n    a: {}\n", "dataset 'a' has no `path`"),
        ("eval:\n  datasets:\n    a: {path: x, temprature: 1}\n", "dataset 'a': unknown key `temprature`"),
        (
            "eval:\n  defaults: {path: x}\n  datasets:\n    a: {path: x}\n",
            "eval.defaults: unknown key `path`",
        ),
        ("eval:\n  datasets:\n    a: {path: x, app_service: 'http://h'}\n", "`app_service` is not supported"),
        ("eval:\n  datasets:\n    - {name: a, path: x}\n    - {name: a, path: y}\n", "names repeat"),
        ("- 1\n- 2\n", "mapping at its root"),
        ("eval: {datasets: {a: {path: x, top_k: many}}}\n", "dataset 'a'"),
    ],
)
def test_bad_files_are_refused_at_parse_time(tmp_path: Path, text: str, message: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as err:
        cfg = make_config(data={"eval_config": path})
        resolve_eval_datasets(cfg.data, cfg.rollout)
    assert err.value.key == "--eval-config" and err.value.value == path


def test_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="is not a file"):
        make_config(data={"eval_config": str(tmp_path / "nope.yaml")})
