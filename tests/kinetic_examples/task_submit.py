"""A flow whose kinetic task is submitted (``.submit()``) to a polling worker's pool; the test kills this script
with SIGKILL while the job runs, and another process collects the job's value with kinetic_prefect.attach."""

import os
import time

from prefect import flow

from kinetic_prefect import kinetic_task


@kinetic_task(work_pool=os.environ["POOL"])
def slow_answer(seconds: float) -> int:
    time.sleep(seconds)
    return 42


@flow
def ask() -> int:
    future = slow_answer.submit(6)
    return future.result()


if __name__ == "__main__":
    ask()
