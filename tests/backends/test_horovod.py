"""The Horovod backend on 2 real ranks started by horovodrun: same training as DDP, exact resume,
checkpoints shared with DDP, fp16 compression, ranks started by torchrun, and the errors for what
it cannot do.

Starting ranks costs seconds, so one module fixture runs every scenario in three launches: ranks
started by torchrun's agent (DDP, and Horovod under torchrun), then Horovod ranks (``horovodrun
--gloo -np 2 -H localhost:2``), then DDP ranks again to resume from the Horovod checkpoint. Each
test asserts on its part.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import spikingsail
from spikingsail.environments import RankInfo
from spikingsail.errors import BackendError, ConfigError
from tests.backends.jobs.horovod_job import MICRO_STEPS, config, model, run_plan, train
from tests.multiprocess import run_ranks

pytestmark = pytest.mark.multiprocess
JOB = Path(__file__).with_name("jobs") / "horovod_job.py"
HOROVODRUN = Path(sys.executable).with_name("horovodrun")
STEPS = MICRO_STEPS // 2  # optimizer steps: gradient accumulation 2

Results = dict[int, dict[str, Any]]


def horovodrun(out: Path, plan: list[dict[str, Any]]) -> Results:
    out.mkdir()
    (out / "plan.json").write_text(json.dumps(plan))
    # No MASTER_ADDR: the backend agrees on its torch.distributed store through Horovod.
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    argv = [str(HOROVODRUN), "--gloo", "-np", "2", "-H", "localhost:2",
            sys.executable, str(JOB), str(out), str(out / "plan.json")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env, cwd=out, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return {rank: torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Results]:
    root = tmp_path_factory.mktemp("horovod")
    ckpt = {name: str(root / f"ckpt-{name}") for name in ("ddp", "hvd", "mid", "bn", "bn_straight")}
    ddp = run_ranks(run_plan, 2, [
        {"tag": "straight", "backend": "ddp", "own_group": True},
        {"tag": "save", "backend": "ddp", "checkpoints": ckpt["ddp"], "stop_at": 6, "own_group": True},
        {"tag": "noclip", "backend": "ddp", "clip": False, "own_group": True},
        {"tag": "fp16", "backend": "ddp", "precision": "fp16", "own_group": True},
        {"tag": "bf16", "backend": "ddp", "precision": "bf16", "own_group": True},
        {"tag": "under_torchrun", "backend": "horovod"},
    ])  # fmt: skip
    hvd = horovodrun(root / "hvd", [
        {"tag": "straight", "backend": "horovod"},
        {"tag": "fp16", "backend": "horovod", "precision": "fp16"},
        {"tag": "bf16", "backend": "horovod", "precision": "bf16"},
        {"tag": "save", "backend": "horovod", "checkpoints": ckpt["hvd"], "stop_at": 6},
        {"tag": "resume", "backend": "horovod", "checkpoints": ckpt["hvd"], "resume": True},
        {"tag": "save_mid_window", "backend": "horovod", "checkpoints": ckpt["mid"], "stop_at": 5},
        {"tag": "resume_mid_window", "backend": "horovod", "checkpoints": ckpt["mid"], "resume": True},
        {"tag": "from_ddp", "backend": "horovod", "checkpoints": ckpt["ddp"], "resume": True},
        {"tag": "bn_straight", "backend": "horovod", "batch_norm": True, "checkpoints": ckpt["bn_straight"],
         "save_at": 6},
        {"tag": "bn_save", "backend": "horovod", "batch_norm": True, "checkpoints": ckpt["bn"], "stop_at": 6},
        {"tag": "bn_resume", "backend": "horovod", "batch_norm": True, "checkpoints": ckpt["bn"], "resume": True},
        {"tag": "compressed", "backend": "horovod", "clip": False, "horovod": {"compression": "fp16"}},
        {"tag": "adasum", "backend": "horovod", "clip": False, "horovod": {"op": "Adasum"},
         "expect_error": True},
    ])  # fmt: skip
    ddp_after = run_ranks(run_plan, 2, [
        {"tag": "from_horovod", "backend": "ddp", "checkpoints": ckpt["hvd"], "resume": True, "own_group": True},
    ])  # fmt: skip
    return {"ddp": ddp, "hvd": hvd, "ddp_after": ddp_after}


def assert_same_params(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), f"{what}: {key} differs by {(got[key] - value).abs().max()}"


def test_horovod_trains_exactly_like_ddp(runs: dict[str, Results]) -> None:
    # Tolerance zero. With two ranks both compute the averaged gradient (g0 + g1) / 2 with one
    # rounding: DDP halves each gradient (exact) and gloo adds them; Horovod adds them and scales
    # the sum by 1/2 (exact). Clipping, AdamW and the fp16 loss scaler then see identical gradients.
    for rank in (0, 1):
        hvd, ddp = runs["hvd"][rank], runs["ddp"][rank]
        assert hvd["straight"]["rank_source"] == "horovod" and ddp["straight"]["rank_source"] == "torchrun"
        assert hvd["straight"]["env"]["MASTER_ADDR"] is None  # the group was agreed through Horovod
        for tag in ("straight", "fp16", "bf16"):
            assert hvd[tag]["steps"] == ddp[tag]["steps"] == STEPS
            assert hvd[tag]["skipped"] == ddp[tag]["skipped"]
            assert hvd[tag]["losses"] == ddp[tag]["losses"], tag
            assert_same_params(hvd[tag]["params"], ddp[tag]["params"], tag)
        # the fp16 runs did go through loss-scale overflows, detected on the averaged gradients
        assert hvd["fp16"]["skipped"] > 0
    assert_same_params(runs["hvd"][0]["straight"]["params"], runs["hvd"][1]["straight"]["params"], "ranks")


def test_fp16_compression_averages_gradients_sent_in_half_precision(runs: dict[str, Results]) -> None:
    compressed = [runs["hvd"][rank]["compressed"] for rank in (0, 1)]
    assert len(compressed[0]["stepped_grads"]) == STEPS
    for step, (grads0, grads1) in enumerate(zip(*(c["stepped_grads"] for c in compressed), strict=True)):
        for name, grad in grads0.items():
            # What the optimizer stepped with went through the all-reduce as float16: every value
            # is a float16 number, and every rank has the same.
            assert torch.equal(grad, grad.half().float()), (step, name)
            assert torch.equal(grad, grads1[name]), (step, name)
    reference = runs["ddp"][0]["noclip"]
    for key, value in reference["params"].items():
        got = compressed[0]["params"][key]
        # float16 keeps 11 significant bits: each averaged gradient is off by at most 2**-11 of its
        # size (plus the float16 rounding of the two ranks' sum), and AdamW's normalised steps of
        # lr 0.01 pass that on relatively, so six steps move parameters by well under 1e-4.
        torch.testing.assert_close(got, value, rtol=0, atol=1e-4, msg=key)
    assert any(not torch.equal(compressed[0]["params"][k], v) for k, v in reference["params"].items())
    global_losses = [
        (a + b) / 2 for a, b in zip(compressed[0]["losses"], compressed[1]["losses"], strict=True)
    ]
    assert global_losses[-1] < global_losses[0]


def test_adasum_on_gloo_is_refused_with_the_way_out(runs: dict[str, Results]) -> None:
    # Horovod implements Adasum on MPI only ("No Adasum operation enabled" on Gloo): ranks that
    # horovodrun started in Gloo mode refuse before training, naming the way out.
    for rank in (0, 1):
        adasum = runs["hvd"][rank]["adasum"]
        assert adasum["error"] == "BackendError"
        assert "horovod.op is Adasum, but Horovod runs on Gloo here" in adasum["message"]
        assert "horovodrun --mpi" in adasum["message"]


ADASUM_JOB = """
import json, torch, spikingsail
torch.manual_seed(0)
net = torch.nn.Linear(3, 1, bias=False)
w0 = net.weight.detach().clone()
engine, _ = spikingsail.initialize(model=net, optimizer=torch.optim.SGD(net.parameters(), lr=0.5),
    config={"train_micro_batch_size_per_gpu": 1, "horovod": {"op": "Adasum"},
            "sail": {"backend": "horovod", "progress_bar": False}})
x = torch.tensor([[1.0, 2.0, 0.5], [0.3, -1.0, 2.0]])[engine.rank:engine.rank + 1]
engine.backward(engine(x).sum())
engine.step()
# a file per rank: mpirun merges the ranks' stdout, and two lines written at once can share one
with open(f"rank{engine.rank}.json", "w") as out:
    json.dump({"w": engine.module.weight.detach().flatten().tolist(), "w0": w0.flatten().tolist()}, out)
engine.close()
"""


def test_adasum_on_mpi_combines_the_ranks_updates_by_its_formula(tmp_path: Path) -> None:
    # Open MPI starts the ranks; Horovod runs on its MPI controller, where Adasum lives.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    (tmp_path / "job.py").write_text(ADASUM_JOB)
    root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    argv = ["mpirun", *root, "-np", "2", "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={port}",
            sys.executable, str(tmp_path / "job.py")]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert len(results) == 2 and results[0] == results[1]
    # each rank's SGD update is -lr * x_rank; Adasum(a, b) = (1 - a.b / 2|a|^2) a + (1 - a.b / 2|b|^2) b
    a = -0.5 * torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    b = -0.5 * torch.tensor([0.3, -1.0, 2.0], dtype=torch.float64)
    dot = a @ b
    expected = (
        torch.tensor(results[0]["w0"], dtype=torch.float64)
        + (1 - dot / (2 * a @ a)) * a
        + (1 - dot / (2 * b @ b)) * b
    )
    average = torch.tensor(results[0]["w0"], dtype=torch.float64) + (a + b) / 2
    got = torch.tensor(results[0]["w"], dtype=torch.float64)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)  # float32 arithmetic inside Horovod
    assert (got - average).abs().max() > 0.1  # and not what averaging would give


def test_save_and_resume_under_horovod_is_exact(runs: dict[str, Results]) -> None:
    for rank in (0, 1):
        hvd = runs["hvd"][rank]
        assert hvd["save"] is None and hvd["save_mid_window"] is None
        # saved on the boundary after step 3, and inside the window of step 3 (partial gradients)
        assert_same_params(hvd["resume"]["params"], hvd["straight"]["params"], "resume")
        assert_same_params(hvd["resume_mid_window"]["params"], hvd["straight"]["params"], "mid-window")
        assert hvd["resume"]["losses"] == hvd["straight"]["losses"][3:]


def test_a_resume_with_per_rank_batch_norm_statistics_equals_the_run_that_saved(
    runs: dict[str, Results],
) -> None:
    # each rank's batch norm sees its own batches (Horovod syncs no buffers): their statistics
    # differ, and a checkpoint that gave every rank another rank's would show here
    straight = [runs["hvd"][rank]["bn_straight"]["params"] for rank in (0, 1)]
    assert not torch.equal(straight[0]["1.running_mean"], straight[1]["1.running_mean"])
    for rank in (0, 1):
        assert runs["hvd"][rank]["bn_save"] is None
        resumed = runs["hvd"][rank]["bn_resume"]["params"]
        assert sorted(resumed) == sorted(straight[rank]) and "1.running_var" in resumed
        for name, value in straight[rank].items():
            assert torch.equal(resumed[name], value), f"rank {rank}: {name}"


def test_checkpoints_move_between_ddp_and_horovod(runs: dict[str, Results]) -> None:
    for rank in (0, 1):
        want = runs["ddp"][rank]["straight"]["params"]
        assert_same_params(runs["hvd"][rank]["from_ddp"]["params"], want, "DDP checkpoint under Horovod")
        assert_same_params(
            runs["ddp_after"][rank]["from_horovod"]["params"], want, "Horovod checkpoint under DDP"
        )


def test_horovod_backend_under_torchrun_meets_through_torch_distributed(runs: dict[str, Results]) -> None:
    # `sail launch -n 2` (torchrun): rank 0 runs Horovod's rendezvous server itself and announces it
    # over the torch.distributed group; the training is the same as under horovodrun.
    for rank in (0, 1):
        under_torchrun = runs["ddp"][rank]["under_torchrun"]
        assert under_torchrun["rank_source"] == "torchrun"
        assert under_torchrun["losses"] == runs["hvd"][rank]["straight"]["losses"]
        assert_same_params(
            under_torchrun["params"], runs["hvd"][rank]["straight"]["params"], "under torchrun"
        )


def test_horovod_started_by_horovodrun_outlives_each_engine(runs: dict[str, Results]) -> None:
    # Under horovodrun each of the job's engines uses the Horovod the first one started (a second
    # hvd.init() could meet stale addresses at horovodrun's rendezvous server); under torchrun the
    # engine ran the rendezvous and shut Horovod down with it.
    for rank in (0, 1):
        finished = {tag: r for tag, r in runs["hvd"][rank].items() if r is not None and "params" in r}
        assert len(finished) >= 8
        assert all(r["horovod_up_after_close"] for r in finished.values())
        assert runs["ddp"][rank]["under_torchrun"]["horovod_up_after_close"] is False


def test_one_process_without_horovodrun_trains_like_ddp() -> None:
    # `python train.py` with the horovod backend: Horovod of size 1, no torch.distributed group
    hvd = train({"tag": "single", "backend": "horovod"})
    ddp = train({"tag": "single", "backend": "ddp"})
    assert hvd is not None and ddp is not None
    assert_same_params(hvd["params"], ddp["params"], "one process")


def initialize(cfg: dict[str, Any]) -> None:
    spikingsail.initialize(model=model(), config=cfg, rank_info=RankInfo.single())


@pytest.mark.parametrize(
    ("section", "extra", "message"),
    [
        ({"compresion": "fp16"}, {}, r"unknown key 'compresion' in 'horovod'(.|\n)*did you mean 'compression'"),
        ({"compression": "int8"}, {}, r"horovod\.compression is 'int8'(.|\n)*one of 'none', 'fp16'"),
        ({"op": "Sum"}, {}, r"horovod\.op is 'Sum'(.|\n)*one of 'Average', 'Adasum'"),
        ({"backward_passes_per_step": 0}, {}, r"horovod\.backward_passes_per_step"),
        ({"backward_passes_per_step": 4}, {}, r"horovod\.backward_passes_per_step is 4, but gradient_accumulation_steps is 2"),
        ({"op": "adasum"}, {}, r"horovod\.op is Adasum together with gradient_clipping(.|\n)*before the engine could"),
        ({"op": "Adasum"}, {"gradient_clipping": 0.0, "fp16": {"enabled": True}}, r"horovod\.op is Adasum together with fp16\.enabled"),
        ("fp16", {}, r"'horovod' must be an object"),
    ],
)  # fmt: skip
def test_bad_horovod_options_are_refused_before_anything_starts(
    section: Any, extra: dict[str, Any], message: str
) -> None:
    cfg = {**config({"backend": "horovod"}), "horovod": section, **extra}
    with pytest.raises(ConfigError, match=r"^<dict>: " + message):
        initialize(cfg)


def test_matching_backward_passes_per_step_and_case_insensitive_names_are_accepted() -> None:
    from spikingsail.backends import load_config
    from spikingsail.backends.horovod import horovod_options

    cfg = {**config({"backend": "horovod", "clip": False}),
           "horovod": {"compression": "FP16", "op": "average", "backward_passes_per_step": 2}}  # fmt: skip
    options = horovod_options(load_config(cfg, world_size=2))
    assert (options.compression, options.op, options.backward_passes_per_step) == ("fp16", "Average", 2)


def test_without_horovod_installed_the_error_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "horovod.torch", None)  # what an absent package looks like to import
    cfg = config({"backend": "horovod"})
    with pytest.raises(BackendError, match=r"horovod\.torch cannot be imported(.|\n)*build-horovod\.sh"):
        initialize(cfg)


def test_choosing_another_backend_never_imports_horovod() -> None:
    code = (
        "import sys, torch, spikingsail\n"
        "from spikingsail.backends import sharding_backends\n"
        "from spikingsail.environments import RankInfo\n"
        "sharding_backends(1)\n"  # imports every backend module to ask it
        "net = torch.nn.Linear(2, 2)\n"
        "engine, _ = spikingsail.initialize(model=net, rank_info=RankInfo.single(), config={\n"
        "    'train_micro_batch_size_per_gpu': 1, 'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})\n"
        "engine.close()\n"
        "assert not [m for m in sys.modules if m.split('.')[0] == 'horovod'], 'horovod was imported'\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_horovod_build_chooses_nccl_only_with_a_cuda_torch_and_keys_its_cache_by_it() -> None:
    script = Path(__file__).parents[2] / "scripts" / "build-horovod.sh"

    def key(**env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", str(script), "--key", sys.executable], capture_output=True, text=True,
                              env={**os.environ, **env}, check=False, timeout=120)  # fmt: skip

    cuda = torch.version.cuda
    default = key()
    assert default.returncode == 0, default.stderr
    assert default.stdout.strip().endswith(
        f"-gloo-mpi-nccl-cuda{cuda}-sm{'.'.join(map(str, torch_archs()))}"
        if cuda and shutil.which("nvcc")
        else "-gloo-mpi"
    )
    forced = key(SAIL_HOROVOD_GPU="nccl")
    if cuda:
        assert forced.returncode == 0 and f"-nccl-cuda{cuda}-sm" in forced.stdout
        named = key(SAIL_HOROVOD_GPU="nccl", HOROVOD_BUILD_CUDA_CC_LIST="80,90")  # Horovod's own setting
        assert named.returncode == 0 and named.stdout.strip().endswith(f"-nccl-cuda{cuda}-sm80.90")
    else:
        assert forced.returncode == 2 and "needs a CUDA build of torch" in forced.stderr
    assert key(SAIL_HOROVOD_GPU="none").stdout.strip().endswith("-gloo-mpi")
    wrong = key(SAIL_HOROVOD_GPU="yes")
    assert wrong.returncode == 2 and "give nccl or none" in wrong.stderr


def torch_archs() -> list[int]:
    """The GPU architectures torch's own kernels are compiled for (75 for sm_75)."""
    return [int(a[3:]) for a in torch.cuda.get_arch_list() if a.startswith("sm_")]


def cuda_kernels(library: Path) -> tuple[list[int], list[int]]:
    """The architectures of the compiled kernels (cubins) and of the PTX in a library's .nv_fatbin
    section: each fat binary is a 16-byte header (magic 0xBA55ED50) and entries of a kind (1 PTX,
    2 cubin), a header size, a payload size and, at byte 28, the architecture."""
    data = library.read_bytes()
    (table,) = struct.unpack_from("<Q", data, 0x28)
    size, count, names = struct.unpack_from("<HHH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", data, table + i * size) for i in range(count)]
    strings = sections[names][4]
    fatbins = [s for s in sections if data[strings + s[0] :].startswith(b".nv_fatbin\0")]
    cubins: list[int] = []
    ptx: list[int] = []
    for section in fatbins:
        offset, end = section[4], section[4] + section[5]
        while offset + 16 <= end and struct.unpack_from("<I", data, offset)[0] == 0xBA55ED50:
            header, payload = struct.unpack_from("<HQ", data, offset + 6)
            entry, offset = offset + header, offset + header + payload
            while entry < offset:
                kind, entry_header, entry_size = struct.unpack_from("<HxxIQ", data, entry)
                (cubins if kind == 2 else ptx).append(struct.unpack_from("<I", data, entry + 28)[0])
                entry += entry_header + entry_size
    return sorted(cubins), sorted(ptx)


def test_horovods_gpu_kernels_are_built_for_the_architectures_torchs_are() -> None:
    """With NCCL, Horovod compiled its CUDA kernels for every architecture nvcc knows (twelve with
    CUDA 13); scripts/build-horovod.sh gives it torch's list instead (each cubin also runs on the later
    minor versions of its major), with the PTX of the last. A CPU-only build has no kernels."""
    import horovod.torch

    (library,) = Path(horovod.torch.__file__).parent.glob("mpi_lib_v2*.so")
    cubins, ptx = cuda_kernels(library)
    if horovod.torch.nccl_built():
        assert (cubins, ptx) == (torch_archs(), torch_archs()[-1:]), library
    else:
        assert (cubins, ptx) == ([], []), library


def test_the_installed_horovod_is_a_release_build_without_debug_information() -> None:
    """scripts/build-horovod.sh builds Release (-O3 -DNDEBUG), not Horovod's RelWithDebInfo, whose debug
    information cost a fifth of the build and 21 of the wheel's 23 MB; the key names the build type."""
    import horovod.torch

    (library,) = Path(horovod.torch.__file__).parent.glob("mpi_lib_v2*.so")
    sections = subprocess.run(
        ["readelf", "-S", "-W", str(library)], capture_output=True, text=True, check=True
    )
    assert ".text" in sections.stdout
    assert ".debug_info" not in sections.stdout, f"{library} carries debug information"
    key = subprocess.run(["bash", str(Path(__file__).parents[2] / "scripts" / "build-horovod.sh"), "--key",
                          sys.executable], capture_output=True, text=True, check=True, timeout=120)  # fmt: skip
    assert "-release-" in key.stdout
