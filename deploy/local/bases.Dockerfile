# Stand-ins for the public base images, built from Debian bookworm packages only. For machines that
# reach a Debian mirror and a Python package index but no container registry (scripts/compose_check.sh
# builds them). Each target replaces one image of docker-compose.yml or one base of deploy/*.Dockerfile:
#   python      python:3.11-slim-bookworm   (PYTHON_IMAGE of the project's Dockerfiles; Debian's 3.11)
#   postgres    postgres:16-bookworm        (Debian's PostgreSQL 15; POSTGRES_USER/PASSWORD/DB, PGPORT)
#   redis       redis:7-bookworm            (Debian's Redis 7.0)
#   prometheus  prom/prometheus             (Debian's Prometheus 2.42; the entrypoint is the server)
# Grafana is in neither Debian nor PyPI: it has no stand-in.
# DEBIAN_IMAGE is a Debian bookworm root file system (debootstrap --variant=minbase, `docker import`).
ARG DEBIAN_IMAGE=exgrpo-local/debian:bookworm

FROM ${DEBIAN_IMAGE} AS debian
ENV DEBIAN_FRONTEND=noninteractive LANG=C.UTF-8
# slim, as the official -slim images: no recommends, no documentation or translations, no apt caches
RUN printf '%s\n' 'APT::Install-Recommends "false";' 'APT::Install-Suggests "false";' \
      > /etc/apt/apt.conf.d/90-no-recommends \
 && printf '%s\n' 'DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };' \
      > /etc/apt/apt.conf.d/90-clean \
 && printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
      'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
      > /etc/dpkg/dpkg.cfg.d/90-slim

FROM debian AS python
RUN apt-get update \
 && apt-get install -y python3 python3-venv python-is-python3 ca-certificates \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
CMD ["python3"]

FROM debian AS postgres
RUN apt-get update \
 && apt-get install -y postgresql-15 \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && mkdir -p /var/lib/postgresql/data /var/run/postgresql \
 && chown -R postgres:postgres /var/lib/postgresql /var/run/postgresql \
 && chmod 700 /var/lib/postgresql/data
COPY postgres-entrypoint.sh /usr/local/bin/postgres-entrypoint
ENV PATH=/usr/lib/postgresql/15/bin:$PATH PGDATA=/var/lib/postgresql/data
USER postgres
ENTRYPOINT ["postgres-entrypoint"]
CMD ["postgres"]

FROM debian AS redis
RUN apt-get update \
 && apt-get install -y redis-server \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
USER redis
WORKDIR /var/lib/redis
CMD ["redis-server", "--save", "", "--appendonly", "no"]

FROM debian AS prometheus
RUN apt-get update \
 && apt-get install -y prometheus wget \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin \
 && mkdir -p /prometheus && chown nobody:nogroup /prometheus
USER nobody
WORKDIR /prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
