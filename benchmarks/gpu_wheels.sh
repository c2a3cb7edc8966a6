#!/usr/bin/env bash
# Fetch, on a machine with a package index, the wheels of the engine's dependencies that the lent GPU machine
# lacks (pydantic and pydantic-settings with their own, llguidance for structured output; it has torch, triton,
# transformers, tokenizers, safetensors, numpy and pytest), for Python 3.12 on x86-64 Linux, at the versions
# pyproject.toml pins (llguidance's wheel needs glibc 2.31: the machine's Python 3.12 image has more).
#
#   bash benchmarks/gpu_wheels.sh [DIR]        # default .whl (git ignores it); a few MB
#
# Then name DIR in the device call's `carry`; benchmarks/gpu_check.sh installs them into /tmp when the
# interpreter there cannot import the engine's settings.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:-.whl}"
PIP="${PIP:-.venv/bin/python -m pip}"
# pydantic-core's version is the one pydantic pins; the others' are what pydantic 2.14 and pydantic-settings 2.16
# accept (the versions this project's .venv resolved).
WHEELS=(pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0
        typing-inspection==0.4.5 python-dotenv==1.2.4 typing-extensions==4.16.0 llguidance==1.9.1)
mkdir -p "$DIR"
$PIP download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DIR" "${WHEELS[@]}"
ls -la "$DIR"
