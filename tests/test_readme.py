"""The README's and docs/' examples run as written, so the front page and the docs stay true."""

import re
import shlex
from pathlib import Path

import pytest

from kvmem.replay.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]


def _blocks(page: Path, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", page.read_text(), flags=re.S)


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def test_readme_python_example_runs():
    blocks = _blocks(README, "python")
    assert blocks, "README.md has no python example"
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})


@pytest.mark.parametrize("page", PAGES[1:], ids=_page_id)
def test_docs_python_examples_run(page):
    for code in _blocks(page, "python"):
        exec(compile(code, str(page), "exec"), {})


def test_readme_setup_shows_the_planners_install_without_torch_beside_the_full_one_from_the_cpu_wheel_index():
    text = README.read_text()
    assert "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/kvmem-replay" in text
    assert ("pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && .venv/bin/pip install -e "
            "'.[dev]'") in text
    assert ".venv/bin/python -m pytest" in text


def test_the_dev_extra_installs_what_the_tests_need_and_the_core_does_not_need_torch():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith(("torch", "triton"))]
    extras = project["optional-dependencies"]
    assert "torch" in extras["dev"][-1] and extras["torch"][0].startswith("torch")


def _replay_commands(page: Path) -> list[str]:
    lines = [line for block in _blocks(page, "bash") for line in block.splitlines()]
    return [line.split(" #")[0] for line in lines if re.match(r"(\.venv/bin/)?kvmem-replay\b", line)]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_replay_commands_shown_are_valid_options(page):
    for command in _replay_commands(page):
        argv = [arg for arg in shlex.split(command)[1:] if arg != "&&"]
        try:
            build_parser().parse_args(argv)
        except (Exception, SystemExit) as e:
            pytest.fail(f"{_page_id(page)}: {command!r} does not parse: {e}")


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", page.read_text(), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_links_to_files_and_headings_resolve(page):
    for target, anchor in re.findall(r"\]\(([^)#]*)(?:#([^)]*))?\)", page.read_text()):
        if "://" in target:
            continue
        linked = page.parent / target if target else page
        assert linked.exists(), f"{_page_id(page)} links to missing {target}"
        if anchor:
            assert anchor in _anchors(linked), f"{_page_id(page)} links to missing heading {target}#{anchor}"
