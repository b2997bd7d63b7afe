"""Every relative link in README.md and docs/*.md resolves: the target file exists in the
repository and a `#anchor` names a heading of the target markdown file (GitHub's anchor rules).

Fast (reads a few markdown files). docs/README.md explains the pages; `PENDING` lists pages
other branches add: a link to one of them is accepted only while it does not exist yet (once
it exists, its anchors are checked like any other), so empty the set once they are merged.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PENDING: set[str] = set()  # every page other branches promised now exists

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFDEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")   # http:, https:, mailto:, ...


def doc_files(root: Path = ROOT) -> list[Path]:
    """README.md and every docs/*.md under `root` that exist, sorted."""
    return [p for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))] if p.is_file()]


def _strip_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: inline code and link markup removed, lower case,
    everything but letters, digits, '_', '-' and spaces dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor the headings of markdown file `path` define (duplicates get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, text in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        s = slug(text)
        n = seen.get(s, 0)
        seen[s] = n + 1
        out.add(s if n == 0 else f"{s}-{n}")
    return out


def links(path: Path) -> list[str]:
    """The link targets of markdown file `path` (inline links, images, reference definitions),
    outside code blocks and code spans."""
    text = _strip_code(path.read_text(encoding="utf-8"))
    return _INLINE.findall(text) + _REFDEF.findall(text)


def broken_links(root: Path = ROOT, pending: set[str] = frozenset()) -> list[str]:
    """One 'FILE: TARGET: why' line per relative link under `root` that does not resolve."""
    bad = []
    for doc in doc_files(root):
        for target in links(doc):
            if _EXTERNAL.match(target):
                continue
            where, _, anchor = target.partition("#")
            dest = (doc.parent / where).resolve() if where else doc
            rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else str(dest)
            name = f"{doc.relative_to(root).as_posix()}: {target}"
            if not dest.is_relative_to(root.resolve()):
                bad.append(f"{name}: points outside the repository")
            elif not dest.exists():
                if rel not in pending:
                    bad.append(f"{name}: {rel} does not exist")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{name}: no heading with anchor #{anchor} in {rel}")
    return bad


_CITATION = re.compile(r"\bdocs/([\w.-]+\.md)(?:#([\w-]+))?")


def broken_citations(root: Path = ROOT, pending: set[str] = frozenset()) -> list[str]:
    """One 'FILE:LINE: docs/X.md#anchor: why' per citation in the code (*.py, *.sh, *.service
    tracked by git) whose page or heading does not exist."""
    import subprocess
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.py", "*.sh",
                            "*.service"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    bad = []
    for name in names:
        path = root / name
        if not path.is_file() or name == "tests/test_docs_links.py":  # its examples are fake
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for page, anchor in _CITATION.findall(line):
                dest = root / "docs" / page
                where = f"{name}:{i}: docs/{page}" + (f"#{anchor}" if anchor else "")
                if not dest.exists():
                    if f"docs/{page}" not in pending:
                        bad.append(f"{where}: no such page")
                elif anchor and anchor not in anchors(dest):
                    bad.append(f"{where}: no such heading")
    return bad


def test_every_docs_citation_in_the_code_names_an_existing_page_and_heading():
    assert broken_citations(ROOT, PENDING) == []


def test_every_relative_link_in_readme_and_docs_resolves():
    assert doc_files()[0].name == "README.md" and len(doc_files()) > 1
    assert broken_links(ROOT, PENDING) == []


def test_the_checker_reports_a_missing_file_a_bad_anchor_and_a_path_outside(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "See [a](docs/a.md#the-real-section), [gone](docs/gone.md), [web](https://x.org/y),\n"
        "`[not a link](nowhere.md)` and [up](../outside.md).\n")
    (tmp_path / "docs" / "a.md").write_text(
        "# A\n\n## The real section\n\n[bad anchor](#no-such-heading) [ok](#a) "
        "[self](a.md#the-real-section)\n\n```\n[in code](nowhere.md)\n```\n")
    bad = broken_links(tmp_path.resolve())
    assert len(bad) == 3, bad
    assert any("docs/gone.md does not exist" in b for b in bad)
    assert any("no heading with anchor #no-such-heading" in b for b in bad)
    assert any("points outside the repository" in b for b in bad)
    assert broken_links(tmp_path.resolve(), {"docs/gone.md"}) == [b for b in bad if "gone" not in b]


def test_anchor_rules_match_githubs():
    assert slug("The history: `.loss.json`") == "the-history-lossjson"
    assert slug("Policy: softmax, then the projection onto the box") == \
        "policy-softmax-then-the-projection-onto-the-box"
    assert slug("kill -9") == "kill--9"
    assert slug("Containers and PID 1") == "containers-and-pid-1"


_OUTSIDE_REF = re.compile(r"\bSPEC\b|\bBANDIT\.md\b|\.\./shared/|\b[Ii]ssue \d+\b|\bticket \d+\b")


def outside_references(root: Path = ROOT) -> list[str]:
    """`file:line: text` of every reference in the code to a design document outside the
    repository (SPEC, BANDIT.md, ../shared/) or to a ticket number: the code cites docs/, and
    README.md and docs/ stand on their own."""
    out = []
    files = [root / "README.md"] if (root / "README.md").is_file() else []
    for d in ("proxy", "worker", "shared", "scripts", "tests", "configs", "docs"):
        files += sorted((root / d).rglob("*"))
    for p in files:
        if p.suffix not in (".py", ".toml", ".sh", ".service", ".md") \
                or p.name == Path(__file__).name:
            continue
        for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if _OUTSIDE_REF.search(line):
                out.append(f"{p.relative_to(root)}:{i}: {line.strip()}")
    return out


def test_the_code_cites_docs_never_a_document_outside_or_a_ticket_number(tmp_path):
    assert outside_references() == []
    (tmp_path / "proxy").mkdir()
    bad = "# see " + "SPEC" + " section 4 (" + "issue" + " 3)"   # spelled apart: not a citation here
    (tmp_path / "proxy" / "x.py").write_text(bad + "\n")
    (tmp_path / "proxy" / "ok.py").write_text("# see docs/checkpoint-format.md#layout\n")
    assert outside_references(tmp_path) == [f"proxy/x.py:1: {bad}"]


def test_the_module_lists_of_the_proxys_layers_name_every_module_of_the_tree():
    """docs/architecture.md#the-proxys-layers lists each layer's modules; the list and the
    folder must hold the same names, so a module added or removed without the docs fails here."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## The proxy's layers", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `proxy/") and "/` " in r.split("|")[1] + " "]
    assert len(rows) == 4, rows
    for row in rows:
        folders_cell, modules_cell = row.split("|")[1:3]
        folders = re.findall(r"`(proxy/[a-z_]+)/`", folders_cell)
        listed = set(re.findall(r"`([a-z_]+)`", modules_cell))
        actual = {p.stem for f in folders for p in (ROOT / f).glob("*.py") if p.stem != "__init__"}
        assert listed == actual, (folders, "missing from the docs:", sorted(actual - listed),
                                  "not in the tree:", sorted(listed - actual))


def test_the_module_lists_of_shareds_subpackages_name_every_module_of_the_tree():
    """docs/architecture.md#what-shared-holds lists each subpackage's modules, the same check."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## What shared/ holds", 1)[1].split("\n## ", 1)[0]
    rows = [r for r in section.splitlines() if r.startswith("| `shared/")]
    folders = [re.fullmatch(r"`(shared(?:/[a-z_]+)?)/`", r.split("|")[1].strip()).group(1) for r in rows]
    on_disk = {"shared"} | {f"shared/{p.name}" for p in (ROOT / "shared").iterdir()
                            if (p / "__init__.py").exists()}
    assert set(folders) == on_disk, (folders, on_disk)
    for row, folder in zip(rows, folders):
        listed = set(re.findall(r"`([a-z_]+)`", row.split("|")[2]))
        actual = {p.stem for p in (ROOT / folder).glob("*.py") if p.stem != "__init__"}
        assert listed == actual, (folder, "missing from the docs:", sorted(actual - listed),
                                  "not in the tree:", sorted(listed - actual))


HISTORY_WORDS = re.compile(r"\bBefore,|\(before,|\bA breaker\b|\bbreaker session\b|\bwalk-through found\b"
                           r"|\bsession found\b|\bpreviously\b|\bused to (be|say|give|refuse)\b"
                           r"|\bnow has one\b|\bno longer (says|refuses|crashes)\b")


def test_test_docstrings_state_behaviour_not_history():
    """CONTRIBUTING.md#the-tests: a test's docstring says what it checks, not how the fault was
    found or what the code did before (the phrases in HISTORY_WORDS)."""
    import ast
    found = []
    for p in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)):
                doc = ast.get_docstring(node) or ""
                found += [f"{p.name}::{getattr(node, 'name', '<module>')}: {m.group(0)!r}"
                          for m in HISTORY_WORDS.finditer(doc)]
    assert not found, found
