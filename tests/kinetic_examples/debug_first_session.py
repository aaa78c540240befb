"""Kinetic's "A first debug session" (docs/guides/debugging.md), as a Kinetic user wrote it, with the one line that
changes when porting: the import. The accelerator is the one change a machine without a TPU needs: on kinetic-local
the job runs on the CPU either way. The test runs it with nobody attaching (a short KINETIC_DEBUG_WAIT_SECONDS); a
user attaches with `kinetic-prefect jobs debug JOB_ID --port 5678` and the launch.json entry it prints."""

from kinetic_prefect import kinetic  # was: import kinetic


@kinetic.run(accelerator="cpu", debug=True)
def train():
    import jax

    breakpoint()  # the debugger pauses here
    x = jax.numpy.arange(16)
    return x.sum()


if __name__ == "__main__":
    print(train())
