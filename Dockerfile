# SpikingSail on a GPU node: CUDA 13.0 (the CUDA of the pinned torch 2.14.1+cu130, whose wheels bring
# cuDNN and NCCL; the devel image adds nvcc for Horovod's NCCL build and DeepSpeed's ops), the pinned
# environment with DeepSpeed and Horovod (NCCL operations: nvcc is in the image), and `sail doctor`
# as the health check.
#
#   docker build -t spikingsail .
#   docker run --gpus all --ipc=host --rm -it spikingsail sail launch -n 8 examples/train_digits.py
#
# --ipc=host (or --shm-size=8g): PyTorch's DataLoader workers and NCCL pass data through /dev/shm,
# which is 64 MB in a container by default; `sail doctor` reports a small /dev/shm.
FROM nvidia/cuda:13.0.1-devel-ubuntu24.04

RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       python3 python3-venv python3-dev git ca-certificates \
    && rm -rf /var/lib/apt/lists/*

ENV SPIKINGSAIL_CACHE=/opt/spikingsail-cache \
    CUDA_HOME=/usr/local/cuda \
    SAIL_HOROVOD_GPU=nccl
WORKDIR /opt/spikingsail
COPY . /opt/spikingsail
# The same script CI runs (scripts/test.sh): system packages, then the pinned environment.
RUN bash scripts/install.sh && rm -rf /var/lib/apt/lists/*
ENV PATH=/opt/spikingsail/.venv/bin:$PATH

HEALTHCHECK --interval=10m --timeout=2m --start-period=30s CMD ["sail", "doctor", "--timeout", "60"]
CMD ["sail", "doctor"]
