"""The documentation: the mkdocs site builds with --strict (a broken link, a broken anchor or a page missing from the
nav fails it), no page grows past ~400 lines, and every `docs/*.md` the README, the code, the tests and the scripts
name exists and links resolve."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCS = REPO_ROOT / "docs"
SETUP_STAMP = REPO_ROOT / "models" / "generated" / "VERSION.tiny"  # written by the test set-up (tests/test_gguf.py)
PAGE_LINES_MAX = 440  # the goal is ~400 lines a page; past this a page gets split (evaluation.md -> results log)
DOCS_EXTRA_MODULES = ("mkdocs", "material", "mdx_truly_sane_lists")  # what pyproject's docs extra installs
DOC_MENTION = re.compile(r"\bdocs/([A-Za-z0-9_./-]+\.md)")
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def nav_pages() -> set[str]:
    """Pages listed in mkdocs.yml's nav (the file's `- Title: page.md` lines)."""
    text = (REPO_ROOT / "mkdocs.yml").read_text()
    return set(re.findall(r"^\s*-\s*[^:\n]+:\s*([A-Za-z0-9_./-]+\.md)\s*$", text, flags=re.M))


def require_mkdocs() -> None:
    """Skips where the docs extra is absent, unless the README's test set-up ran: it installs the extra, so CI
    (`scripts/setup.sh --test && python3 -m pytest -q`) cannot skip the strict build."""
    missing = [name for name in DOCS_EXTRA_MODULES if importlib.util.find_spec(name) is None]
    if not missing:
        return
    if SETUP_STAMP.exists():
        pytest.fail(f"scripts/setup.sh --test ran ({SETUP_STAMP} exists) but {missing} are missing: the docs extra")
    pytest.skip(f"needs the docs extra (pip install mkdocs mkdocs-material mdx-truly-sane-lists): {missing} missing")


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    require_mkdocs()
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(
        cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    )
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_strict_build_fails_on_a_broken_link(tmp_path: Path) -> None:
    """The CI check is only worth having if it fails: a copy of the site with one broken link must not build."""
    require_mkdocs()
    shutil.copytree(DOCS, tmp_path / "docs")
    shutil.copy(REPO_ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    with open(tmp_path / "docs" / "cli.md", "a") as f:
        f.write("\n[a page that does not exist](no-such-page.md)\n")
    cmd = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    done = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env={**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    )
    assert done.returncode != 0
    assert "no-such-page.md" in done.stdout + done.stderr


def test_every_page_is_in_the_nav_and_short_enough() -> None:
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert "index.md" in pages
    assert set(pages) == nav_pages(), "every docs page is in mkdocs.yml's nav, and every nav entry exists"
    long = {p: n for p in pages if (n := len((DOCS / p).read_text().splitlines())) > PAGE_LINES_MAX}
    assert not long, f"pages over {PAGE_LINES_MAX} lines (split them): {long}"


def _sources() -> list[Path]:
    files = [REPO_ROOT / "README.md", REPO_ROOT / "examples" / "README.md", REPO_ROOT / "models" / "README.md"]
    files += sorted(DOCS.rglob("*.md"))
    for folder, pattern in (("python", "*.py"), ("convert", "*.py"), ("tests", "*.py"), ("scripts", "*")):
        files += [p for p in (REPO_ROOT / folder).rglob(pattern) if p.is_file() and p.suffix in (".py", ".sh", "")]
    return [p for p in files if p.is_file()]


def test_docs_named_in_code_readme_and_tests_exist() -> None:
    missing = []
    for path in _sources():
        text = path.read_text(errors="replace")
        for page in DOC_MENTION.findall(text):
            if not (DOCS / page).is_file():
                missing.append(f"{path.relative_to(REPO_ROOT)}: docs/{page}")
    assert not missing, "docs pages named but absent:\n" + "\n".join(missing)


def test_readme_links_resolve() -> None:
    text = (REPO_ROOT / "README.md").read_text()
    links = [t for t in MARKDOWN_LINK.findall(text) if not re.match(r"[a-z]+:", t)]
    assert links, "the README links its docs pages"
    broken = [t for t in links if not (REPO_ROOT / t.split("#", 1)[0]).exists()]
    assert not broken, f"README links to missing files: {broken}"


def _subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, str, str]]:
    """(command path, its help line in the parent's list, its --help description) of every subcommand, nested too."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield " ".join((*path, name)), str(helps.get(name) or ""), str(sub.description or "")
                yield from _subcommands(sub, (*path, name))


def _named_pages(text: str) -> list[str]:
    return [page for page in DOC_MENTION.findall(text) if (DOCS / page).is_file() and page in nav_pages()]


def test_every_subcommand_help_names_its_docs_page() -> None:
    from kvcmas_cpp.cli import build_parser

    parser = build_parser()
    assert _named_pages(parser.description or ""), parser.description
    commands = list(_subcommands(parser))
    names = {c[0] for c in commands}
    assert {"run", "serve", "bench core", "bench agents", "convert", "gguf set", "models pull", "cluster up"} <= names
    undocumented = [c for c in commands if not (_named_pages(c[1]) and _named_pages(c[2]))]
    assert not undocumented, f"subcommands whose help or --help names no existing docs page: {undocumented}"
    one_line = [(c[0], c[1]) for c in commands if len(c[1]) > 120 or "\n" in c[1]]
    assert not one_line, f"help lines longer than one line: {one_line}"


def test_help_output_points_at_the_page(capsys: pytest.CaptureFixture[str]) -> None:
    from kvcmas_cpp.cli import main
    from kvcmas_cpp.server import main as server_main

    for run, argv, page in (
        (main, ["--help"], "docs/cli.md"),
        (main, ["bench", "core", "--help"], "docs/engine-speed.md"),
        (main, ["serve", "--help"], "docs/server.md"),
        (server_main, ["--help"], "docs/server.md"),
    ):
        with pytest.raises(SystemExit) as done:
            run(argv)
        assert done.value.code == 0
        out = capsys.readouterr().out
        assert page in out, (argv, out[:400])  # whole: a line never breaks inside the page's name
