# trio-failover's container image: the wheel this repository builds, with
# its redis and otel extras, in a virtualenv, run as an unprivileged user.
#
#   docker build -t trio-failover:0.1.0 .
#   docker run --rm -p 8080:8080 --stop-timeout 45 \
#       -e TRIO_FAILOVER_UPSTREAMS=gpu-a=http://10.0.0.11:8080 trio-failover:0.1.0
#
# docs/deploying.md says what the image sets and why; tests/test_release.py
# lints this file with hadolint and runs the build stage's install and the
# entry point outside a container.

# Both stages must share one Python: the final stage copies the venv whole,
# and a venv points at the interpreter it was made with.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
# The build frontend, pinned; it fetches the backend (hatchling) itself.
RUN python -m pip install --no-cache-dir build==1.2.2
WORKDIR /src
COPY . .
# As a release is built: the sdist, then the wheel from the sdist. That
# wheel, with the extras the image promises, goes into the venv.
RUN python -m build --outdir /dist \
    && python -m venv /opt/trio-failover \
    && set -- /dist/*.whl \
    && /opt/trio-failover/bin/python -m pip install --no-cache-dir "$1[redis,otel]"

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/trio-failover /opt/trio-failover
COPY deploy/healthcheck.py /opt/trio-failover/healthcheck.py
# The uid is fixed so that Kubernetes' runAsNonRoot can verify it
# (deploy/kubernetes/trio-failover.yaml uses the same).
RUN groupadd --system --gid 10001 trio-failover \
    && useradd --system --uid 10001 --gid 10001 --no-create-home \
        --home-dir /nonexistent --shell /usr/sbin/nologin trio-failover
# Inside a container 127.0.0.1 reaches no one: the client listener is on
# every address. The admin listener stays on loopback (the health check
# below asks it there); to publish /status and /metrics, set
# TRIO_FAILOVER_ADMIN_LISTEN=0.0.0.0:8081 and TRIO_FAILOVER_ADMIN_TOKEN.
# The environment beats a config file's listen keys: change the addresses
# here, with -e or with the flags. The health check reads the admin
# address from TRIO_FAILOVER_ADMIN_LISTEN: move the admin listener with
# that variable, not with --admin-listen, or the check asks the old one.
ENV PATH=/opt/trio-failover/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TRIO_FAILOVER_LISTEN=0.0.0.0:8080 \
    TRIO_FAILOVER_ADMIN_LISTEN=127.0.0.1:8081
USER 10001:10001
EXPOSE 8080 8081
# GET /healthz on TRIO_FAILOVER_ADMIN_LISTEN: 200 while serving, 503 once a
# drain has begun.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["/opt/trio-failover/bin/python", "/opt/trio-failover/healthcheck.py"]
# SIGTERM drains: /healthz turns 503 and in-flight streams get
# --shutdown-timeout (30s) to finish. Docker's own stop timeout is 10s:
# run with --stop-timeout 45 (Compose: stop_grace_period: 45s).
STOPSIGNAL SIGTERM
# Exec form, no shell: the proxy is PID 1 and receives the signal itself.
ENTRYPOINT ["/opt/trio-failover/bin/trio-failover"]
CMD ["serve"]
