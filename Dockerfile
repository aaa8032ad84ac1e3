# kvbus: one image for every stage; the stage is the first argument (ENTRYPOINT is `kvbus`).
#   docker build -t kvbus .                                  # bridge, worker, sink, top, lookup
#   docker build -t kvbus:all --build-arg KVBUS_EXTRAS=all .  # and `kvbus report`
#   docker run --rm -e KVBUS_BOOTSTRAP=kafka:9092 -e KVBUS_REDIS_URL=redis://redis:6379/0 kvbus sink
# The install steps are deploy/image/install.sh (tests/test_packaging.py runs the same script).
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
# role extras of pyproject.toml, comma-separated; empty: the script's default
ARG KVBUS_EXTRAS=
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
COPY . /src
RUN /src/deploy/image/install.sh /src /opt/kvbus ${KVBUS_EXTRAS}

FROM python:${PYTHON_VERSION}-slim
LABEL org.opencontainers.image.title="kvbus" \
      org.opencontainers.image.description="Cluster-wide event bus for LLM inference KV-cache events" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=build /opt/kvbus /opt/kvbus
# A non-root user with a fixed uid (Kubernetes' runAsNonRoot checks the number); its home is the
# working directory, where the Faust worker keeps its data directory unless a volume is mounted there.
RUN groupadd --system --gid 10001 kvbus \
 && useradd --system --uid 10001 --gid kvbus --home-dir /var/lib/kvbus --create-home --shell /usr/sbin/nologin kvbus
ENV PATH=/opt/kvbus/bin:$PATH PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /var/lib/kvbus
ENTRYPOINT ["kvbus"]
CMD ["--help"]
