"""Facts about one machine, as JSON: what ``sail doctor`` judges.

This file is a standalone script that needs only the standard library. The doctor runs it with the
Python that training uses — on this machine, its source given on stdin (``collect.py``), on other
nodes the same way over ssh — so it works when spikingsail is missing or another version on a
node, and when torch itself does not import (the import error is a fact, not a crash). It prints
one line, ``SAIL_PROBE {json}``, last; anything a library prints before it is ignored.

Options: ``--port P`` checks that P can be bound here and keeps it open for ``--listen-seconds``
(until ``--expect`` peers have connected, or with ``--stop-on-eof`` until stdin ends: the doctor
closes it once every other node is done); ``--connect HOST:PORT`` tries to reach such a listener
for ``--connect-seconds`` (packets dropped ``DROPPED_AFTER`` times in a row end it sooner).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import grp
import importlib
import importlib.metadata
import importlib.util
import json
import os
import pwd
import re
import resource
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

MARKER = "SAIL_PROBE "
PACKAGES = ("spikingsail", "torch", "numpy", "deepspeed", "horovod", "mpi4py", "spikingjelly")
ENV_KEYS = ("CUDA_VISIBLE_DEVICES", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "TORCH_EXTENSIONS_DIR",
            "LD_LIBRARY_PATH", "LD_PRELOAD", "DS_ACCELERATOR", "TORCH_CUDA_ARCH_LIST")  # fmt: skip
_TAG = re.compile(r"^py\d+\w*_(cpu|cu\d+|rocm\d+)$")
CONNECT_SECONDS = 2.0
"""How long one connection attempt to the rendezvous port waits for an answer."""
DROPPED_AFTER = 2
"""Attempts in a row without an answer that mean a firewall drops the packets: a port nothing
listens on yet is refused at once."""
Facts = dict[str, Any]


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".strip()


def python_facts() -> Facts:
    return {"version": ".".join(map(str, sys.version_info[:3])), "executable": sys.executable}


def package_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def cpu_facts() -> Facts:
    return {"usable": len(os.sched_getaffinity(0)), "total": os.cpu_count()}


def torch_facts() -> Facts:
    try:
        with contextlib.redirect_stdout(sys.stderr):
            torch: Any = importlib.import_module("torch")
    except BaseException as err:  # a broken CUDA library path raises OSError/ImportError here
        return {"error": _error(err)}
    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    facts: Facts = {
        "error": None,
        "version": torch.__version__,
        "cuda": cuda,
        "hip": hip,
        "path": str(Path(torch.__file__).resolve().parent),
        "installed_at": Path(torch.__file__).with_name("version.py").stat().st_mtime,
        "ext_tag": f"py{sys.version_info[0]}{sys.version_info[1]}{getattr(sys, 'abiflags', '')}_"
        + (f"rocm{hip.replace('.', '')}" if hip else f"cu{cuda.replace('.', '')}" if cuda else "cpu"),
        "cudnn": None,
        "nccl": None,
        "gpus": [],
    }
    with contextlib.suppress(Exception):
        facts["cudnn"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    if cuda:  # a CUDA build reports its NCCL without a GPU too (a login node compares with GPU nodes)
        with contextlib.suppress(Exception):
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    if torch.cuda.is_available():
        facts["gpus"] = [_gpu(torch, i) for i in range(torch.cuda.device_count())]
    facts["cuda_available"] = bool(torch.cuda.is_available())
    return facts


def _gpu(torch: Any, index: int) -> Facts:
    props = torch.cuda.get_device_properties(index)
    # bf16 in hardware: compute capability 8.0 or newer (torch.cuda.is_bf16_supported() also
    # counts the slow emulation on a V100 or T4)
    return {"index": index, "name": props.name, "memory": props.total_memory,
            "capability": f"{props.major}.{props.minor}", "bf16": props.major >= 8,
            "tflops": _matmul_tflops(torch, index)}  # fmt: skip


def _matmul_tflops(torch: Any, index: int, size: int = 4096, repeats: int = 10) -> float | None:
    """The GPU's measured fp16 matmul rate (every GPU since Volta has fp16 tensor cores): its speed
    relative to the other GPUs of a job, from which `sail doctor -H` suggests balance weights."""
    try:
        device = torch.device("cuda", index)
        a = torch.randn(size, size, device=device, dtype=torch.float16)
        b = torch.randn(size, size, device=device, dtype=torch.float16)
        torch.matmul(a, b)  # the first call picks the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        for _ in range(repeats):
            torch.matmul(a, b)
        end.record(torch.cuda.current_stream(device))
        end.synchronize()
        seconds = float(start.elapsed_time(end)) / 1000
        return round(2 * size**3 * repeats / seconds / 1e12, 1)
    except Exception:  # a GPU that cannot run it (busy, out of memory) has no measured speed
        return None


def driver_facts() -> Facts:
    """The NVIDIA driver, seen without torch: nvidia-smi and libcuda's cuDriverGetVersion; and the
    NVIDIA GPUs on the PCI bus, seen without any driver (``lspci | grep -i nvidia``, from sysfs)."""
    facts: Facts = {"version": None, "cuda": None, "gpus": None, "error": None, "pci_gpus": pci_gpus()}
    if shutil.which("nvidia-smi"):
        result = subprocess.run(["nvidia-smi", "--query-gpu=driver_version,name", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=30, check=False)  # fmt: skip
        rows = [r.split(",") for r in result.stdout.strip().splitlines() if "," in r]
        if result.returncode == 0 and rows:
            facts["version"], facts["gpus"] = rows[0][0].strip(), len(rows)
        else:
            facts["error"] = (result.stderr or result.stdout).strip()[-300:]
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int()
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            facts["cuda"] = f"{version.value // 1000}.{version.value % 1000 // 10}"
    except OSError:
        pass  # no driver library: a CPU machine, or a container started without the GPU runtime
    return facts


def pci_gpus(root: str = "/sys/bus/pci/devices") -> int | None:
    """NVIDIA display and 3D controllers (vendor 0x10de, class 0x03xxxx) on the PCI bus; None when
    the bus cannot be read (no sysfs)."""
    try:
        devices = list(Path(root).iterdir())
    except OSError:
        return None
    count = 0
    for device in devices:
        try:
            vendor = (device / "vendor").read_text().strip()
            kind = (device / "class").read_text().strip()
        except OSError:
            continue
        count += vendor == "0x10de" and kind.startswith("0x03")
    return count


def shm_facts(path: str = "/dev/shm") -> Facts:
    try:
        st = os.statvfs(path)
    except OSError as err:
        return {"path": path, "error": _error(err)}
    return {"path": path, "total": st.f_blocks * st.f_frsize, "free": st.f_bavail * st.f_frsize}


def limit_facts() -> Facts:
    def pair(which: int) -> list[int]:
        return [-1 if v == resource.RLIM_INFINITY else v for v in resource.getrlimit(which)]

    return {"nofile": pair(resource.RLIMIT_NOFILE), "memlock": pair(resource.RLIMIT_MEMLOCK)}


def ssh_facts() -> Facts:
    home = Path.home()
    ssh = home / ".ssh"

    def mode(path: Path) -> Facts | None:
        try:
            st = path.stat()
        except OSError:
            return None
        return {"path": str(path), "mode": st.st_mode & 0o777, "owner": st.st_uid == os.getuid(),
                "root": st.st_uid == 0, "group_is_yours": bool(st.st_mode & 0o020) and _group_is_yours(st)}  # fmt: skip

    keys = [mode(p) for p in sorted(ssh.glob("id_*")) if not p.name.endswith(".pub")]
    try:  # e.g. "OpenSSH_9.2p1 Debian-2+deb12u3": the distribution's patches are the server's too
        version = subprocess.run(
            ["ssh", "-V"], capture_output=True, text=True, timeout=10, check=False
        ).stderr.strip()
    except (OSError, subprocess.SubprocessError):
        version = None
    return {"home": mode(home), "dir": mode(ssh), "authorized_keys": mode(ssh / "authorized_keys"),
            "keys": [k for k in keys if k], "version": version}  # fmt: skip


def _group_is_yours(st: os.stat_result) -> bool:
    """Debian's sshd accepts a group-writable file whose group has one member: you (its owner)."""
    try:
        group, owner = grp.getgrgid(st.st_gid), pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        return False
    primary = [p.pw_uid for p in pwd.getpwall() if p.pw_gid == group.gr_gid]
    if any(uid != os.getuid() for uid in primary) or group.gr_mem not in ([], [owner]):
        return False
    return bool(primary or group.gr_mem)


def extension_facts(torch_info: Facts) -> Facts:
    """torch's JIT extension cache (DeepSpeed's ops live there): what is built, for what, against what."""
    explicit = os.environ.get("TORCH_EXTENSIONS_DIR")
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    root = Path(explicit or Path(cache) / "torch_extensions")
    entries: list[Facts] = []
    if root.is_dir():
        # Without TORCH_EXTENSIONS_DIR, torch puts its builds in a pyXY_cuZZ folder per interpreter.
        parents = [root] if explicit else [d for d in root.iterdir() if d.is_dir() and _TAG.match(d.name)]
        for parent in sorted(parents):
            tag = None if explicit else parent.name
            entries += [_extension(d, tag) for d in sorted(parent.iterdir()) if d.is_dir()]
    current = [e for e in entries if e["tag"] in (None, torch_info.get("ext_tag"))]
    errors = _load_errors([so for e in current for so in e["libraries"]]) if torch_info.get("version") else {}
    for entry in current:
        entry["load_errors"] = {so: errors[so] for so in entry["libraries"] if so in errors}
    return {"root": str(root), "explicit": bool(explicit), "entries": entries}


def _extension(directory: Path, tag: str | None) -> Facts:
    ninja = directory / "build.ninja"
    include, cuda = None, False
    if ninja.is_file():
        text = ninja.read_text(errors="replace")
        found = re.search(r"-isystem\s+(\S+/torch/include)\b", text)
        include = os.path.realpath(found.group(1)) if found else None
        cuda = bool(re.search(r"^nvcc\s*=", text, re.MULTILINE))  # torch writes an nvcc rule for CUDA sources
    libraries = sorted(str(p) for p in directory.glob("*.so"))
    built = max((Path(p).stat().st_mtime for p in libraries), default=None)
    return {"path": str(directory), "name": directory.name, "tag": tag, "torch_include": include,
            "cuda": cuda, "libraries": libraries, "built": built, "load_errors": {}}  # fmt: skip


def _load_errors(libraries: list[str]) -> dict[str, str]:
    """Load each library with every symbol resolved now, in a child: a stale build fails right here.

    The child is a fork of this process, which has imported torch already (the libraries need its
    symbols): no second interpreter importing torch again (two seconds of a node's CPU). A library
    that crashes the process it loads in crashes only the child."""
    if not libraries:
        return {}
    import torch  # noqa: F401  # the libraries link against it; torch_facts imported it

    reader, writer = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; the doctor's tests see what it reports
        code = 1
        try:
            os.close(reader)
            out = {}
            for so in libraries:
                try:
                    ctypes.CDLL(so, mode=os.RTLD_NOW | os.RTLD_LOCAL)
                except OSError as err:
                    out[so] = str(err)
            os.write(writer, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as said:
        text = said.read().decode(errors="replace")
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    if status != 0:
        return dict.fromkeys(libraries, f"loading crashed the interpreter (status {status})")
    errors: dict[str, str] = json.loads(text)
    return errors


def deepspeed_facts(torch_info: Facts) -> Facts | None:
    if importlib.util.find_spec("deepspeed") is None:
        return None
    if not torch_info.get("cuda_available"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as SpikingSail's deepspeed backend does
    # DeepSpeed's autotuner imports MLflow where it is installed (a second of the node's CPU, and
    # imported only to log tuning runs); DeepSpeed imports without it
    sys.modules.setdefault("mlflow", None)  # type: ignore[arg-type]
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from deepspeed.accelerator import get_accelerator
            from deepspeed.git_version_info import installed_ops, version
            from deepspeed.git_version_info import torch_info as built_with
            from deepspeed.ops.op_builder.all_ops import ALL_OPS
            from deepspeed.ops.op_builder.builder import probe_is_compatible

            accelerator = get_accelerator()._name
            ops = [{"name": name, "installed": bool(installed_ops.get(name, False)),
                    "compatible": bool(probe_is_compatible(builder, False))}
                   for name, builder in ALL_OPS.items()]  # fmt: skip
            compiler = _cuda_compiler() if torch_info.get("cuda") else None
    except BaseException as err:
        return {"error": _error(err)}
    return {"error": None, "version": version, "accelerator": accelerator, "built_with": dict(built_with),
            "ops": ops, "nvcc": compiler}  # fmt: skip


def _cuda_compiler() -> Facts:
    """The nvcc DeepSpeed would compile its CUDA ops with, judged by DeepSpeed's own check."""
    from deepspeed.ops.op_builder.builder import assert_no_cuda_mismatch, installed_cuda_version
    from torch.utils.cpp_extension import CUDA_HOME

    facts: Facts = {"home": CUDA_HOME, "version": None, "error": None}
    try:
        facts["version"] = "{}.{}".format(*installed_cuda_version())
        assert_no_cuda_mismatch()
    except Exception as err:  # MissingCUDAException, CUDAMismatchException
        facts["error"] = str(err).lstrip(">- ").strip()
    return facts


def horovod_facts() -> Facts | None:
    if importlib.util.find_spec("horovod") is None:
        return None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            import horovod
            import horovod.torch as hvd
    except BaseException as err:  # e.g. built against another torch: undefined symbol
        return {"error": _error(err)}
    names = ("mpi_built", "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built")
    built = {name.removesuffix("_built"): bool(getattr(hvd, name)()) for name in names}
    return {"error": None, "version": horovod.__version__, "frameworks": ["pytorch"],
            "controllers": [c for c in ("mpi", "gloo") if built[c]],
            "tensor_operations": [o for o in ("nccl", "ddl", "ccl", "mpi", "gloo") if built[o]],
            "cuda": built["cuda"], "rocm": built["rocm"]}  # fmt: skip


def mpi4py_facts() -> Facts | None:
    if importlib.util.find_spec("mpi4py") is None:
        return None
    try:
        import mpi4py

        mpi4py.rc.initialize = False  # read the library's version without starting MPI
        from mpi4py import MPI

        library = MPI.Get_library_version().strip().splitlines()[0].split(",")[0]
    except BaseException as err:  # no MPI library on the node: ImportError from libmpi
        return {"error": _error(err)}
    return {"error": None, "version": mpi4py.__version__, "library": library}


def spikingjelly_facts() -> Facts | None:
    if importlib.util.find_spec("spikingjelly") is None:
        return None
    try:
        with contextlib.redirect_stdout(sys.stderr):
            importlib.import_module("spikingjelly.activation_based.neuron")
    except BaseException as err:
        return {"error": _error(err)}
    return {"error": None}


def network_facts() -> Facts:
    interfaces: list[Facts] = []
    if shutil.which("ip"):
        result = subprocess.run(["ip", "-j", "addr"], capture_output=True, text=True, timeout=10, check=False)
        with contextlib.suppress(ValueError):
            for link in json.loads(result.stdout or "[]"):
                addresses = [f"{a['local']}/{a['prefixlen']}" for a in link.get("addr_info", [])]
                interfaces.append({"name": link["ifname"], "up": "UP" in link.get("flags", []),
                                   "addresses": addresses})  # fmt: skip
    if not interfaces:
        interfaces = [{"name": name, "up": None, "addresses": []} for _, name in socket.if_nameindex()]
    return {"interfaces": interfaces}


class PortCheck:
    """Bind the port now (is it free?) and accept peers in the background until told to stop."""

    def __init__(self, port: int, expect: int, seconds: float, stop_on_eof: bool = False) -> None:
        self.facts: Facts = {"port": port, "free": False, "error": None, "accepted": 0}
        self.deadline = time.monotonic() + seconds
        self.expect = expect
        self.stop = threading.Event()
        if stop_on_eof:
            threading.Thread(target=self._until_eof, daemon=True).start()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore does
        try:
            self.sock.bind(("", port))
            self.sock.listen(64)
        except OSError as err:
            self.facts["error"] = errno.errorcode.get(err.errno or 0, str(err))
            self.sock.close()
            return
        self.facts["free"] = True
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _until_eof(self) -> None:
        sys.stdin.buffer.read()
        self.stop.set()

    def _accept(self) -> None:
        self.sock.settimeout(0.2)
        while (
            self.facts["accepted"] < self.expect
            and time.monotonic() < self.deadline
            and not self.stop.is_set()
        ):
            with contextlib.suppress(TimeoutError):
                self.sock.accept()[0].close()
                self.facts["accepted"] += 1

    def result(self) -> Facts:
        if self.facts["free"]:
            self.thread.join()
            self.sock.close()
        return self.facts


class ConnectCheck:
    """Reach HOST:PORT, retrying while nothing listens yet, in the background."""

    def __init__(self, target: str, seconds: float) -> None:
        host, _, port = target.rpartition(":")
        self.facts: Facts = {"target": target, "address": None, "ok": False, "error": None}
        self.thread = threading.Thread(target=self._run, args=(host, int(port), seconds), daemon=True)
        self.thread.start()

    def _run(self, host: str, port: int, seconds: float) -> None:
        try:
            found = socket.getaddrinfo(host, port, socket.AF_INET, socket.SOCK_STREAM)
            self.facts["address"] = found[0][4][0]
        except OSError:
            self.facts["error"] = "unresolved"
            return
        deadline, dropped = time.monotonic() + seconds, 0
        while time.monotonic() < deadline and dropped < DROPPED_AFTER:
            try:
                socket.create_connection((self.facts["address"], port), timeout=CONNECT_SECONDS).close()
            except TimeoutError:
                self.facts["error"] = "timeout"
                dropped += 1
            except OSError as err:
                self.facts["error"] = errno.errorcode.get(err.errno or 0, str(err))
                dropped = 0
                time.sleep(0.2)
            else:
                self.facts.update(ok=True, error=None)
                return

    def result(self) -> Facts:
        self.thread.join()
        return self.facts


def collect(args: argparse.Namespace) -> Facts:
    port = PortCheck(args.port, args.expect, args.listen_seconds, args.stop_on_eof) if args.port else None
    connect = ConnectCheck(args.connect, args.connect_seconds) if args.connect else None
    torch_info = torch_facts()
    facts: Facts = {
        "host": socket.gethostname(), "python": python_facts(), "packages": package_versions(),
        "cpus": cpu_facts(), "env": {k: os.environ.get(k) for k in ENV_KEYS}, "torch": torch_info,
        "driver": driver_facts(), "shm": shm_facts(), "limits": limit_facts(), "ssh": ssh_facts(),
        "extensions": extension_facts(torch_info), "deepspeed": deepspeed_facts(torch_info),
        "horovod": horovod_facts(), "mpi4py": mpi4py_facts(), "spikingjelly": spikingjelly_facts(),
        "network": network_facts(),
    }  # fmt: skip
    facts["port"] = port.result() if port else None
    facts["connect"] = connect.result() if connect else None
    facts["time"] = time.time()
    return facts


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="probe")
    parser.add_argument("--port", type=int)
    parser.add_argument("--expect", type=int, default=0)
    parser.add_argument("--listen-seconds", type=float, default=0.0)
    parser.add_argument("--stop-on-eof", action="store_true")
    parser.add_argument("--connect")
    parser.add_argument("--connect-seconds", type=float, default=10.0)
    facts = collect(parser.parse_args(argv))
    sys.stdout.flush()
    print(MARKER + json.dumps(facts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
