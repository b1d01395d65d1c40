"""The user documentation: README.md stays short, every relative link in README.md and docs/
resolves, and neither the documentation nor the sources carry notes about how the project was
developed (ticket numbers, team names, the machines benchmarks were run on as lent hardware).

Pure file reading: no engine, no server, no network.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 300

# Phrases that describe the development process rather than the software. Each is narrow
# enough that ordinary words (an HTTP session, a pytest session fixture, a connector's payload
# lease, a stop token) do not match it.
DEV_PATTERNS = {
    "an issue number": re.compile(r"\bissues? #?\d+", re.I),
    "a bare ticket number": re.compile(r"(?<![\w/&#])#\d+\b"),
    "a team name": re.compile(r"\bteams? [A-Z]\d*\b"),
    "other teams": re.compile(r"\bother teams\b", re.I),
    "lent hardware": re.compile(r"\blent\b", re.I),
    "the device tool": re.compile(r"\bdevice tool\b", re.I),
    "a numbered stop": re.compile(r"\bstop \d+\b", re.I),
    "a session's time or budget": re.compile(r"\bsession'?s? (time|budget|lease|device)", re.I),
    "a wave of work": re.compile(r"\bthis wave\b", re.I),
    "a machine lease": re.compile(
        r"\b(one|two|fresh|later|earlier|other|this) leases?\b|\bas leased\b", re.I
    ),
    "device calls or minutes": re.compile(r"\bdevice (call|calls|minutes|budget)\b", re.I),
    "a warm window": re.compile(r"\bwarm window\b", re.I),
}

SOURCE_DIRS = (
    "vllm_omni_plugin",
    "entry_points",
    "scripts",
    "benchmarks",
    "stage_configs",
    "tests",
)
SOURCE_SUFFIXES = {".py", ".sh", ".yaml", ".yml", ".md", ".txt", ".toml"}
# Files that are not ours to word: vLLM-Omni's deploy files, kept as shipped for the migration
# tests, and run records.
EXCLUDED_PARTS = {"fixtures", "results", "__pycache__"}


def _checked_files() -> list[Path]:
    files = [README, ROOT / "BENCHMARKS.md", ROOT / "Makefile", *DOCS]
    for name in SOURCE_DIRS:
        for path in sorted((ROOT / name).rglob("*")):
            rel = path.relative_to(ROOT)
            if (
                path.is_file()
                and path.suffix in SOURCE_SUFFIXES
                and not EXCLUDED_PARTS.intersection(rel.parts)
                and path != Path(__file__).resolve()
                # the package's entry_points/ is a link to the top-level folder, checked there
                and rel.parts[:2] != ("vllm_omni_plugin", "entry_points")
            ):
                files.append(path)
    return files


def dev_process_phrases(text: str) -> list[tuple[int, str, str]]:
    """(line number, what, line) for every development-process phrase in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in DEV_PATTERNS.items():
            if pattern.search(line):
                found.append((number, what, line.strip()))
    return found


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move detail to docs/"


def test_docs_exist():
    assert DOCS, "docs/*.md is empty"


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path):
    broken = []
    for target in _LINK.findall(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # an absolute URL (https:, mailto:) or an anchor in the same page
        path = target.split("#", 1)[0]
        if not (doc.parent / path).exists():
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links to missing files: {broken}"


def test_no_development_process_phrases():
    found = []
    for path in _checked_files():
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, what, line in dev_process_phrases(text):
            found.append(f"{path.relative_to(ROOT)}:{number}: {what}: {line[:120]}")
    assert not found, "development-process phrases:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "text",
    [
        "see issue 30 for the plan",
        "fixed in #42",
        "(team G, multi-node stages)",
        "Other teams append blocks below",
        "on the lent H200",
        "the device tool brings back 8 files",
        "as agreed at stop 41",
        "the session's time ran out",
        "this wave adds videos",
        "one lease, fresh at its start",
        "30 device minutes",
        "within the machine's 30 s warm window",
    ],
)
def test_each_pattern_catches_its_phrase(text):
    assert dev_process_phrases(text), text


@pytest.mark.parametrize(
    "text",
    [
        "the HTTP session is closed after each request",
        '@pytest.fixture(scope="session")',
        "Session keys: one per direction, fresh for each connection",
        "the producer keeps the payload alive until its lease expires",
        "a shm put no longer looks at every lease out",
        "stop_token_ids: [16385]",
        "device time by kernel over one call",
        "the talker's issue is its step time",
        "color: #fff",
    ],
)
def test_ordinary_words_do_not_match(text):
    assert not dev_process_phrases(text), text
