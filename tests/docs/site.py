"""The documentation site's generator (docs/_hooks/reference.py, an MkDocs hook) loaded as a module,
and a build of the site, for the tests."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.docs.snippets import ROOT

HOOK = ROOT / "docs" / "_hooks" / "reference.py"


def reference() -> ModuleType:
    name = "spikingsail_docs_reference"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, HOOK)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    module = sys.modules[name]
    module._importable()
    return module


def build(site_dir: Path, *, offline: bool = False) -> subprocess.CompletedProcess[str]:
    """``mkdocs build --strict`` into ``site_dir``; with ``offline``, in a network namespace of its own
    (no interface but loopback), so that any download it tried would fail the build."""
    command = [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "--site-dir", str(site_dir)]
    if offline:
        command = ["unshare", "--net", "--map-root-user", "--", *command]
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
