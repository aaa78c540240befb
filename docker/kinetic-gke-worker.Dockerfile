# The in-cluster kinetic-gke worker: kinetic-prefect with its `gcp` and `k8s` extras, at the versions uv.lock pins.
#
# Build it with
#     kinetic-prefect gke-worker-image --repository REPOSITORY [--push]
# which sends only what the image needs as the build context (this file, pyproject.toml, uv.lock, README.md,
# kinetic_prefect/, work_pools/) and tags the image <version>-<digest of that context and BASE_IMAGE>;
# `kinetic-prefect gke-worker-manifests --repository REPOSITORY` names the same reference. (By hand: a context
# holding those files, as in the checkout, plus an extra/ folder, empty or with files for the build stage.)
#
# The container runs what the Deployment of `gke-worker-manifests` passes as its args,
#     prefect worker start --type kinetic-gke --pool POOL --with-healthcheck
# as the unprivileged user 10001; without args it prints that command's help.
#
# BASE_IMAGE: any Debian-based image with Python >= 3.11 (python3, venv, pip, CA certificates); the default is
# the official slim image. No BuildKit-only syntax: built here with Docker's legacy builder.
ARG BASE_IMAGE=python:3.12-slim

# ---------------------------------------------------------------------------------------------- build stage
FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    UV_SYSTEM_CERTS=1 \
    UV_NO_CACHE=1 \
    UV_PYTHON_DOWNLOADS=never \
    UV_COMPILE_BYTECODE=1 \
    UV_LINK_MODE=copy \
    UV_PROJECT_ENVIRONMENT=/opt/venv
# Files for this stage only, e.g. a CA bundle and pip.conf behind a TLS-intercepting proxy (gke-worker-image
# --ca-bundle); the final image does not get them.
COPY extra/ /
WORKDIR /src
# uv itself at the version the lock pins, in a venv of its own that stays in this stage.
COPY uv.lock /src/
RUN python3 -m venv /opt/uv \
 && /opt/uv/bin/pip install "uv==$(python3 -c 'import tomllib; lock = tomllib.load(open("uv.lock", "rb")); \
        print(next(p["version"] for p in lock["package"] if p["name"] == "uv"))')"
# The dependencies first (a layer that changes only with pyproject.toml or uv.lock), then the package itself,
# installed as a wheel (not editable), so /opt/venv is all the final stage needs.
COPY pyproject.toml /src/
RUN /opt/uv/bin/uv sync --frozen --no-dev --extra gcp --extra k8s --no-install-project --python python3
COPY README.md /src/
COPY work_pools/ /src/work_pools/
COPY kinetic_prefect/ /src/kinetic_prefect/
RUN /opt/uv/bin/uv sync --frozen --no-dev --extra gcp --extra k8s --no-editable --python python3 \
 && /opt/venv/bin/python -c "import kinetic_prefect.workers, prefect_gcp, prefect_kubernetes"

# ---------------------------------------------------------------------------------------------- final image
FROM ${BASE_IMAGE}
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    HOME=/home/kinetic \
    PREFECT_HOME=/home/kinetic/.prefect
RUN useradd --uid 10001 --user-group --create-home --home-dir /home/kinetic kinetic
COPY --from=build /opt/venv /opt/venv
# Numeric, so Kubernetes' runAsNonRoot can check it without reading /etc/passwd.
USER 10001:10001
WORKDIR /home/kinetic
# No entrypoint (a base image's is cleared): the Deployment's args are the whole command.
ENTRYPOINT []
CMD ["prefect", "worker", "start", "--type", "kinetic-gke", "--help"]
