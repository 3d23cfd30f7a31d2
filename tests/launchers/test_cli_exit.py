"""The ``sail`` command ends without the interpreter's teardown of its modules, and loses nothing by it:
its exit status, its output to a pipe, what its threads and atexit handlers do. It imports a
command's modules with the garbage collector off and then freezes them."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from spikingsail import __version__

SAIL = textwrap.dedent("""
    import atexit, sys, threading, time
    from pathlib import Path
    out = Path(sys.argv[1])
    def late():  # a thread still running when main() returns: the exit waits for it
        time.sleep(0.5)
        (out / "thread").write_text("done")
    threading.Thread(target=late).start()
    atexit.register(lambda: (out / "atexit").write_text("ran"))
    print("buffered before the exit", end="")  # no newline: still in stdout's buffer
    sys.argv = ["sail", *sys.argv[2:]]
    from spikingsail.cli.main import entry
    entry()
""")


@pytest.mark.parametrize(("argv", "status", "said"), [
    (["--version"], 0, f"sail {__version__}\n"),
    (["nonsense"], 2, ""),
    (["launch", "--master-port", "99999", "x.py"], 2, ""),
])  # fmt: skip
def test_the_exit_keeps_the_status_the_output_the_threads_and_the_atexit_handlers(
    tmp_path: Path, argv: list[str], status: int, said: str
) -> None:
    run = subprocess.run(
        [sys.executable, "-c", SAIL, str(tmp_path), *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == status, run.stderr
    assert run.stdout == "buffered before the exit" + said
    assert (tmp_path / "thread").read_text() == "done"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert "Traceback" not in run.stderr


def test_the_console_script_takes_the_same_exit() -> None:
    script = Path(sys.executable).with_name("sail")  # the environment's, as pip wrote it from pyproject.toml
    assert "from spikingsail.cli.main import entry" in script.read_text()
    run = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60, check=False)
    assert (run.returncode, run.stdout) == (0, f"sail {__version__}\n")


@pytest.mark.parametrize("enabled", [True, False])
def test_a_commands_modules_are_imported_with_the_collector_off_and_then_frozen(enabled: bool) -> None:
    """``sail COMMAND`` imports the command's module (torch, for ``launch``) with no garbage
    collection, then freezes what it built; the collector is left as it was found."""
    probe = textwrap.dedent(f"""
        import gc, sys
        from spikingsail.cli import main
        if not {enabled}:
            gc.disable()
        seen = []
        gc.callbacks.append(lambda phase, info: seen.append(phase))
        main._import_quietly("spikingsail.cli.launch")
        assert "torch" in sys.modules
        print(len(seen), gc.isenabled(), gc.get_freeze_count() > 100_000)
    """)
    run = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["0", str(enabled), "True"]
