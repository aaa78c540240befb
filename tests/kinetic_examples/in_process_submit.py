"""Submits a detached job with no worker polling the pool: this process runs it (in-process) and waits for it at
exit. The test kills this process with SIGKILL; the job must stop by itself and its run end Cancelled."""

import json
import os
import sys

from kinetic_prefect import kinetic


@kinetic.run(accelerator="cpu")
def long_job(pid_file):
    import pathlib
    import time

    pathlib.Path(pid_file).write_text(str(os.getpid()))
    time.sleep(600)
    return "never"


if __name__ == "__main__":
    job = long_job.run_async(sys.argv[1])
    print(json.dumps({"job": job.job_id}), flush=True)
