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
# docs/CONTAINER.md says how this image is checked without a Docker engine
# (scripts/check_container.sh, which swaps the base for a local Debian bookworm).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# A virtual environment at a fixed path: the same layout whether the base keeps python in
# /usr/local/bin (python:3.11-slim) or /usr/bin (a plain Debian with python3 and python3-venv).
COPY pyproject.toml README.md /tmp/aiocoll-src/
COPY aiocoll /tmp/aiocoll-src/aiocoll
COPY server /tmp/aiocoll-src/server
COPY client /tmp/aiocoll-src/client
COPY scripts/container-entrypoint.sh /usr/local/bin/aiocoll-entrypoint
RUN python3 -m venv /opt/aiocoll \
    && /opt/aiocoll/bin/python -m pip install --no-compile /tmp/aiocoll-src \
    && rm -rf /tmp/aiocoll-src \
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
