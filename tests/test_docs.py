"""README.md and docs/: every relative link resolves to a file, and every ``juicytalk ...`` command shown in a
code block or an indented block names a real subcommand with real flags (read by the CLI's own argparse
parser, in this process: nothing runs)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from orchestrator.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
COMMAND = re.compile(r"(?:^|[\s/])juicytalk\s+(\S.*)")


def _name(page: Path) -> str:
    return str(page.relative_to(REPO))


def links(text: str) -> list[str]:
    """Relative link targets of a markdown page (not in code), anchors dropped."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    out = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # https:, mailto:, an anchor on the same page
        out.append(target.split("#", 1)[0])
    return out


def code_lines(text: str) -> list[str]:
    """Lines of fenced code blocks and of indented blocks (4 spaces after a blank line, outside lists), with
    shell continuations (a trailing backslash) and a usage line's wrapped ``[...]`` options joined on."""
    lines, out, fence, indented, prev_blank = text.split("\n"), [], False, False, True
    for line in lines:
        if line.lstrip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            if line.startswith("    ") and (indented or prev_blank):
                indented = True
            elif line.strip():
                indented = False
            prev_blank = not line.strip()
        if not (fence or indented) or not line.strip():
            continue
        stripped = line.strip()
        if out and (out[-1].endswith("\\") or stripped.startswith("[")):
            out[-1] = out[-1].rstrip("\\").rstrip() + " " + stripped
        else:
            out.append(stripped)
    return out


def commands(text: str) -> list[str]:
    """The ``juicytalk`` command lines of a page's code, each from its subcommand on."""
    return [m.group(1) for line in code_lines(text) if (m := COMMAND.search(line))]


def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def check_command(command: str, parsers: dict[str, argparse.ArgumentParser]) -> str:
    """'' when ``command`` (after ``juicytalk``) names a subcommand and only flags it has, else why not. A
    usage line's ``[--flag VALUE]`` and ``a|b`` alternatives count as the flags they show."""
    words = shlex.split(command.replace("[", " ").replace("]", " "), comments=True)
    if not words or words[0] not in parsers:
        return f"no subcommand {words[0] if words else ''!r} (have {', '.join(parsers)})"
    have = {s for a in parsers[words[0]]._actions for s in a.option_strings}
    flags = [w.split("=", 1)[0] for w in words[1:] for w in w.split("|") if re.match(r"^--?[A-Za-z]", w)]
    missing = [f for f in flags if f not in have]
    return f"{words[0]} has no {', '.join(missing)}" if missing else ""


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page):
    broken = [t for t in links(page.read_text()) if t and not (page.parent / t).exists()]
    assert not broken, f"{_name(page)}: links to nothing: {broken}"


def test_every_juicytalk_command_shown_has_its_subcommand_and_flags():
    parsers = subcommands()
    shown = {(page, c) for page in PAGES for c in commands(page.read_text())}
    assert len(shown) > 20  # the pages show commands (the reader found them)
    bad = [f"{_name(page)}: juicytalk {c}: {why}" for page, c in sorted(shown) if (why := check_command(c, parsers))]
    assert not bad, "\n".join(bad)


def test_the_checks_catch_what_they_check():
    parsers = subcommands()
    assert check_command("sweep examples/seed.yaml --dry-run --no-such-flag", parsers) == "sweep has no --no-such-flag"
    assert check_command("sweeps examples/seed.yaml", parsers).startswith("no subcommand 'sweeps'")
    assert check_command("report DIR [--png DIR] [--launcher warm|process]", parsers) == "report has no --launcher"
    page = "text\n\n    juicytalk trial --d-model 64 \\\n        --n-layers 2\n\n* `juicytalk nothing` in prose\n"
    assert commands(page) == ["trial --d-model 64 --n-layers 2"]
    assert links("[a](docs/x.md#part) `[b](nowhere.md)` [c](https://x.org) [d](#here)") == ["docs/x.md"]
