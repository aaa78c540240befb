"""Submits a detached job with no worker polling the pool: this process runs it (in-process) and waits for it at
exit. One test kills this process with SIGKILL (the job must stop by itself and its run end Cancelled); another lets
it end after a short job (it must exit cleanly once the job is done, its value waiting in the store)."""

import json
import os
import sys

from kinetic_prefect import kinetic


@kinetic.run(accelerator="cpu")
def long_job(pid_file, seconds=600.0):
    import pathlib
    import time

    pathlib.Path(pid_file).write_text(str(os.getpid()))
    time.sleep(seconds)
    return f"slept {seconds:g} s"


if __name__ == "__main__":
    job = long_job.run_async(sys.argv[1], float(sys.argv[2]) if len(sys.argv) > 2 else 600.0)
    print(json.dumps({"job": job.job_id}), flush=True)
