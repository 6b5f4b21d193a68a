"""Settings read from the environment; every process reads the same ones."""

from __future__ import annotations

import os

import msgspec

DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/yuxi"


class Settings(msgspec.Struct, frozen=True):
    database_url: str = DEFAULT_DATABASE_URL
    # True when YUXI_DATABASE_URL was set: then no embedded server is started.
    database_url_explicit: bool = False
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
    # Where tree workdirs and sandboxes live (shared by workers of one host).
    data_dir: str = ".yuxi/data"
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
    # Events read from the table and not yet sent that one SSE subscriber
    # may hold (its buffer). A subscriber whose buffer stays full this many
    # seconds (it reads slower than its tree writes) is closed with a final
    # comment telling it to resume from its last id.
    sse_buffer_events: int = 500
    sse_slow_consumer_seconds: float = 10.0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = os.environ if env is None else env
        url = env.get("YUXI_DATABASE_URL")
        try:
            return cls(
                database_url=url or DEFAULT_DATABASE_URL,
                database_url_explicit=bool(url),
                host=env.get("YUXI_HOST", "127.0.0.1"),
                port=int(env.get("YUXI_PORT", "8000")),
                default_model=env.get("YUXI_DEFAULT_MODEL", "replay"),
                lease_seconds=float(env.get("YUXI_LEASE_SECONDS", "30")),
                max_run_attempts=int(env.get("YUXI_MAX_RUN_ATTEMPTS", "3")),
                sse_keepalive_seconds=float(env.get("YUXI_SSE_KEEPALIVE_SECONDS", "15")),
                worker_concurrency=int(env.get("YUXI_WORKER_CONCURRENCY", "16")),
                data_dir=env.get("YUXI_DATA_DIR", ".yuxi/data"),
                max_infra_retries=int(env.get("YUXI_MAX_INFRA_RETRIES", "20")),
                max_body_bytes=int(env.get("YUXI_MAX_BODY_BYTES", "10000000")),
                max_content_chars=int(env.get("YUXI_MAX_CONTENT_CHARS", "200000")),
                db_wait_seconds=float(env.get("YUXI_DB_WAIT_SECONDS", "3")),
                sse_buffer_events=int(env.get("YUXI_SSE_BUFFER_EVENTS", "500")),
                sse_slow_consumer_seconds=float(env.get("YUXI_SSE_SLOW_CONSUMER_SECONDS", "10")),
            )
        except ValueError as exc:
            raise SystemExit(f"yuxi: invalid setting: {exc}") from None
