"""``sail submit``: write the job's file for its target (an sbatch script, a Kubernetes PyTorchJob),
print it (--dry-run) or submit it (and --wait, where the target can)."""

from __future__ import annotations

import logging
from pathlib import Path

from spikingsail.launchers.preflight import check_config, config_paths
from spikingsail.launchers.submitters import target_of

log = logging.getLogger(__name__)


def run(argv: list[str]) -> int:
    target = target_of(argv)
    submitter = target.load()
    request, ns = submitter.parse_submit(argv)
    for config in config_paths(request.script_args, request.script):  # here, not once the job is scheduled
        if target.local_files or Path(config).is_file():
            check_config(config, request.world_size)
        else:
            log.warning("%s is not here to check: it must be in the image, as the script is", config)
    text = request.render()
    if ns.dry_run:
        print(text, end="")
        return 0
    path = Path(ns.script_path or f"{request.job_name}{target.suffix}")
    path.write_text(text)
    job_id = submitter.submit(path)
    print(submitter.submitted(request, job_id, path), flush=True)
    if not getattr(ns, "wait", False):
        return 0
    state, code = submitter.wait(job_id)
    print(f"job {job_id} ended: {state}, exit status {code}", flush=True)
    return int(code)
