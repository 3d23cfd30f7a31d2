"""scripts/setup.sh: the main job's lean environment (requirements/main.txt, installed with uv) and the
developer environment, each pin written once, the key of each environment covering what it is built
from, the developer environment reused by scripts/main.sh once it is complete, and Horovod's build
left for later (scripts/test.sh builds it beside the tests)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements"
SETUP = ROOT / "scripts" / "setup.sh"


def pins(path: Path) -> dict[str, str]:
    """``name → version`` of a requirements file's ``name==version`` lines."""
    found = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9_.-]+)==(\S+)", line)
        if match:
            found[match[1].lower().replace("_", "-")] = match[2]
    return found


def test_the_main_jobs_pins_are_exact_and_written_once() -> None:
    main = pins(REQUIREMENTS / "main.txt")
    lines = [line for line in (REQUIREMENTS / "main.txt").read_text().splitlines() if line and line[0] != "#"]
    assert len(main) == len(lines), f"every line of main.txt pins one version: {lines}"
    assert "-r main.txt" in (REQUIREMENTS / "dev.txt").read_text().splitlines()
    for other in sorted(REQUIREMENTS.glob("*.txt")):
        if other.name != "main.txt":
            twice = sorted(set(main) & set(pins(other)))
            assert not twice, f"{other.name} pins {twice} again: main.txt holds them (dev.txt includes it)"


def test_the_main_set_holds_the_packages_requirements_and_the_digits_data() -> None:
    listed = re.search(r"^dependencies = \[(.*?)^\]", (ROOT / "pyproject.toml").read_text(), re.M | re.S)
    assert listed, "pyproject.toml lists no dependencies"
    needed = {name.lower() for name in re.findall(r'^\s*"([A-Za-z0-9_.-]+)', listed[1], flags=re.MULTILINE)}
    assert "torch" in needed
    main = pins(REQUIREMENTS / "main.txt")
    assert needed | {"scikit-learn", "setuptools"} <= set(main), sorted(needed - set(main))


def test_every_requirements_file_is_in_the_developer_environments_key() -> None:
    listed = re.search(r'cat "\$root"/requirements/\{([a-z,]+)\}\.txt', SETUP.read_text())
    assert listed, "setup.sh's key no longer reads the requirements files"
    assert set(listed[1].split(",")) == {path.stem for path in REQUIREMENTS.glob("*.txt")}


def uv_sources(env: dict[str, str]) -> list[str]:
    function = re.search(r"^uv_sources\(\) \{.*?^\}$", SETUP.read_text(), flags=re.MULTILINE | re.DOTALL)
    assert function, "setup.sh has no uv_sources function"
    script = f'{function[0]}\nuv_sources "$1"'
    result = subprocess.run(["bash", "-c", script, "-", sys.executable], capture_output=True, text=True,
                            env=env, timeout=60, check=True)  # fmt: skip
    return result.stdout.split()


def pip_env(**settings: str) -> dict[str, str]:
    """This environment with no pip configuration file read and ``settings`` as pip's variables."""
    env = {name: value for name, value in os.environ.items() if not name.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, **settings}


def test_uv_is_handed_no_index_where_pip_has_none_configured() -> None:
    assert uv_sources(pip_env()) == []  # PyPI, as for pip


def test_uv_is_handed_the_indexes_find_links_and_constraints_pip_is_configured_with(tmp_path: Path) -> None:
    wheels, index, constraints = tmp_path / "wheels", tmp_path / "simple", tmp_path / "constraints.txt"
    wheels.mkdir()
    index.mkdir()
    constraints.write_text("torch<=2.14.1\n")
    env = pip_env(
        PIP_FIND_LINKS=f"{wheels} {tmp_path / 'absent'}",  # a local store this machine lacks is left out
        PIP_EXTRA_INDEX_URL=f"file://{index} https://mirror.example/simple",
        PIP_CONSTRAINT=str(constraints),
    )
    flags = uv_sources(env)
    assert sorted(zip(flags[::2], flags[1::2], strict=True)) == [
        ("--constraint", str(constraints)),
        ("--extra-index-url", f"file://{index}"),
        ("--extra-index-url", "https://mirror.example/simple"),
        ("--find-links", str(wheels)),
        ("--index-strategy", "unsafe-best-match"),  # pip's choice: the best version from every index
    ]
    assert flags.index(f"file://{index}") < flags.index("https://mirror.example/simple")  # pip's order


def checkout(tmp_path: Path) -> Path:
    """The files setup.sh reads, in a checkout of their own (its ./.venv link is made there)."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    shutil.copytree(REQUIREMENTS, root / "requirements")
    for script in ("setup.sh", "build-horovod.sh", "deepspeed-ops.sh"):
        shutil.copy(ROOT / "scripts" / script, root / "scripts" / script)
    return root


def environment(cache: Path, name: str) -> Path:
    """A complete environment whose python does nothing (the checkout's install is not under test)."""
    venv = cache / name
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".complete").touch()
    return venv


def key(root: Path, *files: str) -> str:
    version = subprocess.run([sys.executable, "-c", "import sys; print(sys.version)"], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
    data = b"".join((root / file).read_bytes() for file in files) + version.encode()
    return hashlib.sha256(data).hexdigest()[:16]


def setup_main(root: Path, cache: Path) -> Path:
    env = {**os.environ, "SPIKINGSAIL_CACHE": str(cache), "PYTHON": sys.executable}
    subprocess.run(["bash", str(root / "scripts" / "setup.sh"), "--main"], env=env, capture_output=True,
                   text=True, timeout=60, check=True)  # fmt: skip
    return (root / ".venv").resolve()


def test_the_main_job_runs_in_a_complete_developer_environment_and_else_in_its_own(tmp_path: Path) -> None:
    root, cache = checkout(tmp_path), tmp_path / "cache"
    lean = environment(cache, f"venv-main-{key(root, 'requirements/main.txt')}")
    assert setup_main(root, cache) == lean
    files = [f"requirements/{name}.txt" for name in ("main", "dev", "nodeps", "sdist", "backends")]
    developer = environment(cache, f"venv-{key(root, *files, 'scripts/build-horovod.sh')}")
    assert setup_main(root, cache) == developer  # no second install once test.sh's environment exists
    (developer / ".complete").unlink()  # a developer environment cut short is not used
    assert setup_main(root, cache) == lean


# A python that records how it is called and answers build-horovod.sh's question about torch: a CPU
# build (no CUDA version), "TORCH" for the cache key's torch part, no GPU architectures.
RECORDING_PYTHON = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls"
case "$*" in *torch.version.cuda*) printf '\\nTORCH\\n\\n' ;; esac
exit 0
"""


def test_horovod_not_built_yet_is_left_for_later_and_installed_by_setup_horovod(tmp_path: Path) -> None:
    root, cache = checkout(tmp_path), tmp_path / "cache"
    files = [f"requirements/{name}.txt" for name in ("main", "dev", "nodeps", "sdist", "backends")]
    venv = environment(cache, f"venv-{key(root, *files, 'scripts/build-horovod.sh')}")
    (venv / "bin" / "python").write_text(RECORDING_PYTHON)
    env = {**os.environ, "SPIKINGSAIL_CACHE": str(cache), "PYTHON": sys.executable}

    def setup(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
        if venv.exists():
            (venv / "calls").write_text("")
        return subprocess.run(["bash", str(root / "scripts" / "setup.sh"), *args], env={**env, **extra},
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip

    later = setup("--backends", SAIL_HOROVOD_LATER="1")
    assert later.returncode == 0, later.stderr
    assert "scripts/setup.sh --horovod builds and installs it" in later.stdout
    assert not (venv / ".backends-complete").exists()  # the environment is not complete without it
    calls = (venv / "calls").read_text()
    assert "pip install --quiet -r" in calls and ".whl" not in calls  # the backends' pins, no wheel

    wheel = (
        cache
        / "wheels"
        / "horovod-0.28.1-TORCH-release-gloo-mpi"
        / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    )
    wheel.parent.mkdir(parents=True)
    wheel.write_text("")  # what build-horovod.sh leaves in the cache once it has built
    done = setup("--horovod")
    assert done.returncode == 0, done.stderr
    assert f"-m pip install --quiet --no-deps {wheel}" in (venv / "calls").read_text()
    assert (venv / ".backends-complete").exists()

    (venv / ".backends-complete").unlink()  # with the wheel built, nothing is left for later
    at_once = setup("--backends", SAIL_HOROVOD_LATER="1")
    assert at_once.returncode == 0, at_once.stderr
    assert f"--no-deps {wheel}" in (venv / "calls").read_text() and (venv / ".backends-complete").exists()

    shutil.rmtree(venv)
    missing = setup("--horovod")
    assert missing.returncode == 1 and "run scripts/setup.sh --backends" in missing.stderr


def test_the_backends_wait_for_debians_packages_installed_meanwhile_and_stop_if_they_failed(
    tmp_path: Path,
) -> None:
    root, cache, deps = checkout(tmp_path), tmp_path / "cache", tmp_path / "deps"
    files = [f"requirements/{name}.txt" for name in ("main", "dev", "nodeps", "sdist", "backends")]
    venv = environment(cache, f"venv-{key(root, *files, 'scripts/build-horovod.sh')}")
    (venv / "bin" / "python").write_text(RECORDING_PYTHON)
    deps.mkdir()
    env = {**os.environ, "SPIKINGSAIL_CACHE": str(cache), "PYTHON": sys.executable, "SAIL_SYSTEM_DEPS": str(deps),
           "SAIL_HOROVOD_LATER": "1"}  # fmt: skip
    setup = subprocess.Popen(["bash", str(root / "scripts" / "setup.sh"), "--backends"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(1)
    assert setup.poll() is None and not (venv / "calls").exists()  # nothing of the backends yet
    (deps / "log").write_text("E: Unable to locate package pdsh\n")
    (deps / "status").write_text("100")
    out, err = setup.communicate(timeout=60)
    assert setup.returncode == 1, out + err
    assert "Debian's packages failed to install" in err and "Unable to locate package pdsh" in err
    assert not (venv / "calls").exists()

    (deps / "status").write_text("0")
    done = subprocess.run(["bash", str(root / "scripts" / "setup.sh"), "--backends"], env=env,
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "pip install --quiet -r" in (venv / "calls").read_text()


def wrapper(path: Path, version_info: str | None = None) -> Path:
    """A python that records its arguments and runs this test's interpreter; ``version_info`` is what it
    answers to the question about its version's X.Y instead, as a Python of another X.Y would."""
    path.parent.mkdir(parents=True, exist_ok=True)
    answer = f'case "$*" in *version_info*) echo "{version_info}"; exit 0 ;; esac\n' if version_info else ""
    path.write_text(f'#!/bin/sh\necho "$*" >> "{path}.calls"\n{answer}exec "{sys.executable}" "$@"\n')
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("case", ["same-x.y", "python-set", "other-x.y", "is-python3"])
def test_the_distributions_python_builds_the_environment_where_it_is_python3s_x_y(
    tmp_path: Path, case: str
) -> None:
    """A distribution's CPython is built with PGO and LTO, pyenv's is not: setup.sh takes /usr/bin/python3
    (here SAIL_DISTRIBUTION_PYTHON) when it is the X.Y of python3 on PATH, unless PYTHON chooses."""
    root, cache = checkout(tmp_path), tmp_path / "cache"
    files = [f"requirements/{name}.txt" for name in ("main", "dev", "nodeps", "sdist", "backends")]
    environment(cache, f"venv-{key(root, *files, 'scripts/build-horovod.sh')}")
    on_path = wrapper(tmp_path / "bin" / "python3", "(3, 99)" if case == "other-x.y" else None)
    distribution = on_path if case == "is-python3" else wrapper(tmp_path / "usr" / "bin" / "python3")
    env = {**os.environ, "SPIKINGSAIL_CACHE": str(cache), "PATH": f"{on_path.parent}:{os.environ['PATH']}",
           "SAIL_DISTRIBUTION_PYTHON": str(distribution)}  # fmt: skip
    env.pop("PYTHON", None)
    if case == "python-set":
        env["PYTHON"] = str(on_path)
    subprocess.run(["bash", str(root / "scripts" / "setup.sh"), "--main"], env=env, capture_output=True,
                   text=True, timeout=60, check=True)  # fmt: skip
    calls = Path(f"{distribution}.calls").read_text() if Path(f"{distribution}.calls").exists() else ""
    reads_version = "-c import sys; print(sys.version)\n"
    if case == "same-x.y":
        assert reads_version in calls  # the environment's interpreter: its version is in the key
        assert re.search(r"^- \(3, \d+\)$", calls, re.MULTILINE)  # after the check of X.Y and headers
        assert reads_version not in Path(f"{on_path}.calls").read_text()
    elif case == "is-python3":
        assert calls.count(reads_version) == 1 and not re.search(r"^- ", calls, re.MULTILINE)  # no check
    else:
        assert reads_version not in calls
        assert reads_version in Path(f"{on_path}.calls").read_text()
        assert (case == "other-x.y") == bool(re.search(r"^- \(3, 99\)$", calls, re.MULTILINE))
