# The image the Kubernetes manifests run (deploy/k8s/*.yaml): the node agent, the tuner, the
# Prometheus exporter and the admission webhook, all as `agentzip-blk SUBCOMMAND`. Not the
# swap server: that runs from the host's systemd unit (deploy/k8s/daemonset.yaml says why),
# so the image holds neither nbdkit nor FUSE.
#
# Build (the tag is the one the manifests name; tests/fleet/test_k8s_manifests.py checks):
#   docker build -t ghcr.io/agentzip/agentzip-blk:0.1.0 .

FROM python:3.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml ./
COPY agentzip_blk ./agentzip_blk
RUN python -m venv /opt/agentzip \
    && /opt/agentzip/bin/pip install --no-cache-dir .

FROM python:3.11-slim-bookworm
LABEL org.opencontainers.image.title="agentzip-blk" \
      org.opencontainers.image.description="agentzip-blk node agent, tuner, exporter and webhook" \
      org.opencontainers.image.version="0.1.0"
COPY --from=build /opt/agentzip /opt/agentzip
# no .pyc writes at run time: the manifests mount the root filesystem read-only
ENV PATH=/opt/agentzip/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# non-root by default; the DaemonSet's containers that write root-owned host files ask for
# uid 0 explicitly (runAsUser), with every capability dropped
USER 65532:65532
ENTRYPOINT ["agentzip-blk"]
CMD ["--help"]
