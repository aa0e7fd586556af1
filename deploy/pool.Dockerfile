# Experience pool service image (FastAPI + Postgres/Redis clients). Build from the repository root:
#   docker build -f deploy/pool.Dockerfile -t exgrpo-pool .
FROM python:3.11.11-slim-bookworm AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY services ./services
COPY clients ./clients
RUN python -m venv /opt/venv && /opt/venv/bin/pip install --no-cache-dir --upgrade pip \
 && /opt/venv/bin/pip install --no-cache-dir ".[server]"

FROM python:3.11.11-slim-bookworm
RUN useradd --create-home --uid 10001 exgrpo
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH EXGRPO_HOST=0.0.0.0 EXGRPO_PORT=8700
USER exgrpo
EXPOSE 8700
HEALTHCHECK --interval=10s --timeout=3s --retries=5 \
  CMD python -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:8700/healthz', timeout=2)" || exit 1
CMD ["exgrpo", "serve"]
