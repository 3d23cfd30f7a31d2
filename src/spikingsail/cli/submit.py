"""``sail submit``: write the sbatch script, print it (--dry-run) or submit it (and --wait)."""

from __future__ import annotations

from pathlib import Path

from spikingsail.launchers.preflight import check_config, config_paths
from spikingsail.launchers.sbatch import parse_submit, submit, wait


def run(argv: list[str]) -> int:
    request, ns = parse_submit(argv)
    for config in config_paths(
        request.script_args, request.script
    ):  # here, not on the nodes once the job is scheduled
        check_config(config, request.world_size)
    text = request.render()
    if ns.dry_run:
        print(text, end="")
        return 0
    path = Path(ns.script_path or f"{request.job_name}.sbatch")
    path.write_text(text)
    job_id = submit(path)
    output = (request.output or f"{request.job_name}-%j.out").replace("%j", job_id)
    print(f"submitted job {job_id} ({path}); output in {output}", flush=True)
    if not ns.wait:
        return 0
    state, code = wait(job_id)
    print(f"job {job_id} ended: {state}, exit status {code}", flush=True)
    return code
