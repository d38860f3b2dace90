# One image for the API, the control plane and the GPU workers. The base carries CUDA's compiler,
# which DeepSpeed needs to build its fused optimizer kernels (a worker builds them as it starts).
ARG BASE=pytorch/pytorch:2.9.1-cuda12.8-cudnn9-devel
FROM ${BASE}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 TORCH_CUDA_ARCH_LIST="8.0;9.0"
# libaio: DeepSpeed's async I/O op, which NVMe offload uses.
RUN apt-get update && apt-get install -y --no-install-recommends libaio-dev && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY contract contract
COPY api api
COPY worker worker
COPY trainer trainer
COPY migrations migrations
COPY scripts scripts
COPY alembic.ini ./
RUN pip install .
EXPOSE 8000
CMD ["sh", "-c", "exec uvicorn api.main:app --host 0.0.0.0 --port 8000 --no-access-log --workers ${FT_API_WORKERS:-$(nproc)}"]
