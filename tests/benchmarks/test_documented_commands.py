"""Every ``python -m`` command the documentation shows exists, and runs in a tiny form.

The commands are read from the Markdown itself (fenced code blocks and inline code spans), so a
page that names a module, a subcommand or a flag that does not exist fails here. A command with
placeholders (``SCENARIO.json``, ``NAME``, ``a|b``) or ``[optional]`` parts is a template: its
flags must appear in the module's ``--help``, and with the optional parts dropped and no
placeholder left it also runs. A concrete command runs with ``TINY``'s extra arguments appended
(argparse keeps the last value of a repeated flag), in a copy of the repository so that nothing
it writes lands in the checkout, and must exit 0 and write non-empty results.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks import scale_out

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [
        ROOT / "README.md",
        ROOT / "benchmarks" / "README.md",
        *(ROOT / "docs").glob("*.md"),
        *(ROOT / "docs" / "reproduction").glob("*.md"),
    ]
)
PROMPT = re.compile(r"^(?:\.venv/bin/)?python -m (?=\S)")
# What the commands read or import; copied once per session, so their outputs stay in tmp.
COPIED = ("benchmarks", "controlplane", "examples", "webui", "worker_agent", "manage.py")

# Extra arguments that shrink a documented command (module and subcommand) to a few seconds:
# one seed, a short horizon, one cell of a table. They come after the documented arguments, so
# the documented flags are still parsed, and the command still takes its documented path.
TINY: dict[tuple[str, str | None], tuple[str, ...]] = {
    ("controlplane.recovery", "simulate"): ("--seeds", "1", "--hours", "0.01", "--no-report"),
    ("benchmarks.reproduce_odyssey", None): ("--seeds", "1", "--hours", "0.01"),
    ("benchmarks.reproduce_oobleck", None): (
        *("--models", "gpt2", "--intervals", "10min", "--systems", "oobleck,bamboo"),
    ),
    ("benchmarks.reproduce_checkfree", None): ("--rates", "0.16", "--seeds", "1", "--hours", "30"),
    ("benchmarks.planner_scaling", None): ("--sizes", "32", "--baseline-budget", "0.5"),
    ("benchmarks.simulator_speed", None): ("--sizes", "64", "--days", "0.02"),
    ("benchmarks.planning_task", None): ("--nodes", "64", "--rounds", "1"),
    # no failure in the first half hour of seed 0: the job, the calibration and the table
    ("benchmarks.llama3_year", None): (
        *("--days", "0.02", "--seeds", "1", "--policies", "rerouting,checkpoint"),
    ),
    ("benchmarks.pitstop_gain", None): ("--seeds", "1", "--hours", "0.2", "--rows", "0,8"),
    ("benchmarks.sweep_workers", None): ("--seeds", "1", "--hours", "0.5"),
    ("benchmarks.estimator_accuracy", None): ("--quick", "--plans", "pp1-m4"),
    ("benchmarks.trainer_recovery", None): (
        *("--pp", "2", "--dp", "2", "--repeats", "1", "--paths", "rerouting"),
        *("--steps-before", "3", "--steps-after", "2"),
    ),
    ("benchmarks.recovery_e2e", None): (
        *("--policies", "rerouting", "--repeats", "1", "--warmup-steps", "3"),
    ),
    # torchrun's restart sometimes never forms its group: a run waits 60 s at most for it (a
    # loaded 2-core CI machine once took over 20 s to bring the restored ranks' first step, and
    # once an elastic run reached 40 s)
    ("benchmarks.launch_restart", None): ("--repeats", "1", "--timeout", "60"),
    # one kill of 2 replicas: Pitstop's rerouting beside torchft's shortest timeouts
    ("benchmarks.torchft_side_by_side", None): (
        *("--repeats", "1", "--arms", "pitstop,torchft-aggressive", "--replicas", "2"),
        *("--timeout", "30"),
    ),
    # one path, a few steps either side of the kill (the stack's start is most of its time)
    ("benchmarks.loss_parity", None): (
        *("--paths", "ddp-reroute", "--steps-before", "3", "--steps-after", "3"),
        *("--timeout", "40"),
    ),
    # a tab open 2 s, one cold load of each page, one simulated node (Chromium's start is most)
    ("benchmarks.dashboard_load", None): ("--seconds", "2", "--loads", "1", "--nodes", "1"),
    # six simulated nodes, one killed and then two
    ("benchmarks.recovery_scale", None): (
        *("--nodes", "6", "--burst", "2", "--settle", "1", "--timeout", "60"),
    ),
    # eight nodes through nginx to one server, then two; a sweep of one seed on 1, then 2 workers
    ("benchmarks.scale_out", None): (
        *("--connections", "8", "--seconds", "5", "--kills", "1", "--hangs", "1"),
        *("--settle", "1", "--seeds", "1", "--hours", "0.2"),
    ),
    ("benchmarks.heartbeat_load", None): (
        *("--connections", "16", "--seconds", "5", "--kills", "2", "--hangs", "1"),
        *("--settle", "1"),
    ),
}
# Seconds a tiny run may take, where not 120: launch_restart's four kills may each wait out their
# 60 s timeout for a group that never forms (seen once in CI: three kills had taken 98 s).
TIMEOUT_S = {"benchmarks.launch_restart": 360}
# Where a command's JSON lands when it does not print "wrote PATH": the simulator's summary.
SUMMARY = "summary.json"
# The keys under which each command's JSON holds its results; one must be non-empty.
RESULT_KEYS = ("results", "rows", "policies")


@dataclass(frozen=True)
class Command:
    """One documented command: where it is, its words, and what of it is template."""

    page: str
    text: str
    words: tuple[str, ...]  # without the optional [..] groups
    optional_flags: tuple[str, ...]
    template: bool  # placeholders remain after dropping the optional groups

    @property
    def module(self) -> str:
        return self.words[0]

    @property
    def subcommand(self) -> str | None:
        """The word after the module when it is a subcommand (``a|b`` for alternatives)."""
        rest = self.words[1:]
        if not rest or not re.fullmatch(r"[a-z][a-z|-]*", rest[0]):
            return None  # a flag, a path, or a placeholder such as COMMAND
        return rest[0]

    @property
    def flags(self) -> set[str]:
        named = {w.split("=")[0] for w in self.words if w.startswith("--")}
        return named | set(self.optional_flags)


def code_texts(markdown: str) -> list[str]:
    """Fenced code block lines (continuations joined, comments dropped) and inline code spans."""
    texts: list[str] = []
    fenced = False
    block: list[str] = []
    prose: list[str] = []
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            if fenced:
                joined = "\n".join(block).replace("\\\n", " ")
                texts.extend(part.split("  #")[0].strip() for part in joined.splitlines())
                block = []
            fenced = not fenced
        elif fenced:
            block.append(line)
        else:
            prose.append(line)
    texts.extend(re.findall(r"`([^`]+)`", " ".join(prose)))
    return texts


def parse(page: str, text: str) -> Command:
    body = PROMPT.sub("", text)
    optional = re.findall(r"\[([^\[\]]*)\]", body)
    required = re.sub(r"\[[^\[\]]*\]", " ", body)
    words = tuple(shlex.split(required))
    placeholder = re.compile(r"[A-Z]{2,}|\||…")
    return Command(
        page=page,
        text=text,
        words=words,
        optional_flags=tuple(w for part in optional for w in part.split() if w.startswith("--")),
        template=any(placeholder.search(w) for w in words),
    )


def documented() -> list[Command]:
    commands = []
    for page in PAGES:
        for text in code_texts(page.read_text()):
            if PROMPT.match(text):
                commands.append(parse(str(page.relative_to(ROOT)), text))
    return commands


COMMANDS = documented()


def run(args: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """The command's result; past ``timeout`` it is sent SIGTERM (a command that started a
    stack stops it then) and given a minute before SIGKILL, and the timeout is raised."""
    command = [sys.executable, "-m", *args]
    with subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as process:
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.terminate()
            try:
                process.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.communicate()
            raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.fixture(scope="module")
def copy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    for name in COPIED:
        if (ROOT / name).is_file():
            shutil.copy(ROOT / name, root / name)
            continue
        shutil.copytree(
            ROOT / name, root / name, ignore=shutil.ignore_patterns("__pycache__", "results")
        )
    return root


def test_the_docs_show_commands_of_every_kind() -> None:
    # a parser that finds nothing would pass every test below
    modules = {c.module for c in COMMANDS}
    assert {"controlplane.recovery", "benchmarks.reproduce_odyssey"} <= modules
    assert any(c.template for c in COMMANDS) and any(not c.template for c in COMMANDS)


def test_parse_splits_optional_flags_and_placeholders() -> None:
    command = parse("p.md", "python -m m.n sub SCENARIO.json [--seeds 20] [--out FILE] --x 1")
    assert command.words == ("m.n", "sub", "SCENARIO.json", "--x", "1")
    assert command.subcommand == "sub"
    assert command.flags == {"--x", "--seeds", "--out"}
    assert command.template
    assert not parse("p.md", "python -m m.n [--out FILE]").template


def flag_cases() -> list[tuple[str, str | None, frozenset[str], str]]:
    """Each (module, subcommand) a template names once, with every flag templates give it.

    A concrete command proves the flags it runs with (argparse rejects unknown ones), so only
    templates and ``[optional]`` flags are checked, and a template that adds no flag to a module
    that also runs concretely needs no check.
    """
    ran = {(c.module, c.subcommand) for c in COMMANDS if not c.template}
    cases: dict[tuple[str, str | None], tuple[set[str], list[str]]] = {}
    for command in COMMANDS:
        if not (command.template or command.optional_flags):
            continue
        if not re.fullmatch(r"[a-z_][a-z0-9_.]*", command.module):
            continue  # a pattern such as benchmarks.NAME or … names no module
        for sub in (command.subcommand or "").split("|"):
            flags, pages = cases.setdefault((command.module, sub or None), (set(), []))
            flags |= command.flags
            pages.append(command.page)
    return [
        (module, sub, frozenset(flags), ", ".join(sorted(set(pages))))
        for (module, sub), (flags, pages) in cases.items()
        if flags or (module, sub) not in ran
    ]


@pytest.mark.parametrize(
    ("module", "subcommand", "flags", "pages"),
    flag_cases(),
    ids=[f"{m} {s or ''}".strip() for m, s, _, _ in flag_cases()],
)
def test_documented_flags_exist(
    module: str, subcommand: str | None, flags: frozenset[str], pages: str
) -> None:
    result = run([module, *([subcommand] if subcommand else []), "--help"], cwd=ROOT)
    assert result.returncode == 0, f"{pages}: {module} {subcommand or ''}: {result.stderr}"
    missing = sorted(f for f in flags if not re.search(rf"{re.escape(f)}\b", result.stdout))
    assert not missing, f"{pages}: {module} {subcommand or ''} has no {', '.join(missing)}"


def runnable() -> list[tuple[tuple[str, ...], str]]:
    """Each distinct concrete command once, tiny arguments appended, with the pages naming it."""
    runs: dict[tuple[str, ...], list[str]] = {}
    for command in COMMANDS:
        if command.template:
            continue
        tiny = TINY.get((command.module, command.subcommand), ())
        runs.setdefault(command.words + tiny, []).append(command.page)
    return [(words, ", ".join(sorted(set(pages)))) for words, pages in runs.items()]


@pytest.mark.parametrize(("words", "pages"), runnable(), ids=[" ".join(w) for w, _ in runnable()])
def test_documented_command_runs(words: tuple[str, ...], pages: str, copy: Path) -> None:
    if words[0] == "benchmarks.scale_out" and (reason := scale_out.unavailable()) is not None:
        pytest.skip(f"the scale-out benchmark cannot run here: {reason}")
    result = run(list(words), cwd=copy, timeout=TIMEOUT_S.get(words[0], 120))
    assert result.returncode == 0, f"{pages}: {' '.join(words)}\n{result.stderr[-6000:]}"
    written = [Path(p) for p in re.findall(r"^wrote (.+\.json)$", result.stdout, re.M)]
    outs = [value for flag, value in itertools.pairwise(words) if flag == "--out"]
    if outs and not written and (copy / outs[-1] / SUMMARY).exists():
        written.append(copy / outs[-1] / SUMMARY)
    for path in written:
        payload = json.loads((copy / path).read_text())
        present = [key for key in RESULT_KEYS if key in payload]
        assert present, f"{pages}: {path} holds none of {RESULT_KEYS}"
        assert all(payload[key] for key in present), f"{pages}: {path} has empty results"
    if not written:
        assert result.stdout.strip(), f"{pages}: {' '.join(words)} printed nothing"
