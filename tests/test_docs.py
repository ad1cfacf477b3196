"""The documentation: the MkDocs site builds without a warning, and the README stays a short,
working entry point."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README_MAX_BYTES = 12_000
# [text](target) links and images; the target ends at whitespace or the closing parenthesis.
MARKDOWN_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def test_mkdocs_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def relative_links(markdown: str) -> list[str]:
    """The relative link targets of a Markdown text (outside code blocks), without their anchors."""
    targets = MARKDOWN_LINK.findall(FENCE.sub("", markdown))
    relative = [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]
    return [t.split("#", 1)[0] for t in relative]


def test_relative_links_are_found() -> None:
    text = "See [the docs](docs/index.md#top), ![a](img/a.png) and [web](https://example.org)."
    assert relative_links(text + "\n```\n[not](a-link.md)\n```\n") == ["docs/index.md", "img/a.png"]


def test_readme_is_short_and_links_only_to_files_that_exist() -> None:
    readme = REPO / "README.md"
    size = len(readme.read_bytes())
    assert size < README_MAX_BYTES, (
        f"README.md is {size} bytes; move detail into docs/ (< {README_MAX_BYTES})"
    )
    links = relative_links(readme.read_text())
    assert links, "README.md links to no documentation page"
    missing = [link for link in links if not (REPO / link).exists()]
    assert not missing, f"README.md links to missing files: {missing}"
    assert "make test" in readme.read_text(), "README.md must name the test command `.ci/run` runs"
