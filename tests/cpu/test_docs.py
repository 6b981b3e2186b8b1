"""The README and docs are true against the repository: the README's file table names every tracked
top-level file and folder and every tracked file of bench/ (top level), tools/ and docs/, and
names nothing that is not there; its list of submission.py's sections is the file's banners, in
order; links to a heading of a doc resolve, and no doc points at a numbered section."""
import fnmatch
import os
import re
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
README = os.path.join(REPO, "README.md")


def tracked_files():
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                             check=True, timeout=60).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [line for line in out.splitlines() if line]


def section(text, heading):
    """The text under ``## heading`` up to the next level-2 heading."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {heading}' section"
    return match.group(1)


def table_names(text):
    """Every `name` in the first column of the Markdown tables of ``text``."""
    names = set()
    for line in text.splitlines():
        if line.startswith("|") and not line.startswith("|---"):
            first = line.split("|")[1]
            names.update(re.findall(r"`([^`]+)`", first))
    return names


def readme_file_names():
    return table_names(section(open(README).read(), "Files"))


def is_named(path, names):
    """``path`` (a file, or a folder ending in '/') is named exactly or by a glob."""
    return any(path == name or ("*" in name and fnmatch.fnmatch(path, name)) for name in names)


def required_entries(files):
    """What the table must name: top-level files and folders, bench/'s top-level files and
    folders, every file of tools/ and docs/."""
    needed = set()
    for path in files:
        parts = path.split("/")
        if len(parts) == 1:
            needed.add(path)
            continue
        top = parts[0]
        if top == "bench":
            needed.add(path if len(parts) == 2 else f"bench/{parts[1]}/")
        elif top in ("tools", "docs"):
            needed.add(path)
        else:
            needed.add(top + "/")
    return needed


def test_the_file_table_names_every_tracked_file_it_must():
    names = readme_file_names()
    missing = sorted(entry for entry in required_entries(tracked_files())
                     if not is_named(entry, names))
    assert not missing, f"README.md's file table does not name: {missing}"


def test_the_file_table_names_only_what_exists():
    gone = [name for name in readme_file_names()
            if not (os.path.exists(os.path.join(REPO, name)) or "*" in name)]
    assert not gone, f"README.md's file table names files that are not there: {gone}"


def test_required_entries_rule():
    files = ["Makefile", "bench/a.py", "bench/results/h200/x.txt", "lab/profile/p/q.py", "tools/t.py",
             "docs/d.md", "tests/cpu/test_x.py", "tests/gpu/y.py", ".ci/run", "specs/cpu.txt"]
    assert required_entries(files) == {"Makefile", "bench/a.py", "bench/results/", "lab/",
                                       "tools/t.py", "docs/d.md", "tests/", ".ci/", "specs/"}
    assert is_named("requirements-dev.txt", {"requirements*.txt"})
    assert not is_named("tools/new.py", {"tools/"})  # tools/ and docs/: each file by name


SUBMISSION_RULE = "# " + "=" * 20


def submission_sections():
    """The titles of submission.py's banner sections, in order: a rule line, a '# title' line,
    perhaps more comment lines, a closing rule line."""
    lines = open(os.path.join(REPO, "submission.py")).read().splitlines()
    titles, i = [], 0
    while i < len(lines) - 1:
        if (lines[i].startswith(SUBMISSION_RULE) and lines[i + 1].startswith("# ")
                and not lines[i + 1].startswith(SUBMISSION_RULE)):
            titles.append(lines[i + 1][2:].strip())
            i += 2
            while i < len(lines) and not lines[i].startswith(SUBMISSION_RULE):
                i += 1
        i += 1
    return titles


def _key(title):
    """A section title's name without its parenthesis or colon, lower case, no leading 'the'."""
    name = re.split(r"[(:]", title)[0].strip().lower()
    return re.sub(r"^the ", "", name)


def test_the_readme_lists_submissions_sections_in_order():
    row = next(line for line in open(README).read().splitlines()
               if line.startswith("| `submission.py` |"))
    listed = row.replace("`", "").lower()
    titles = submission_sections()
    assert len(titles) >= 5, titles
    positions = [listed.find(_key(title)) for title in titles]
    assert -1 not in positions, [t for t, p in zip(titles, positions, strict=True) if p < 0]
    assert positions == sorted(positions), list(zip(titles, positions, strict=True))


def _docs():
    paths = [README] + [os.path.join(REPO, "docs", name)
                        for name in sorted(os.listdir(os.path.join(REPO, "docs")))
                        if name.endswith(".md")]
    return {path: open(path).read() for path in paths}


def _slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces
    to '-'."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_to_headings_resolve():
    bad = []
    for path, text in _docs().items():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", text):
            file = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
            if not file.endswith(".md") or not os.path.exists(file):
                continue
            headings = re.findall(r"^#+ (.+)$", open(file).read(), re.M)
            if anchor not in {_slug(h) for h in headings}:
                bad.append(f"{os.path.relpath(path, REPO)}: {target}#{anchor}")
    assert not bad, bad


def test_no_doc_points_at_a_numbered_section():
    pattern = re.compile(r"\bsection \d|§ ?\d", re.I)
    bad = [f"{os.path.relpath(path, REPO)}: {m.group(0)!r}" for path, text in _docs().items()
           for m in pattern.finditer(text)]
    assert not bad, bad


def test_the_readme_opens_with_what_the_kit_is_for_and_the_two_commands():
    text = open(README).read()
    head = text[:text.index("## Local use")]
    for fact in ("2026-04-07 07:59 UTC", "refuses", "Python >= 3.10", "venv", "make eval",
                 "make test", "make help", "--index-url https://download.pytorch.org/whl/cpu",
                 "torch==2.13.0"):
        assert fact in head, fact
    for jargon in (r"one device call", r"\$OUT", r"\bcarry\b", r"lent H200", r"\bsessions?\b"):
        assert not re.search(jargon, text, re.I), jargon


def test_make_help_lists_every_target():
    makefile = open(os.path.join(REPO, "Makefile")).read()
    targets = re.search(r"^\.PHONY: (.+)$", makefile, re.M).group(1).split()
    help_text = "\n".join(re.findall(r'@echo "(.*)"', makefile))
    assert "help" in targets and "tune" in targets
    missing = [t for t in targets if t != "help" and f"make {t}" not in help_text]
    assert not missing, missing
