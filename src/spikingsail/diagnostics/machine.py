"""One machine's facts (from ``probe.py``) → findings, each with a status and a one-line fix."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spikingsail.cuda_arch_list import readable_setting, unreadable_cuda_archs
from spikingsail.diagnostics.findings import Finding, Report, fail, ok, warn

Facts = dict[str, Any]
MiB = 1 << 20
GiB = 1 << 30
SHM_FAIL_BELOW = 256 * MiB  # docker's default 64 MiB is what makes DataLoader workers die with "Bus error"
SHM_WARN_PER_PROCESS = GiB
NOFILE_WARN_BELOW = 4096
_CUDA_LIBRARY = re.compile(r"undefined symbol|not defined in file|version `[^']+' not found|lib(cu\w+|nccl)")


def machine_findings(facts: Facts, report: Report, host: str = "", nproc: int = 1) -> list[Finding]:
    """Every check about one machine; ``nproc`` is how many training processes it will run."""
    checks: list[Callable[[Facts, str], list[Finding]]] = [
        _python, _torch, _gpus, _visible_devices, _extensions, _backends, _network, ssh_permissions,
    ]  # fmt: skip
    found = [f for check in checks for f in check(facts, host)]
    found += [_shm(facts, host, nproc), *_limits(facts, host)]
    label = f" ({host})" if host else ""
    ds = facts.get("deepspeed") or {}
    if ds.get("ops"):
        rows = [[op["name"], _yes(op["installed"]), _yes(op["compatible"])] for op in ds["ops"]]
        report.tables[f"DeepSpeed ops{label}, accelerator {ds['accelerator']}"] = [
            ["op name", "installed", "compatible"], *rows,
        ]  # fmt: skip
    return found


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _python(facts: Facts, host: str) -> list[Finding]:
    py = facts["python"]
    return [ok("python", f"Python {py['version']} ({py['executable']})", host)]


def _torch(facts: Facts, host: str) -> list[Finding]:
    torch = facts["torch"]
    if torch.get("error"):
        return [_torch_import_failure(torch["error"], facts, host)]
    parts = [f"torch {torch['version']}"]
    if torch.get("hip"):
        parts.append(f"ROCm {torch['hip']}")
    elif torch.get("cuda"):
        parts += [f"CUDA {torch['cuda']}", f"cuDNN {torch.get('cudnn')}", f"NCCL {torch.get('nccl')}"]
    else:
        parts.append("CPU build")
    return [ok("torch", ", ".join(parts) + f" ({torch['path']})", host)]


def _torch_import_failure(error: str, facts: Facts, host: str) -> Finding:
    python = facts["python"]["executable"]
    if "No module named 'torch'" in error:
        return fail("torch", f"torch is not installed for {python}", f"{python} -m pip install torch", host)
    preload = facts["env"].get("LD_PRELOAD")
    if preload and "undefined symbol" in error:
        return fail(
            "torch",
            f"torch does not import: {error[-300:]} — LD_PRELOAD={preload} loads a library ahead of torch's own",
            "unset LD_PRELOAD (or preload only libraries built for this torch)",
            host,
        )
    if _CUDA_LIBRARY.search(error):
        paths = facts["env"].get("LD_LIBRARY_PATH") or "(LD_LIBRARY_PATH is not set)"
        return fail(
            "torch",
            f"torch does not import: {error[-300:]} — another CUDA's libraries are found before torch's own;"
            f" LD_LIBRARY_PATH={paths}",
            "unset LD_LIBRARY_PATH, or put the CUDA torch was built for first "
            "(export LD_LIBRARY_PATH=/usr/local/cuda-X.Y/lib64:$LD_LIBRARY_PATH)",
            host,
        )
    return fail("torch", f"torch does not import: {error[-300:]}", "reinstall torch for this Python", host)


def _gpus(facts: Facts, host: str) -> list[Finding]:
    torch, driver = facts["torch"], facts["driver"]
    nvidia = driver.get("gpus") or (1 if driver.get("cuda") else 0)
    if torch.get("error"):
        return []
    if torch.get("gpus"):
        listed = "; ".join(
            f"{g['index']}: {g['name']}, {g['memory'] / GiB:.0f} GiB, compute {g['capability']}, "
            f"bf16 {_yes(g['bf16'])}"
            for g in torch["gpus"]
        )
        return [ok("gpus", f"driver {driver.get('version')} (CUDA {driver.get('cuda')}); {listed}", host)]
    if not torch.get("cuda") and not torch.get("hip"):
        if nvidia:
            return [fail("gpus", f"torch {torch['version']} is a CPU build, but this machine has NVIDIA GPUs "
                         f"(driver {driver.get('version') or driver.get('cuda')})",
                         "install a CUDA build of torch that the driver supports "
                         "(pip install torch --index-url https://download.pytorch.org/whl/cuXYZ)", host)]  # fmt: skip
        return [ok("gpus", "no GPU: processes train on CPU with gloo", host)]
    return [_cuda_unavailable(torch, driver, host)]


def _cuda_unavailable(torch: Facts, driver: Facts, host: str) -> Finding:
    if not driver.get("cuda") and not driver.get("version"):
        if driver.get("pci_gpus") == 0:  # nothing on the PCI bus either: a machine without GPUs
            return ok("gpus", f"no GPU on this machine: torch (a CUDA {torch['cuda']} build) trains on the CPU "
                      "with gloo", host)  # fmt: skip
        seen = f" ({driver['pci_gpus']} NVIDIA GPU(s) on the PCI bus)" if driver.get("pci_gpus") else ""
        return fail("gpus", f"torch is built for CUDA {torch['cuda']} but no NVIDIA driver is visible{seen}",
                    "in a container: start it with --gpus all (nvidia-container-toolkit); on the host: "
                    "install the driver (nvidia-smi must work)", host)  # fmt: skip
    if driver.get("cuda") and _version(driver["cuda"]) < _version(torch["cuda"]):
        return fail("gpus", f"the driver supports CUDA up to {driver['cuda']}, torch needs {torch['cuda']}",
                    f"upgrade the driver, or install a torch built for CUDA ≤ {driver['cuda']}", host)  # fmt: skip
    return fail("gpus", f"the driver is present (CUDA {driver.get('cuda')}) but torch sees no GPU",
                "check CUDA_VISIBLE_DEVICES and that the container was started with --gpus all", host)  # fmt: skip


def _visible_devices(facts: Facts, host: str) -> list[Finding]:
    value = facts["env"].get("CUDA_VISIBLE_DEVICES")
    nvidia = facts["driver"].get("gpus") or 0
    if value is None:
        return [ok("CUDA_VISIBLE_DEVICES", "not set: every GPU is visible", host)] if nvidia else []
    if nvidia and not value.strip():
        return [fail("CUDA_VISIBLE_DEVICES", "is empty: it hides every GPU",
                     "unset CUDA_VISIBLE_DEVICES, or list the GPUs to use (e.g. 0,1)", host)]  # fmt: skip
    bad = [d for d in value.split(",") if d.strip().isdigit() and int(d) >= nvidia] if nvidia else []
    if bad:
        return [warn("CUDA_VISIBLE_DEVICES", f"={value} names GPU(s) {','.join(bad)}, but there are {nvidia}",
                     f"use indices 0 to {nvidia - 1}", host)]  # fmt: skip
    return [ok("CUDA_VISIBLE_DEVICES", f"={value!r}", host)]


def _shm(facts: Facts, host: str, nproc: int) -> Finding:
    shm = facts["shm"]
    if shm.get("error"):
        return warn("/dev/shm", f"cannot be read: {shm['error']}", "mount a tmpfs at /dev/shm", host)
    size = shm["total"]
    why = "DataLoader workers hand batches over in shared memory (and NCCL uses it within a node)"
    fix = (
        "docker run --ipc=host (or --shm-size=16g); on Kubernetes an emptyDir with medium: Memory at /dev/shm"
    )
    if size < SHM_FAIL_BELOW:
        return fail("/dev/shm", f"is {_size(size)}: {why}; workers die with 'Bus error'", fix, host)
    if size < SHM_WARN_PER_PROCESS * nproc:
        return warn("/dev/shm", f"is {_size(size)} for {nproc} process(es): {why}", fix, host)
    return ok("/dev/shm", f"{_size(size)} ({_size(shm['free'])} free)", host)


def _limits(facts: Facts, host: str) -> list[Finding]:
    soft, hard = facts["limits"]["nofile"]
    out = []
    if 0 <= soft < NOFILE_WARN_BELOW:
        out.append(warn("open files", f"ulimit -n is {soft}: DataLoader workers share tensors through file "
                        "descriptors and run out ('Too many open files')",
                        f"ulimit -n {hard if hard < 0 or hard >= 65536 else 65536} (docker: --ulimit "
                        "nofile=65536)", host))  # fmt: skip
    else:
        out.append(ok("open files", f"ulimit -n {'unlimited' if soft < 0 else soft}", host))
    memlock = facts["limits"]["memlock"][0]
    rdma = any(i["name"].startswith(("ib", "mlx")) for i in facts["network"]["interfaces"])
    if memlock >= 0 and (rdma or facts["torch"].get("gpus")):
        out.append(warn("locked memory", f"ulimit -l is {_size(memlock)}: NCCL over InfiniBand/RDMA "
                        "pins memory and fails or falls back to TCP",
                        "ulimit -l unlimited (docker: --ulimit memlock=-1)", host))  # fmt: skip
    else:
        shown = "unlimited" if memlock < 0 else f"{_size(memlock)} (matters only for RDMA)"
        out.append(ok("locked memory", f"ulimit -l {shown}", host))
    return out


def _extensions(facts: Facts, host: str) -> list[Finding]:
    ext, torch = facts["extensions"], facts["torch"]
    include = str(Path(torch["path"]) / "include") if torch.get("path") else None
    out = []
    for entry in ext["entries"]:
        judged = _stale(entry, torch, include)
        if judged:
            status, problem = judged
            out.append(status("torch extensions", f"{entry['path']}: {problem}",
                              f"rm -rf {entry['path']} (rebuilt on next use)", host))  # fmt: skip
    if not out:
        names = ", ".join(e["name"] for e in ext["entries"]) or "empty"
        out.append(ok("torch extensions", f"{ext['root']}: {names}", host))
    return out


def _stale(entry: Facts, torch: Facts, include: str | None) -> tuple[Callable[..., Finding], str] | None:
    """Whether a cached build is stale: broken for this torch (fail), or unused or suspect (warn)."""
    if entry["tag"] is not None and entry["tag"] != torch.get("ext_tag"):
        return (
            warn,
            f"built for {entry['tag']}, not for this Python and torch ({torch.get('ext_tag')}): never used here",
        )
    if entry["load_errors"]:
        error = next(iter(entry["load_errors"].values()))[-200:]
        return fail, f"does not load ({error}): built against another torch"
    if include and entry["torch_include"] and entry["torch_include"] != include:
        # it loaded with every symbol resolved (above): another environment's build of a torch with
        # this ABI, which only a job that uses the op would notice, if at all
        return warn, (
            f"built against the torch at {entry['torch_include']}, not this one ({include}); it loads here, "
            "so only a job that uses this op could notice a difference"
        )
    if entry["built"] and torch.get("installed_at") and entry["built"] < torch["installed_at"]:
        return warn, "built before this torch was installed: it may not load, or load with another ABI"
    return None


def _backends(facts: Facts, host: str) -> list[Finding]:
    torch_version = facts["torch"].get("version")
    spikingjelly = facts["packages"].get("spikingjelly")
    return [
        _optional("deepspeed", facts.get("deepspeed"), host, fail,
                  "reinstall it for this torch: DS_BUILD_OPS=0 pip install deepspeed",
                  lambda ds: _deepspeed(ds, torch_version, host)),
        *_deepspeed_cuda_ops(facts, host),
        _optional("horovod", facts.get("horovod"), host, fail,
                  f"rebuild Horovod against torch {torch_version} (bash scripts/build-horovod.sh PYTHON)",
                  lambda hvd: ok("horovod", f"Horovod {hvd['version']}: frameworks {', '.join(hvd['frameworks'])}; "
                                 f"controllers {', '.join(hvd['controllers']) or 'none'}; tensor operations "
                                 f"{', '.join(hvd['tensor_operations']) or 'none'}", host)),
        _optional("mpi4py", facts.get("mpi4py"), host, warn,
                  "install an MPI library (apt-get install libopenmpi-dev) or pip install mpich",
                  lambda mpi: ok("mpi4py", f"mpi4py {mpi['version']} on {mpi['library']}", host)),
        _optional("spikingjelly", facts.get("spikingjelly"), host, warn,
                  "pip install --no-deps spikingjelly==2.0.0 loguru",
                  lambda _: ok("spikingjelly", f"spikingjelly {spikingjelly}", host)),
    ]  # fmt: skip


def _optional(
    name: str,
    facts: Facts | None,
    host: str,
    broken: Callable[..., Finding],
    fix: str,
    working: Callable[[Facts], Finding],
) -> Finding:
    """An optional package: not installed is fine; installed but not importing is ``broken``."""
    if facts is None:
        return ok(name, "not installed (optional)", host)
    if facts["error"]:
        return broken(name, f"does not import: {facts['error'][-300:]}", fix, host)
    return working(facts)


def _deepspeed(ds: Facts, torch_version: str | None, host: str) -> Finding:
    built = ds["built_with"].get("version", "0.0")
    if built not in ("0.0", None) and torch_version and not torch_version.startswith(built):
        return warn("deepspeed", f"DeepSpeed {ds['version']} was installed with torch {built}, this is "
                    f"torch {torch_version}: its prebuilt ops may not load",
                    "reinstall DeepSpeed for this torch", host)  # fmt: skip
    return ok("deepspeed", f"DeepSpeed {ds['version']}, accelerator {ds['accelerator']}", host)


def _deepspeed_cuda_ops(facts: Facts, host: str) -> list[Finding]:
    """On a GPU node: whether DeepSpeed's FusedAdam (what a config's Adam/AdamW becomes on a GPU)
    is prebuilt or cached, or must be compiled at the first step of a job, and whether it can be."""
    ds, torch = facts.get("deepspeed"), facts["torch"]
    if not ds or ds["error"] or not torch.get("cuda_available") or ds.get("nvcc") is None:
        return []
    check = "deepspeed cuda ops"
    if any(op["name"] == "fused_adam" and op["installed"] for op in ds["ops"]):
        return [ok(check, "FusedAdam is prebuilt into DeepSpeed", host)]
    archs = facts["env"].get("TORCH_CUDA_ARCH_LIST")
    if unreadable_cuda_archs(archs):  # read before a compiled FusedAdam is loaded, too
        return [fail(check, f"FusedAdam is not prebuilt, and DeepSpeed can neither compile nor load it with "
                     f"TORCH_CUDA_ARCH_LIST={archs!r} (it reads MAJOR.MINOR[+PTX] entries only): a deepspeed "
                     "job whose config has an Adam or AdamW optimizer stops at its start",
                     f"start jobs with {readable_setting(archs)}", host)]  # fmt: skip
    cached = [
        e
        for e in facts["extensions"]["entries"]
        if e["name"] == "fused_adam"
        and e.get("cuda")
        and e["tag"] in (None, torch.get("ext_tag"))
        and e["libraries"]
        and not _stale(e, torch, None)
    ]
    if cached:
        return [ok(check, f"FusedAdam is compiled in {cached[0]['path']}", host)]
    nvcc, version = ds["nvcc"], ds["version"]
    prebuild = (f"or pre-build DeepSpeed's CUDA ops once, on a node with the CUDA toolkit {torch['cuda']}: "
                f"SAIL_DEEPSPEED_CUDA_OPS=1 bash scripts/setup.sh --backends (or DS_BUILD_FUSED_ADAM=1 "
                f"DS_BUILD_CPU_ADAM=1 pip install --no-build-isolation deepspeed=={version}); or set "
                '"optimizer": {"params": {"torch_adam": true}} in the config')  # fmt: skip
    if nvcc["error"]:
        return [warn(check, f"FusedAdam is not prebuilt and cannot be compiled here ({nvcc['error']}): a "
                     "deepspeed job whose config has an Adam or AdamW optimizer stops at its first step",
                     f"install the CUDA toolkit {torch['cuda']} (nvcc; set CUDA_HOME) on this node, {prebuild}",
                     host)]  # fmt: skip
    return [ok(check, f"FusedAdam is compiled at the first deepspeed job on this node (nvcc {nvcc['version']} "
               f"in {nvcc['home']}, a minute or two, into {facts['extensions']['root']})", host)]  # fmt: skip


def _network(facts: Facts, host: str) -> list[Finding]:
    interfaces = [i for i in facts["network"]["interfaces"] if i["name"] != "lo" and i["addresses"]]
    shown = "; ".join(f"{i['name']} {' '.join(i['addresses']) or '(no address)'}" for i in interfaces)
    out = [ok("network", shown or "loopback only (single-node jobs only)", host)]
    names = [i["name"] for i in facts["network"]["interfaces"]]
    for key in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = facts["env"].get(key)
        if value and not _ifname_matches(value, names):
            out.append(fail(key, f"={value} matches no interface here ({', '.join(names)})",
                            f"set {key} to one of {', '.join(names)}, or unset it", host))  # fmt: skip
    return out


def _ifname_matches(spec: str, names: list[str]) -> bool:
    """NCCL's syntax: comma-separated prefixes, '=' for exact names, '^' to exclude."""
    exclude = spec.startswith("^")
    exact = spec.lstrip("^").startswith("=")
    wanted = [w for w in spec.lstrip("^").lstrip("=").split(",") if w]
    hits = [n for n in names if any(n == w if exact else n.startswith(w) for w in wanted)]
    return bool(set(names) - set(hits)) if exclude else bool(hits)


# sshd's StrictModes (on by default) ignores authorized_keys unless the file and every directory
# from it up to the home directory belong to the user or root and are writable by no one else;
# being readable by others is fine (OpenSSH's safe_path). Debian's and Ubuntu's sshd also accept a
# group-writable one whose group has the user as its only member (their user-private groups and
# umask 002). ssh itself refuses a private key of the user's that anyone else may read.
_STRICT_MODES = (("home", "chmod go-w"), ("dir", "chmod 700"), ("authorized_keys", "chmod 600"))
_IGNORED = "so sshd (StrictModes) ignores authorized_keys and logins need a password"
_DEBIAN_SSH = re.compile(r"\b(Debian|Ubuntu)\b")


def ssh_permissions(facts: Facts, host: str) -> list[Finding]:
    """Exactly what sshd's StrictModes and ssh's key check refuse, from the probe's ``ssh`` facts."""
    ssh = facts["ssh"]
    debian = bool(_DEBIAN_SSH.search(ssh.get("version") or ""))
    out = []
    for key, chmod in _STRICT_MODES:
        entry = ssh.get(key)
        if not entry:
            continue
        path, why = entry["path"], _writable(entry, debian)
        if why:
            out.append(warn("ssh permissions", f"{path} has mode {entry['mode']:o}: {why}, {_IGNORED}",
                            f"{chmod} {path}", host))  # fmt: skip
        if not (entry["owner"] or entry.get("root")):
            out.append(warn("ssh permissions", f"{path} belongs to another user, {_IGNORED}",
                            f"sudo chown $(id -un) {path}", host))  # fmt: skip
    for key in ssh["keys"]:
        if key["owner"] and key["mode"] & 0o077:
            out.append(fail("ssh permissions", f"private key {key['path']} has mode {key['mode']:o}: ssh refuses "
                            "to use it ('UNPROTECTED PRIVATE KEY FILE')", f"chmod 600 {key['path']}", host))  # fmt: skip
    return out or [ok("ssh permissions", "~/.ssh, authorized_keys and keys pass sshd's StrictModes and ssh's checks",
                      host)]  # fmt: skip


def _writable(entry: Facts, debian: bool) -> str:
    """Why sshd refuses the entry's mode ('' when it does not)."""
    if entry["mode"] & 0o002:
        return "writable by others"
    if not entry["mode"] & 0o020 or (debian and entry.get("group_is_yours")):
        return ""
    if entry.get("group_is_yours"):
        return "writable by its group (only Debian's and Ubuntu's sshd accept that, when you are its only member)"
    return "writable by its group, which is not yours alone"


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])
