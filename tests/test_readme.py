"""The README's examples run as written, and its relative links resolve.

Every ```python block runs in a fresh process on the CPU, without a network, except a block
whose first line is `# needs: <reason>` (several processes, a GPU, a model download)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", ROOT / "benches" / "README.md", ROOT / "kernels" / "README.md",
             ROOT / "tests" / "README.md"]  # fmt: skip
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def python_blocks() -> list[tuple[int, str]]:
    text = (ROOT / "README.md").read_text()
    return [(text[: match.start()].count("\n") + 1, match.group(1))
            for match in BLOCK.finditer(text)]  # fmt: skip


BLOCKS = python_blocks()


def test_readme_has_runnable_examples():
    runnable = [code for _, code in BLOCKS if not code.startswith("# needs:")]
    assert len(runnable) >= 5, "the guides' examples are gone"


@pytest.mark.parametrize("line, code", BLOCKS, ids=[f"line {line}" for line, _ in BLOCKS])
def test_readme_block_runs(line, code, tmp_path):
    if code.startswith("# needs:"):
        pytest.skip(code.splitlines()[0][2:])
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=environment, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"README block at line {line} failed:\n{result.stderr[-3000:]}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda path: str(path.relative_to(ROOT)))
def test_relative_links_resolve(document):
    assert document.exists(), f"{document.relative_to(ROOT)} is missing"
    for target in LINK.findall(document.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (document.parent / target).exists(), f"{document.name} links to missing {target}"
