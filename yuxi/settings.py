"""Settings read from the environment; every process reads the same ones."""

from __future__ import annotations

import os
import re
import socket

import msgspec

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/yuxi"


def _between(name: str, value: int, low: int, high: int) -> int:
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, not {value}")
    return value


class Settings(msgspec.Struct, frozen=True):
    database_url: str = DEFAULT_DATABASE_URL
    # True when YUXI_DATABASE_URL was set: then no embedded server is started.
    database_url_explicit: bool = False
    # YUXI_DIRECT_DATABASE_URL: the server itself, for the connections that
    # need a session (LISTEN, the checkpointer's lease-marked connections,
    # Procrastinate's worker). Set it when YUXI_DATABASE_URL is a transaction
    # pooler (PgBouncer, docs/scale-out.md); empty: YUXI_DATABASE_URL.
    direct_database_url: str = ""
    host: str = "127.0.0.1"
    port: int = 8000
    default_model: str = "replay"
    # Lease of an executing run; the worker heartbeats at a third of it.
    lease_seconds: float = 30.0
    # Runs of one turn before a lost lease fails the turn for good.
    max_run_attempts: int = 3
    # SSE keepalive comment interval.
    sse_keepalive_seconds: float = 15.0
    # Concurrent runs one worker process executes.
    worker_concurrency: int = 16
    # YUXI_WORKER_CLAIMS=0: workers leave every ready run to its job (no
    # claims on `yuxi_ready`; workers/tasks.py).
    worker_claims: bool = True
    # Where tree workdirs and sandboxes live (shared by workers of one host).
    data_dir: str = ".yuxi/data"
    # Tree sandboxes (docs/sandbox.md): "bwrap" confines a tree's commands
    # and files; "host" runs them as the worker, with its environment
    # (unsafe, an explicit opt-out).
    sandbox: str = "bwrap"
    # "none": no network but the tree's own loopback; "outbound": internet
    # through slirp4netns, still without the host's loopback.
    sandbox_network: str = "none"
    sandbox_bwrap: str = "bwrap"
    # The interpreter of the agent inside the sandbox (a system one: the
    # worker's virtualenv is not mounted there).
    sandbox_python: str = "/usr/bin/python3"
    # Per command (inherited by what it starts): CPU seconds, address space,
    # processes of the sandbox user, size of one written file.
    sandbox_cpu_seconds: int = 600
    sandbox_memory_mb: int = 4096
    sandbox_processes: int = 256
    sandbox_file_mb: int = 1024
    # The host user a root worker runs sandboxes as (never root itself).
    sandbox_uid: int = 65534
    # The worker's locale and terminal, the only variables passed inside.
    sandbox_locale: dict[str, str] = {}
    sandbox_term: str = "dumb"
    # How often (seconds, 1-30) workers look for sandboxes to release. Only
    # the sweep's period: the idle time that releases a sandbox is fixed
    # (5 minutes, yuxi.services.sandbox.IDLE).
    sandbox_sweep_seconds: int = 30
    # This worker's host (docs/scale-out.md): a tree whose sandbox is live
    # on a host runs there (queue runs@<host_id>). Default: the hostname.
    host_id: str = "localhost"
    # A host silent this long is dead: its sandboxes are released.
    host_timeout_seconds: int = 30
    # The worker's Prometheus /metrics port (0: none).
    worker_metrics_port: int = 0

    # Real models (docs/models.md): attempts of one model call (transient
    # provider errors), the first backoff (doubling, or the provider's
    # Retry-After) and the time limit of one attempt.
    model_max_attempts: int = 4
    model_backoff_seconds: float = 0.5
    model_timeout_seconds: float = 300.0

    # Runs of one turn that a database outage (a connection error inside the
    # run) may end before the turn fails for good; not counted in
    # max_run_attempts.
    max_infra_retries: int = 20
    # Longest request body the API reads (bytes); a longer one is 413.
    max_body_bytes: int = 10_000_000
    # Longest input content (characters); a longer one is 422. At most
    # yuxi.api.schemas.CONTENT_MAX_CHARS.
    max_content_chars: int = 200_000
    # Seconds an API request waits for a database connection before it
    # answers 503 database_unavailable (with Retry-After).
    db_wait_seconds: float = 3.0
    # Frames one SSE subscriber may hold taken but unsent while its socket is
    # full (its buffer). A subscriber that cannot take new events for
    # sse_slow_consumer_seconds (it reads slower than its tree writes) is
    # closed with a final comment telling it to resume from its last id.
    sse_buffer_events: int = 500
    # Events an API process keeps per subscribed tree, read once and shared
    # by the tree's subscribers (yuxi.api.feed); 0: each subscriber reads the
    # table itself.
    sse_feed_events: int = 1000
    sse_slow_consumer_seconds: float = 10.0

    @property
    def session_database_url(self) -> str:
        """Where connections that need a session go (direct, never pooled)."""
        return self.direct_database_url or self.database_url

    @property
    def pooled(self) -> bool:
        """YUXI_DATABASE_URL is a transaction pooler: no prepared statements."""
        return bool(self.direct_database_url) and self.direct_database_url != self.database_url

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        url = env.get("YUXI_DATABASE_URL")
        try:
            return cls(
                database_url=url or DEFAULT_DATABASE_URL,
                database_url_explicit=bool(url),
                direct_database_url=env.get("YUXI_DIRECT_DATABASE_URL", ""),
                host=env.get("YUXI_HOST", "127.0.0.1"),
                port=int(env.get("YUXI_PORT", "8000")),
                default_model=env.get("YUXI_DEFAULT_MODEL", "replay"),
                lease_seconds=float(env.get("YUXI_LEASE_SECONDS", "30")),
                max_run_attempts=int(env.get("YUXI_MAX_RUN_ATTEMPTS", "3")),
                sse_keepalive_seconds=float(env.get("YUXI_SSE_KEEPALIVE_SECONDS", "15")),
                worker_concurrency=int(env.get("YUXI_WORKER_CONCURRENCY", "16")),
                worker_claims=_choice(env, "YUXI_WORKER_CLAIMS", ("1", "0")) == "1",
                data_dir=env.get("YUXI_DATA_DIR", ".yuxi/data"),
                sandbox=_choice(env, "YUXI_SANDBOX", ("bwrap", "host")),
                sandbox_network=_choice(env, "YUXI_SANDBOX_NETWORK", ("none", "outbound")),
                sandbox_bwrap=env.get("YUXI_SANDBOX_BWRAP", "bwrap"),
                sandbox_python=env.get("YUXI_SANDBOX_PYTHON", "/usr/bin/python3"),
                sandbox_cpu_seconds=_positive(env, "YUXI_SANDBOX_CPU_SECONDS", 600),
                sandbox_memory_mb=_positive(env, "YUXI_SANDBOX_MEMORY_MB", 4096),
                sandbox_processes=_positive(env, "YUXI_SANDBOX_PROCESSES", 256),
                sandbox_file_mb=_positive(env, "YUXI_SANDBOX_FILE_MB", 1024),
                sandbox_uid=_positive(env, "YUXI_SANDBOX_UID", 65534),
                sandbox_locale={k: v for k, v in env.items()
                                if k == "LANG" or k.startswith("LC_")},
                sandbox_term=env.get("TERM", "dumb"),
                sandbox_sweep_seconds=_between(
                    "YUXI_SANDBOX_SWEEP_SECONDS", int(env.get("YUXI_SANDBOX_SWEEP_SECONDS", "30")),
                    1, 30),
                host_id=_host_id(env.get("YUXI_HOST_ID") or socket.gethostname()),
                host_timeout_seconds=_between(
                    "YUXI_HOST_TIMEOUT_SECONDS", int(env.get("YUXI_HOST_TIMEOUT_SECONDS", "30")),
                    1, 3600),
                worker_metrics_port=_between(
                    "YUXI_WORKER_METRICS_PORT", int(env.get("YUXI_WORKER_METRICS_PORT", "0")),
                    0, 65535),
                model_max_attempts=_positive(env, "YUXI_MODEL_MAX_ATTEMPTS", 4),
                model_backoff_seconds=float(env.get("YUXI_MODEL_BACKOFF_SECONDS", "0.5")),
                model_timeout_seconds=float(env.get("YUXI_MODEL_TIMEOUT_SECONDS", "300")),
                max_infra_retries=int(env.get("YUXI_MAX_INFRA_RETRIES", "20")),
                max_body_bytes=int(env.get("YUXI_MAX_BODY_BYTES", "10000000")),
                max_content_chars=int(env.get("YUXI_MAX_CONTENT_CHARS", "200000")),
                db_wait_seconds=float(env.get("YUXI_DB_WAIT_SECONDS", "3")),
                sse_buffer_events=int(env.get("YUXI_SSE_BUFFER_EVENTS", "500")),
                sse_feed_events=int(env.get("YUXI_SSE_FEED_EVENTS", "1000")),
                sse_slow_consumer_seconds=float(env.get("YUXI_SSE_SLOW_CONSUMER_SECONDS", "10")),
            )
        except ValueError as exc:
            raise SystemExit(f"yuxi: invalid setting: {exc}") from None


def _choice(env, name: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name, allowed[0])
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(allowed)}")
    return value


def _positive(env, name: str, default: int) -> int:
    value = int(env.get(name, default))
    if value <= 0:
        raise ValueError(f"{name}={value}: expected a positive number")
    return value


_HOST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def _host_id(value: str) -> str:
    """A host id names a Procrastinate queue (runs@<host id>)."""
    if not _HOST_ID.fullmatch(value):
        raise ValueError(f"YUXI_HOST_ID={value!r}: expected 1-100 of A-Z a-z 0-9 . _ -, "
                         "starting with a letter or digit")
    return value
