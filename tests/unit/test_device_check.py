"""bin/device-check's own checks, without a GPU and without downloading: the wheel folder against
the pins and the device's package list, the pytest report it reads, the report it writes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import ModuleType

import pytest
from support.device_wheels import ROOT, complete_folder, fake_wheel, load_device_check


@pytest.fixture(scope="module")
def dc() -> ModuleType:
    return load_device_check()


@pytest.fixture
def folder(dc: ModuleType, tmp_path: Path) -> Path:
    return complete_folder(dc.PINS, tmp_path / "wheels")


def problems_of(dc: ModuleType, folder: Path) -> list[str]:
    problems = dc.Problems()
    dc.check_wheels(folder, dc.device_packages(), problems)
    return problems.items


def test_a_complete_folder_passes(dc: ModuleType, folder: Path) -> None:
    assert problems_of(dc, folder) == []


def test_the_repositorys_device_list_names_what_tether_needs_beside_the_wheels(dc: ModuleType) -> None:
    packages = dc.device_packages()
    assert packages["torch"] and packages["transformers"]  # versions read on the machine
    assert not set(map(dc.canonical, dc.PINS)) & set(packages)  # the carried ones are not there


def test_a_missing_pin_is_named(dc: ModuleType, folder: Path) -> None:
    next(folder.glob("megatron_core-*.whl")).unlink()
    got = problems_of(dc, folder)
    assert any(p.startswith("megatron-core==0.16.1: missing") for p in got), got
    assert any("tether needs megatron-core" in p for p in got), got


def test_a_wrong_version_and_a_second_copy_are_named(dc: ModuleType, folder: Path) -> None:
    fake_wheel(folder, "msgspec", "0.18.0")
    got = problems_of(dc, folder)
    assert any("a second msgspec" in p for p in got), got


def test_a_wheel_for_another_python_or_platform_is_refused(dc: ModuleType, folder: Path) -> None:
    next(folder.glob("pyzmq-*.whl")).unlink()
    fake_wheel(folder, "pyzmq", dc.PINS["pyzmq"], "cp311-cp311-manylinux_2_28_x86_64")
    got = problems_of(dc, folder)
    assert any("pyzmq" in p and "no tag for CPython 3.12" in p for p in got), got
    next(folder.glob("pyzmq-*.whl")).unlink()
    fake_wheel(folder, "pyzmq", dc.PINS["pyzmq"], "cp312-cp312-macosx_11_0_arm64")
    assert any("no tag for CPython 3.12" in p for p in problems_of(dc, folder))


def test_a_requirement_neither_carried_nor_on_the_device_is_named(dc: ModuleType, folder: Path) -> None:
    next(folder.glob("mbridge-*.whl")).unlink()
    fake_wheel(folder, "mbridge", dc.PINS["mbridge"], requires=("not-on-the-device>=1", "torch>=99"))
    got = problems_of(dc, folder)
    assert any("needs not-on-the-device>=1: neither in" in p for p in got), got
    assert any("needs torch>=99: 2.11.0 is there" in p for p in got), got


def test_requirements_for_other_platforms_are_skipped(dc: ModuleType, folder: Path) -> None:
    next(folder.glob("mbridge-*.whl")).unlink()
    fake_wheel(folder, "mbridge", dc.PINS["mbridge"], requires=('cffi; implementation_name == "pypy"',))
    assert problems_of(dc, folder) == []


def test_the_size_limit(dc: ModuleType, folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    size = sum(p.stat().st_size for p in folder.glob("*.whl"))
    monkeypatch.setattr(dc, "LIMIT_BYTES", size - 1)
    assert any("over the" in p for p in problems_of(dc, folder))


def test_an_empty_folder_says_how_to_fill_it(dc: ModuleType, tmp_path: Path) -> None:
    got = problems_of(dc, tmp_path)
    assert "run bin/device-check --fetch" in got[0]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_cuda_paths" name="test_ipc" time="8.5"/>
<testcase classname="tests.gpu.test_offload" name="test_offload[bf16]" time="31.7">
  <failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.gpu.test_cuda_paths" name="test_two" time="0.0">
  <skipped type="pytest.skip" message="needs two CUDA devices">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_pytest_cases_go_into_the_report_one_check_each(dc: ModuleType, tmp_path: Path) -> None:
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    report = dc.Report(tmp_path / "report.json")
    dc.add_test_cases(report, dc.junit_cases(junit))
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["summary"] == {"passed": 1, "failed": 1, "skipped": 1}
    by_name = {c["name"]: c for c in data["checks"]}
    assert by_name["pytest test_offload::test_offload[bf16]"]["message"] == "assert 1 == 2"
    assert by_name["pytest test_cuda_paths::test_ipc"]["seconds"] == 8.5
    assert not (tmp_path / "report.tmp").exists()


def test_a_failing_step_is_reported_not_raised(dc: ModuleType, tmp_path: Path) -> None:
    checker = dc.Checker(tmp_path, budget_s=60, python="python3")

    def broken() -> tuple[bool, dict[str, object]]:
        raise RuntimeError("no GPU here")

    assert checker.step("broken", broken) is False
    checker.pack_logs()
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["checks"][0]["outcome"] == "failed"
    assert data["checks"][0]["message"] == "RuntimeError: no GPU here"
    assert (tmp_path / "logs.tar.gz").is_file()


def test_colocated_figures_come_from_the_runs_metrics(dc: ModuleType, tmp_path: Path) -> None:
    run = tmp_path / "test_colocate0" / "run"
    run.mkdir(parents=True)
    lines = [{"step": 0, "train/time_s": 1.5}, {"discarded": [3]}, {"step": 1, "train/time_s": 0.5}]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    (tmp_path / "test_colocatecurrent").symlink_to(tmp_path / "test_colocate0")
    got = dc.colocated_figures(tmp_path)
    assert got == {"test_colocate0": {"steps": 2, "train/time_s": [1.5, 0.5]}}
    assert dc.colocated_figures(tmp_path / "nothing") is None


def test_the_docs_flag_table_is_the_scripts_flags(dc: ModuleType) -> None:
    text = (ROOT / "docs" / "gpu.md").read_text()
    documented = set(re.findall(r"^\| `(--[a-z-]+)", text, flags=re.M))
    options = {o for a in dc.build_parser()._actions for o in a.option_strings if o.startswith("--")}
    assert documented == options - {"--help"}
