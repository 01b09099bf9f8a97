"""README.md and docs/: every relative link resolves to a file, every ``juicytalk ...`` command shown in a
code block or an indented block names a real subcommand with real flags (read by the CLI's own argparse
parser, in this process: nothing runs), and every ``console`` block's commands print what the page says they
print (they are run: such a block holds only commands that take seconds on a CPU)."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from orchestrator.cli import build_parser, main

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
COMMAND = re.compile(r"(?:^|[\s/])juicytalk\s+(\S.*)")
# A transcript: a fenced ```console block of ``$ command`` lines (a trailing backslash continues one; a heredoc's
# lines, to its terminator, belong to it), each followed by lines it prints: an excerpt, in any order, of whole
# lines (runs of spaces are one); ``...`` alone marks lines left out, inside a line text left out (what differs
# from machine to machine: where a cell would run here). The numbers a page gives are the ones it prints.
CONSOLE = re.compile(r"^```console\n(.*?)^```", re.S | re.M)
HEREDOC = re.compile(r"<<-?\s*'?\"?(\w+)")
# What a transcript's commands may read, from the folder they run in (a fresh one, so no earlier results show)
CHECKOUT = ("examples", "tests", "benchmarks", "docs")


@dataclass(frozen=True)
class Shown:
    """One command of a console block and the lines the page says it prints."""

    command: str
    lines: tuple[str, ...]


def transcripts(text: str) -> list[list[Shown]]:
    """The console blocks of a page, each its commands in order."""
    blocks = []
    for block in CONSOLE.findall(text):
        shown: list[tuple[str, list[str]]] = []
        until = ""  # a heredoc's terminator while its lines are read
        for line in block.split("\n")[:-1]:
            if until:
                shown[-1] = (f"{shown[-1][0]}\n{line}", shown[-1][1])
                until = "" if line.strip() == until else until
            elif shown and shown[-1][0].endswith("\\"):
                shown[-1] = (f"{shown[-1][0].removesuffix(chr(92)).rstrip()} {line.strip()}", shown[-1][1])
            elif line.startswith("$ "):
                shown.append((line[2:].strip(), []))
                until = m.group(1) if (m := HEREDOC.search(line)) else ""
            elif shown and line.strip() and line.strip() != "...":
                shown[-1][1].append(" ".join(line.split()))
        blocks.append([Shown(command, tuple(lines)) for command, lines in shown])
    return blocks


def _block_ids() -> list[tuple[Path, int]]:
    return [(page, i) for page in PAGES for i, _ in enumerate(transcripts(page.read_text()))]


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
    shell continuations (a trailing backslash) and a usage line's wrapped ``[...]`` options joined on; of a
    console block, its commands only (``$`` dropped), not what they print."""
    lines, out, fence, indented, prev_blank, console = text.split("\n"), [], False, False, True, False
    for line in lines:
        if line.lstrip().startswith("```"):
            fence, console = not fence, line.strip() == "```console"
            continue
        if console:
            if line.startswith("$ ") or (out and out[-1].endswith("\\")):
                line = line.removeprefix("$ ")
            else:
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


def run_shown(command: str) -> list[str]:
    """What ``command`` prints (stdout, then stderr), a line each with runs of spaces as one. ``juicytalk ...``
    runs in this process (its imports paid once), anything else in bash with this Python's scripts first on PATH."""
    if command.split(None, 1)[0] == "juicytalk" and not re.search(r"[|<>;&\n]", command):
        out, err = _captured(lambda: main(shlex.split(command)[1:]))
    else:
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
        proc = subprocess.run(["bash", "-c", command], capture_output=True, text=True, env=env, timeout=300)
        out, err = proc.stdout, proc.stderr
    return [" ".join(line.split()) for line in (out + err).splitlines()]


def matches(shown: str, printed: str) -> bool:
    """``printed`` is the line ``shown``, whose ``...`` each stand for any text."""
    return re.fullmatch(".*".join(map(re.escape, re.split(r"\s*\.\.\.\s*", shown))), printed) is not None


def _captured(call) -> tuple[str, str]:
    """``call()``'s stdout and stderr (a SystemExit, as argparse's, ends it as a return would)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            call()
        except SystemExit:
            pass
    return out.getvalue(), err.getvalue()


@pytest.mark.parametrize("page,block", _block_ids(), ids=lambda v: _name(v) if isinstance(v, Path) else str(v))
def test_each_console_block_prints_what_its_page_says(page, block, tmp_path, monkeypatch):
    """The page is the expectation: each line it shows under a command is one the command prints now, run in a
    fresh folder that holds the checkout's examples (so a page's numbers are regenerated, never copied here)."""
    for name in CHECKOUT:
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)
    for shown in transcripts(page.read_text())[block]:
        printed = run_shown(shown.command)
        missing = [line for line in shown.lines if not any(matches(line, out) for out in printed)]
        assert not missing, (f"{_name(page)}: $ {shown.command}\nshown, not printed:\n" + "\n".join(missing)
                             + "\nprinted:\n" + "\n".join(printed[-40:]))


def test_a_transcript_reads_commands_heredocs_and_shown_lines():
    page = ("```console\n$ cat > s.yaml <<'EOF'\nname: s\n  grid: {}\nEOF\n$ juicytalk sweep s.yaml \\\n"
            "    --dry-run\nA   line  \n...\nanother\n```\n")
    assert transcripts(page) == [[Shown("cat > s.yaml <<'EOF'\nname: s\n  grid: {}\nEOF", ()),
                                  Shown("juicytalk sweep s.yaml --dry-run", ("A line", "another"))]]
    assert commands(page) == ["sweep s.yaml --dry-run"]
    assert matches("│ a │ 1.0 GiB ... │ ... │", "│ a │ 1.0 GiB OOM? │ runs │")
    assert not matches("│ a │ 1.0 GiB ... │", "│ a │ 2.0 GiB │") and not matches("a", "a b")
