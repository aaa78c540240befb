#!/usr/bin/env bash
# Installs and starts what the container tests need: a Docker engine and a plain-HTTP registry on 127.0.0.1:5000.
#
# Usage (from .ci/run):   containers_env="$(.ci/setup-containers.sh)"; eval "$containers_env"
#   stdout: only `export ...` lines (DOCKER_HOST, KINETIC_TEST_REGISTRY); progress goes to stderr.
#   The same lines are written to $KINETIC_CONTAINERS_DIR/env.
#
# Idempotent: installed packages are not reinstalled, and a daemon that already answers is reused. The daemons
# are left running (detached) for later runs. Needs root, or sudo. Docker Hub is not used: the tests make their
# base image locally with debootstrap (installed here) the first time, and cache it under ~/.cache.
set -euo pipefail

STATE_DIR="${KINETIC_CONTAINERS_DIR:-/tmp/kinetic-containers}"
SOCKET="$STATE_DIR/docker.sock"
export DOCKER_HOST="unix://$SOCKET"
REGISTRY="${KINETIC_TEST_REGISTRY:-127.0.0.1:5000}"
PACKAGES=(docker.io docker-registry debootstrap)

say() { echo "setup-containers: $*" >&2; }
SUDO=()
if [[ $EUID -ne 0 ]]; then
  command -v sudo >/dev/null || { say "needs root (or sudo) to install packages and run dockerd"; exit 1; }
  SUDO=(sudo)
fi
export PATH="$PATH:/usr/sbin:/sbin"
mkdir -p "$STATE_DIR"

# --- packages ----------------------------------------------------------------------------------------------------
missing=()
for pkg in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  say "installing ${missing[*]}"
  "${SUDO[@]}" apt-get update -qq >&2
  # policy-rc.d may refuse to start the packaged services; we start our own daemons below anyway.
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi

docker_answers() { timeout 20 docker -H "unix://$SOCKET" version --format '{{.Server.Version}}' >/dev/null 2>&1; }
registry_answers() { curl -fsS --max-time 3 "http://$1/v2/" >/dev/null 2>&1; }
wait_for() {  # wait_for SECONDS PID CHECK...: true once CHECK passes; false if PID dies or time runs out
  local deadline=$((SECONDS + $1)) pid=$2; shift 2
  until "$@"; do
    [[ -d /proc/$pid ]] || return 1
    ((SECONDS < deadline)) || return 1
    sleep 0.3
  done
}

# --- Docker engine -----------------------------------------------------------------------------------------------
# Its own socket, data-root and exec-root under $STATE_DIR, so it never touches a system Docker. overlay2 first;
# vfs where the kernel or sandbox refuses overlay mounts; without iptables/bridge where network setup is refused
# (the tests build with --network host and run with --network none, so they need neither).
if docker_answers; then
  say "Docker engine already running at $DOCKER_HOST"
else
  old_pid="$(cat "$STATE_DIR/dockerd.pid" 2>/dev/null || true)"
  if [[ -n "$old_pid" && "$(cat "/proc/$old_pid/comm" 2>/dev/null)" == dockerd ]]; then
    say "stopping our dockerd $old_pid, which no longer answers"  # it holds the pidfile and data-root locks
    "${SUDO[@]}" kill "$old_pid"
    for _ in $(seq 30); do [[ -d /proc/$old_pid ]] || break; sleep 0.5; done
  fi
  started=""
  for flags in "--storage-driver overlay2" "--storage-driver overlay2 --iptables=false --bridge=none" \
               "--storage-driver vfs" "--storage-driver vfs --iptables=false --bridge=none"; do
    read -r _ driver _ <<<"$flags"
    # One data-root per storage driver: a driver refuses a root another one has initialised.
    # shellcheck disable=SC2086
    "${SUDO[@]}" setsid nohup dockerd --data-root "$STATE_DIR/data-$driver" --exec-root "$STATE_DIR/exec" \
      --pidfile "$STATE_DIR/dockerd.pid" -H "unix://$SOCKET" $flags >"$STATE_DIR/dockerd.log" 2>&1 </dev/null &
    if wait_for 60 $! docker_answers; then started="$flags"; break; fi
    say "dockerd $flags did not come up:"; tail -n 5 "$STATE_DIR/dockerd.log" >&2
    "${SUDO[@]}" kill "$!" 2>/dev/null || true
    sleep 1
  done
  [[ -n "$started" ]] || { say "could not start dockerd; see $STATE_DIR/dockerd.log"; exit 1; }
  say "Docker engine started ($started) at $DOCKER_HOST"
fi
# A socket created by sudo dockerd must be usable by the (non-root) test user too.
[[ $EUID -eq 0 ]] || "${SUDO[@]}" chmod 666 "$SOCKET"

# --- registry ----------------------------------------------------------------------------------------------------
if registry_answers "$REGISTRY"; then
  say "registry already answering at $REGISTRY"
else
  # Debian's packaged config turns on htpasswd auth; ours has none and keeps its blobs under $STATE_DIR.
  cat >"$STATE_DIR/registry.yml" <<EOF
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: $STATE_DIR/registry
  delete:
    enabled: true
http:
  addr: $REGISTRY
EOF
  setsid nohup docker-registry serve "$STATE_DIR/registry.yml" >"$STATE_DIR/registry.log" 2>&1 </dev/null &
  wait_for 30 $! registry_answers "$REGISTRY" || { say "registry did not start:"; tail -n 20 "$STATE_DIR/registry.log" >&2; exit 1; }
  say "registry started at $REGISTRY"
fi

printf 'export DOCKER_HOST=%q\nexport KINETIC_TEST_REGISTRY=%q\n' "$DOCKER_HOST" "$REGISTRY" | tee "$STATE_DIR/env"
