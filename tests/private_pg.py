"""A PostgreSQL server of the test session's own, for outage tests (see
yuxi.pgserver.PrivateServer: the shared server is never restarted)."""

from yuxi.pgserver import PrivateServer, new_private_server  # noqa: F401
