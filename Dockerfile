# The aiocoll coordinator as a service: key-value store and rendezvous for many jobs.
#
#   docker build -t aiocoll-coordinator .
#   docker run -p 29500:29500 -p 29501:29501 -e AIOCOLL_TOKEN=secret aiocoll-coordinator
#
# Port 29500 serves rendezvous and the store; 29501 serves the live page (/), /jobs, /healthz and
# /metrics over HTTP (the page and /jobs ask for the token; open http://HOST:29501/#token=SECRET).
# The token comes from AIOCOLL_TOKEN, or from a mounted file named by AIOCOLL_TOKEN_FILE (or
# mounted at /run/secrets/aiocoll_token); without one the container refuses to start (see
# scripts/container-entrypoint.sh). Only the coordinator's dependencies are installed: no torch.
#
# Reproducible: the base is pinned by digest, and every package comes from a lock with hashes
# (container/requirements.txt for the image, container/build-requirements.txt for the build
# stage; container/*.in say how to make them again). The final image holds the Python of the
# base and one virtual environment, without pip, setuptools or wheel: nothing is installed at
# run time. docs/CONTAINER.md says how this image is checked without a Docker engine
# (scripts/check_container.sh, which builds it on a local Debian bookworm in place of BASE).

# python:3.11-slim-bookworm (Python 3.11.16), its multi-platform index as docker-library/repo-info
# records it. To move on: docker buildx imagetools inspect python:3.11-slim-bookworm.
ARG BASE=python:3.11-slim-bookworm@sha256:0bee7276f83efd4a1ee05bbbf4281d95ed28e079220a9457f25a93e3f1e3c31b

FROM ${BASE} AS build
ENV PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY container/requirements.txt container/build-requirements.txt /tmp/lock/
COPY pyproject.toml README.md /tmp/aiocoll-src/
COPY aiocoll /tmp/aiocoll-src/aiocoll
COPY server /tmp/aiocoll-src/server
COPY client /tmp/aiocoll-src/client
# A build environment with the locked build backend makes aiocoll's wheel (no build isolation:
# nothing unpinned is fetched); the image's environment, made without pip, receives the locked
# wheels, each checked against its hashes, then aiocoll's own wheel without dependencies.
RUN python3 -m venv /opt/build \
    && /opt/build/bin/pip install --require-hashes --only-binary :all: -r /tmp/lock/build-requirements.txt \
    && /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /tmp/wheels /tmp/aiocoll-src \
    && python3 -m venv --without-pip /opt/aiocoll \
    && /opt/build/bin/pip --python /opt/aiocoll/bin/python install --no-compile --require-hashes \
        --only-binary :all: --no-deps -r /tmp/lock/requirements.txt \
    && /opt/build/bin/pip --python /opt/aiocoll/bin/python install --no-compile --no-deps /tmp/wheels/aiocoll-*.whl \
    && /opt/aiocoll/bin/python -c "import aiocoll.server, aiocoll.cli.main"

FROM ${BASE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
COPY --from=build /opt/aiocoll /opt/aiocoll
COPY scripts/container-entrypoint.sh /usr/local/bin/aiocoll-entrypoint
# The base's own pip, setuptools and wheel go too (a plain Debian base has none).
RUN if python3 -m pip --version >/dev/null 2>&1; then python3 -m pip uninstall -y -q pip setuptools wheel; fi \
    && /opt/aiocoll/bin/python -c "import aiocoll.server, aiocoll.cli.main" \
    && chmod 0755 /usr/local/bin/aiocoll-entrypoint \
    && groupadd --system --gid 10001 aiocoll \
    && useradd --system --uid 10001 --gid aiocoll --home-dir /var/lib/aiocoll --create-home \
        --shell /usr/sbin/nologin aiocoll

ENV PATH=/opt/aiocoll/bin:$PATH \
    AIOCOLL_HEALTH_PORT=29501

USER 10001:10001
WORKDIR /var/lib/aiocoll

EXPOSE 29500 29501

# Healthy when the coordinator's own /healthz answers 200 on the HTTP port the default command
# opens; a command that moves or drops --http-port should set AIOCOLL_HEALTH_PORT to match.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10s --retries=3 \
    CMD ["/opt/aiocoll/bin/python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('AIOCOLL_HEALTH_PORT', '29501'), timeout=4).close()"]

ENTRYPOINT ["/usr/local/bin/aiocoll-entrypoint"]
CMD ["aiocoll", "coordinator", "--host", "0.0.0.0", "--port", "29500", "--http-port", "29501"]
