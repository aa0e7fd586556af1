"""Container health check: exit 0 when an HTTP endpoint answers 2xx in time, 1 otherwise.

    python /opt/exgrpo/healthcheck.py http://127.0.0.1:8700/healthz [TIMEOUT_SECONDS]

Standard library only, so it runs in every image without curl.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def check(url: str, timeout: float) -> str | None:
    """None when healthy, else the reason."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            if 200 <= response.status < 300:
                return None
            return f"HTTP {response.status}"
    except urllib.error.HTTPError as e:
        return f"HTTP {e.code}"
    except (OSError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def main(argv: list[str]) -> int:
    url = argv[1] if len(argv) > 1 else "http://127.0.0.1:8700/healthz"
    timeout = float(argv[2]) if len(argv) > 2 else 3.0
    reason = check(url, timeout)
    if reason is None:
        return 0
    sys.stderr.write(f"unhealthy: {url}: {reason}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
