#!/usr/bin/env bash
# The wheels a GPU call carries in .whl/ (the GPU image has torch, triton, transformers, no
# diffusers, no server stack, and no internet): diffusers for the peer benches and their tests,
# FastAPI + uvicorn + prometheus_client for bench_serve's server. bench/run_gpu.sh
# installs them with --no-deps into /tmp/site. The image runs Python 3.12: the two compiled
# wheels are fetched for it. Run from the repository root with the project's .venv.
set -eu
PIP=${PIP:-.venv/bin/pip}
mkdir -p .whl
"$PIP" download -q --no-deps -d .whl \
  diffusers==0.42.1 requests==2.34.2 urllib3==2.8.0 idna==3.20 certifi==2026.10.19.post1 \
  fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 uvicorn==0.55.0 h11==0.16.0 click==8.5.1 \
  anyio==4.16.0 annotated-doc==0.0.7 annotated-types==0.8.0 typing-inspection==0.4.5 \
  typing_extensions==4.16.0 prometheus_client==0.26.0 opentelemetry-api==1.45.2 \
  importlib_metadata==10.2.0 zipp==4.1.2
"$PIP" download -q --no-deps -d .whl --python-version 3.12 --only-binary=:all: \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 charset-normalizer==3.5.3 pydantic_core==2.50.5
ls .whl
