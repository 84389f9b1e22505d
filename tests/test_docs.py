"""Every ```python block of README.md and docs/**/*.md runs, one test per block (id: file:line).

Blocks are written at CPU sizes so that they run here as they read; blocks in
other fence languages (bash, text, plain) are not run. The blocks of one file
share a namespace and run in order, as a reader would run them: a block may
use what an earlier block of its page defined. A block selected alone first
runs the earlier blocks of its file. Each file runs in its own temporary
working directory.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^```(\S*)\s*$")

# Files whose blocks are not yet runnable, with the owner who will make them so. Their blocks
# still run; a failure there is an expected failure (not strict) until the owner lands the fix.
PENDING: dict[str, str] = {}


def _blocks(path: Path) -> list[tuple[int, str]]:
    """(first line of the code, code) of every ```python block of a markdown file."""
    out, lang, start, body = [], None, 0, []
    for n, line in enumerate(path.read_text().splitlines(), start=1):
        m = FENCE.match(line.strip())
        if lang is None:
            if m:
                lang, start, body = m.group(1).lower(), n + 1, []
        elif line.strip() == "```":
            if lang == "python":
                out.append((start, "\n".join(body)))
            lang = None
        else:
            body.append(line)
    if lang is not None:
        raise AssertionError(f"{path}: a ``` block opened at line {start - 1} is never closed")
    return out


def _cases():
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").rglob("*.md"))
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        marks = [pytest.mark.xfail(reason=PENDING[rel], strict=False)] if rel in PENDING else []
        for line, code in _blocks(path):
            yield pytest.param(rel, line, code, id=f"{rel}:{line}", marks=marks)


CASES = list(_cases())


def test_blocks_are_found(tmp_path):
    assert any(c.values[0] == "README.md" for c in CASES), "README.md has no python block"
    md = tmp_path / "x.md"
    md.write_text("a\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n")
    assert _blocks(md) == [(3, "x = 1"), (9, "y = 2\nz = 3")]


# per file: (namespace, working directory, lines of the blocks run in it so far)
_PAGES: dict[str, tuple[dict, Path, list[int]]] = {}


def _run(rel: str, line: int, code: str, namespace: dict) -> None:
    # padded so that line numbers in a traceback point into the markdown file
    exec(compile("\n" * (line - 1) + code, str(ROOT / rel), "exec"), namespace)


@pytest.mark.parametrize("rel, line, code", CASES)
def test_doc_block_runs(rel, line, code, tmp_path_factory, monkeypatch):
    if rel not in _PAGES:
        _PAGES[rel] = ({"__name__": "doc_page"}, tmp_path_factory.mktemp("doc"), [])
    namespace, cwd, done = _PAGES[rel]
    monkeypatch.chdir(cwd)
    for earlier, earlier_code in _blocks(ROOT / rel):
        if earlier < line and earlier not in done:
            done.append(earlier)
            _run(rel, earlier, earlier_code, namespace)
    done.append(line)
    _run(rel, line, code, namespace)


LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


@pytest.mark.parametrize("rel", [c.as_posix() for c in [Path("README.md")] + sorted(
    p.relative_to(ROOT) for p in (ROOT / "docs").rglob("*.md"))] + ["CHANGELOG.md"])
def test_relative_links_resolve(rel):
    path = ROOT / rel
    missing = [target for target, _ in LINK.findall(path.read_text())
               if "://" not in target and not (path.parent / target).exists()]
    assert not missing, f"{rel} links to missing files: {missing}"
