# Worker image: `llm-worker serve`, `llm-worker topics` and `llm-worker generate` in one image.
#   CPU (default, CPU-only torch): docker build -t kafka-llm-worker:cpu .
#   NVIDIA GPU (PyPI torch, CUDA):  docker build --build-arg TORCH_INDEX_URL= -t kafka-llm-worker:cuda .
FROM python:3.11-slim

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    LLM_WORKER_HOME=/opt/llm-worker

WORKDIR /app

# Dependencies first, read from pyproject.toml, so that editing the source does not reinstall torch.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['model'] + p['optional-dependencies']['otel']))" > /tmp/requirements.txt
# torch from the chosen index (the pin stays the one in pyproject.toml); the rest from PyPI.
RUN if [ -n "$TORCH_INDEX_URL" ]; then \
        pip install --index-url "$TORCH_INDEX_URL" "$(grep '^torch==' /tmp/requirements.txt)"; \
    fi \
    && pip install -r /tmp/requirements.txt

COPY . .
RUN pip install --no-deps . \
    && useradd --create-home --uid 10001 worker \
    && mkdir -p "$LLM_WORKER_HOME" && chown worker "$LLM_WORKER_HOME"
USER worker

# The model is part of the image: a scaled-out worker starts without downloading anything.
RUN llm-worker model pull

CMD ["llm-worker", "serve"]
