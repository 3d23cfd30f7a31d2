"""Every code block of README.md and docs/ is run here, or says on the line before it why not."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from spikingsail.backends import load_config
from spikingsail.config.parse import BATCH_KEYS
from spikingsail.errors import ConfigError
from tests.docs.snippets import LANGUAGES, ROOT, RUNNABLE, Block, all_blocks, blocks
from tests.ninja import NINJA_DIR

BLOCKS = all_blocks()
TO_RUN = [b for b in BLOCKS if b.language in RUNNABLE and b.not_run is None and b.file is None]
FILES = [b for b in BLOCKS if b.file is not None]
_WORLD_SIZES = (1, 2, 4, 8)


def _id(block: Block) -> str:
    return block.id


def test_every_block_is_run_or_says_why() -> None:
    problems = []
    for block in BLOCKS:
        if block.language not in LANGUAGES:
            problems.append(f"{block.id}: language {block.language!r}; use one of {', '.join(LANGUAGES)}")
        elif block.not_run is not None and len(block.not_run) < 15:
            problems.append(f"{block.id}: 'not run' needs a reason a reader can act on: {block.not_run!r}")
    for block in FILES:
        later = [b for b in TO_RUN if b.path == block.path and b.line > block.line]
        if not any(block.file in b.code for b in later):
            problems.append(f"{block.id}: file {block.file} is used by no later block of its page that runs")
    for block in BLOCKS:
        same = re.match(r"the same as ([\w./-]*\w)", block.not_run or "")
        if same and not any(b.code == block.code for b in blocks(ROOT / same.group(1)) if b.not_run is None):
            problems.append(f"{block.id}: not the same as any block of {same.group(1)} that runs")
    assert not problems, "\n".join(problems)
    ran = {b.language for b in TO_RUN + FILES}
    assert ran >= set(RUNNABLE), f"no block of {set(RUNNABLE) - ran} is run"


def test_the_collector_sees_markers_and_unclosed_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```bash\nsail launch -n 2 a.py\n```\n\n<!-- not run: needs two GPU nodes -->\n"
        "```python\nimport torch\n```\n\n  ```json\n  {}\n  ```\n<!-- file: hostfile -->\n```text\nnode1\n```\n"
    )
    found = blocks(page)
    assert [(b.line, b.language, b.not_run, b.file) for b in found] == [
        (3, "bash", None, None),
        (8, "python", "needs two GPU nodes", None),
        (12, "json", None, None),
        (16, "text", None, "hostfile"),
    ]
    assert found[2].code == "{}\n"
    page.write_text("```bash\nls\n")
    with pytest.raises(ValueError, match="never closed"):
        blocks(page)


def load_json_block(code: str) -> Any:
    """A config block through the real parser: a fragment (``"sail": {...}``) is read as the object
    holding it, a block without batch keys gets a micro-batch of 1, and the block must load at one of
    a few world sizes (its batch keys may imply one)."""
    text = code.strip()
    raw = json.loads(text if text.startswith("{") else "{" + text + "}")
    if not any(key in raw for key in BATCH_KEYS):
        raw["train_micro_batch_size_per_gpu"] = 1
    errors: list[ConfigError] = []
    for world_size in _WORLD_SIZES:
        try:
            return load_config(raw, world_size)
        except ConfigError as err:
            errors.append(err)
    raise errors[0]


def test_a_wrong_config_block_fails() -> None:
    with pytest.raises(ConfigError, match="hang_timeout_second"):
        load_json_block('"sail": {"hang_timeout_second": 30}')
    assert load_json_block('"sail": {"hang_timeout_seconds": 30}').sail.hang_timeout_seconds == 30


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "json" and b.not_run is None], ids=_id)
def test_config_block_loads(block: Block) -> None:
    load_json_block(block.code)


@pytest.fixture(scope="module")
def workdirs(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, Path]:
    """One working directory per page, shared by its blocks in order, with the repository's examples,
    benchmarks and scripts where the pages say they are."""
    return {}


def _workdir(workdirs: dict[Path, Path], page: Path, factory: pytest.TempPathFactory) -> Path:
    if page not in workdirs:
        workdir = factory.mktemp(page.stem)
        for name in ("examples", "benchmarks", "scripts"):
            (workdir / name).symlink_to(ROOT / name)
        workdirs[page] = workdir
    return workdirs[page]


def _environment() -> dict[str, str]:
    env = dict(os.environ)
    # the environment's commands (sail, torchrun), after the one ninja the suite's processes use
    env["PATH"] = os.pathsep.join([NINJA_DIR, str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return env


@pytest.mark.multiprocess
@pytest.mark.parametrize("block", [b for b in TO_RUN if b.language != "json"], ids=_id)
def test_code_block_runs(
    block: Block, workdirs: dict[Path, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    workdir = _workdir(workdirs, block.path, tmp_path_factory)
    for earlier in FILES:
        if earlier.path == block.path and earlier.line < block.line:
            (workdir / str(earlier.file)).write_text(earlier.code)
    script = workdir / f"block_{block.line}.{'py' if block.language == 'python' else 'sh'}"
    script.write_text(block.code)
    command = (
        [sys.executable, script.name]
        if block.language == "python"
        else ["bash", "-eu", "-o", "pipefail", script.name]
    )
    done = subprocess.run(
        command, cwd=workdir, env=_environment(), capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, (
        f"{block.id} exited with {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n--- stderr\n{done.stderr[-4000:]}"
    )
