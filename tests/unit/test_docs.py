"""The docs say what the code does: generated tables equal the code's, every relative link and
anchor resolves, every `tether …` command shown parses with tether's own parsers, every flag a
table names exists, every error message quoted in troubleshooting.md is still in the code, and
every repository path or `tether.*` name mentioned exists."""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from tether import cli
from tether.config import flag_specs
from tether.docs_tables import refused, render

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PRODUCT = ("head", "rollout", "train", "sync", "runtime", "placement")

# Flags the docs name that belong to other programs, each with whose they are.
FOREIGN_FLAGS: dict[str, str] = {
    "--output": "sbatch (#SBATCH --output)",
    "--open-mode": "sbatch (--open-mode=append)",
    "--requeue": "sbatch (#SBATCH --requeue)",
    "--batch": "scancel",
    "--signal": "scancel, sbatch",
    "--api-key": "SGLang's server",
    "--admin-api-key": "SGLang's server",
    "--sglang": "bin/setup",
}

# README's first commands are CI's: they stay exactly these, first thing after the intro.
SETUP_COMMANDS = (
    "bin/setup && bin/tether demo             # the main job: a tiny model learns to sort digits with GRPO, on CPU",
    "bin/setup --sglang && bin/test           # the tests: ruff, mypy, then pytest (real SGLang and SLURM included)",
)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _prose(text: str) -> str:
    """The page without its fenced blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _fences(text: str) -> Iterator[tuple[str, str]]:
    """(language, body) of every fenced block."""
    for match in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        yield match.group(1), match.group(2)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(page.read_text()).splitlines():
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def test_generated_tables_equal_the_code() -> None:
    stale = [_name(p) for p in PAGES if render(p.read_text()) != p.read_text()]
    assert stale == [], f"run bin/gen-docs: out of date: {stale}"


def test_render_refuses_an_unknown_table() -> None:
    with pytest.raises(ValueError, match="names no table"):
        render("<!-- generated: no-such-table -->\n<!-- end generated -->")


def test_every_slime_flag_is_accepted_or_refused() -> None:
    from tether.docs_tables import SLIME_FLAGS

    ours = {s.flag for s in flag_specs()}
    assert sorted(SLIME_FLAGS - ours - set(refused())) == []


def test_readme_opens_with_the_two_setup_commands_and_stays_short() -> None:
    text = (ROOT / "README.md").read_text()
    first = next(_fences(text))
    assert first == ("bash", "\n".join(SETUP_COMMANDS) + "\n")
    assert text.index("```bash") < text.index("\n## ")  # first thing after the intro
    assert len(text.splitlines()) <= 150


def _links(page: Path) -> Iterator[str]:
    for match in re.finditer(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        target = match.group(1)
        if not re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            yield target


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert broken == []


def test_the_docs_folder_is_reachable_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    assert [_name(p) for p in PAGES[1:] if p.resolve() not in linked] == []


# --- commands ------------------------------------------------------------------------------------

LAUNCHERS = ("tether", "bin/tether", ".venv/bin/tether", "/opt/tether/bin/tether")
SEPARATORS = {"&&", "||", ";", "|"}


def _commands(text: str) -> Iterator[list[str]]:
    """Every `tether …` command line of the page's shell blocks, as argv after the launcher."""
    for language, body in _fences(text):
        if language not in ("bash", "sh"):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            words = shlex.split(line, comments=True)
            start = 0
            for i, word in enumerate([*words, ";"]):
                if word in SEPARATORS:
                    if words[start:i] and words[start] in LAUNCHERS:
                        yield words[start + 1 : i]
                    start = i + 1


def _yaml_files(tmp_path: Path) -> None:
    """The YAML files the docs show (a block whose first line is `# NAME.yaml`), written out."""
    for page in PAGES:
        for language, body in _fences(page.read_text()):
            match = re.match(r"# ([\w.-]+\.yaml)\n", body)
            if language == "yaml" and match:
                (tmp_path / match.group(1)).write_text(body)


def _shown_commands() -> list[tuple[str, list[str]]]:
    return [(_name(p), argv) for p in PAGES for argv in _commands(p.read_text())]


def test_the_docs_show_tether_commands() -> None:
    shown = {argv[0] for _page, argv in _shown_commands()}
    assert {"run", "plan", "demo", "engine", "init-model", "convert", "bench", "plot", "agent"} <= shown


@pytest.mark.parametrize(
    ("page", "argv"), _shown_commands(), ids=lambda v: " ".join(v) if isinstance(v, list) else v
)
def test_every_tether_command_shown_parses(
    page: str, argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # relative files the docs name are made here
    _yaml_files(tmp_path)
    (tmp_path / "old-sync.json").write_text("{}")  # performance.md's --compare example
    try:
        cli.parse_only(argv)
    except SystemExit as exc:
        assert exc.code == 0, f"{page}: `tether {' '.join(argv)}` does not parse"


def test_parse_only_refuses_what_main_refuses() -> None:
    from tether.runtime.errors import ConfigError

    with pytest.raises(ConfigError, match="--no-such-flag"):
        cli.parse_only(["run", "--no-such-flag"])
    with pytest.raises(SystemExit):
        cli.parse_only(["plot"])  # its run directory is required
    assert cli.parse_only(["plan", "--json", "--rollout-batch-size", "4"]) is not None


# --- flags ---------------------------------------------------------------------------------------


def _options(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found |= {o for o in action.option_strings if o.startswith("--")}
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


def _known_flags() -> set[str]:
    """Every flag of tether's commands, the run configuration's and the refused ones."""
    from support.device_wheels import load_device_check

    from tether.bench import BENCHES
    from tether.bench.compare import add_compare_argument

    known = {s.flag for s in flag_specs()} | set(refused()) | {"--config", "--json", "--help", "--debug"}
    for command in cli.COMMANDS.values():
        module = importlib.import_module(command.module)
        if hasattr(module, "add_arguments"):
            parser = argparse.ArgumentParser()
            module.add_arguments(parser)
            known |= _options(parser)
    for module_name, _help in BENCHES.values():
        parser = argparse.ArgumentParser()
        importlib.import_module(module_name).add_arguments(parser)
        add_compare_argument(parser)
        known |= _options(parser)
    return known | _options(load_device_check().build_parser())


FLAG = r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])(?![\w*<-])"
"""A flag's name; not a pattern such as `--moe-*` or `--sglang-<flag>`."""


def _table_flags(text: str) -> Iterator[str]:
    """The flags named in the first cell of every table row."""
    for line in _prose(text).splitlines():
        if line.startswith("| ") and not line.startswith("|---"):
            yield from re.findall(FLAG, line.split(" | ")[0])


def _code_flags(text: str) -> Iterator[str]:
    """The flags named in the prose's code spans."""
    for span in re.findall(r"`([^`\n]+)`", _prose(text)):
        yield from re.findall(FLAG, span)


def test_every_flag_a_table_names_exists() -> None:
    known = _known_flags()
    unknown = {
        f"{_name(p)}: {flag}"
        for p in PAGES
        for flag in _table_flags(p.read_text())
        if flag not in known and flag not in FOREIGN_FLAGS and not flag.startswith("--sglang-")
    }
    assert sorted(unknown) == []


def test_every_flag_the_prose_names_exists() -> None:
    known = _known_flags()
    unknown = {
        f"{_name(p)}: {flag}"
        for p in PAGES
        for flag in _code_flags(p.read_text())
        if flag not in known and flag not in FOREIGN_FLAGS and not flag.startswith("--sglang-")
    }
    assert sorted(unknown) == []


def test_every_foreign_flag_listed_is_named_by_the_docs() -> None:
    named = {f for p in PAGES for f in [*_table_flags(p.read_text()), *_code_flags(p.read_text())]}
    assert sorted(set(FOREIGN_FLAGS) - named) == []


# --- messages, paths and names -------------------------------------------------------------------


def _product_source() -> str:
    return "\n".join(p.read_text() for folder in PRODUCT for p in sorted((ROOT / folder).rglob("*.py")))


def test_every_message_in_troubleshooting_is_in_the_code() -> None:
    text = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) >= 20
    source = _product_source()
    missing = [
        fragment
        for row in rows
        for fragment in re.findall(r"`([^`]+)`", row.split(" | ")[0])
        if fragment not in source
    ]
    assert missing == []


def test_every_repository_path_named_exists() -> None:
    pattern = r"(?<![\w/.-])((?:head|runtime|placement|rollout|train|sync|bin|tests|docs)/[\w./@-]+\.(?:py|md|sh|sbatch|service|txt))"
    missing = {
        f"{_name(p)}: {path}"
        for p in PAGES
        for path in re.findall(pattern, p.read_text())
        if not (ROOT / path).exists()
    }
    assert sorted(missing) == []


def _resolves(name: str) -> bool:
    """Whether a dotted `tether.…` name is a module or an attribute of one."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_tether_name_mentioned_imports() -> None:
    names = {n for p in PAGES for n in re.findall(r"`(tether(?:\.\w+)+)`", p.read_text())}
    assert names, "the docs name no tether.* module"
    assert sorted(n for n in names if not _resolves(n)) == []
