"""The ```python blocks of README.md and docs/*.md, and the runner that executes them (also a script).

A block preceded by the line ``<!-- doctest: processes -->`` needs several processes: it is left out of
the single-process run and run by ``test_docs.py`` as a script on 2 ranks (torchrun), after the file's
earlier such blocks, in one folder. Run as ``python doc_blocks.py BLOCKS.json``, this module executes
the given blocks in order in one namespace and names the file and line of the block that failed.
"""

from __future__ import annotations

import json
import re
import sys
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

PROCESSES_MARKER = "<!-- doctest: processes -->"
_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced ```python block: where it starts (1-based line of its first code line) and its code."""

    path: str
    line: int
    code: str
    processes: bool


def python_blocks(path: Path) -> list[Block]:
    """Every ```python block of a Markdown file, in order."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, lang = match.groups()
        end = i + 1
        while end < len(lines) and not re.match(rf"^{re.escape(indent)}```\s*$", lines[end]):
            end += 1
        if lang == "python":
            previous = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            code = "\n".join(line[len(indent) :] for line in lines[i + 1 : end]) + "\n"
            blocks.append(Block(str(path), i + 2, code, previous == PROCESSES_MARKER))
        i = end + 1
    return blocks


def run_blocks(blocks: list[dict]) -> int:
    """Execute the blocks in order in one namespace; on failure print where and return 1."""
    namespace: dict = {"__name__": "__main__"}
    for block in blocks:
        label = f"{block['path']}:{block['line']}"
        try:
            exec(compile(block["code"], label, "exec"), namespace)  # our own documentation
        except BaseException:
            traceback.print_exc()
            print(f"DOC BLOCK FAILED: {label}", file=sys.stderr)
            return 1
        print(f"ok {label}", flush=True)
    return 0


def write_blocks(blocks: list[Block], target: Path) -> Path:
    target.write_text(json.dumps([asdict(b) for b in blocks]))
    return target


if __name__ == "__main__":
    sys.exit(run_blocks(json.loads(Path(sys.argv[1]).read_text())))
