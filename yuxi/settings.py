"""Settings read from the environment; every process reads the same ones."""

from __future__ import annotations

import os

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
    # How often (seconds, 1-30) workers look for sandboxes to release. Only
    # the sweep's period: the idle time that releases a sandbox is fixed
    # (5 minutes, yuxi.services.sandbox.IDLE).
    sandbox_sweep_seconds: int = 30

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
                sandbox_sweep_seconds=_between(
                    "YUXI_SANDBOX_SWEEP_SECONDS", int(env.get("YUXI_SANDBOX_SWEEP_SECONDS", "30")),
                    1, 30),
            )
        except ValueError as exc:
            raise SystemExit(f"yuxi: invalid setting: {exc}") from None
