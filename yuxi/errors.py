"""One error root; database errors are mapped to domain errors by SQLSTATE."""

from __future__ import annotations

import psycopg


class YuxiError(Exception):
    """Something went wrong in Yuxi sessions."""

    code = "error"

    def __init__(self, message: str | None = None, **ids: object) -> None:
        self.message = message or (self.__doc__ or self.code).strip()
        self.ids = {k: str(v) for k, v in ids.items() if v is not None}
        super().__init__(self.message)


class NotFound(YuxiError):
    """The object does not exist in your scope."""

    code = "not_found"


class IllegalTransition(YuxiError):
    """The object is not in a state that allows this."""

    code = "illegal_transition"


class LeaseLost(YuxiError):
    """The run's lease is lost: another worker owns it or it has ended."""

    code = "lease_lost"


class WaitingForUser(IllegalTransition):
    """The session is waiting for its user to answer; new input is refused."""

    code = "waiting_for_user"


class PermissionDenied(YuxiError):
    """The user holds no grant for a resource this needs."""

    code = "permission_denied"


class Conflict(YuxiError):
    """The request conflicts with one already recorded."""

    code = "conflict"


class InvalidRequest(YuxiError):
    """The request is invalid."""

    code = "invalid_request"

    def __init__(self, message: str | None = None, errors: list[dict] | None = None, **ids):
        super().__init__(message, **ids)
        self.errors = errors or []


class SandboxElsewhere(YuxiError):
    """The tree's sandbox is live on another worker host: its runs belong there."""

    code = "sandbox_elsewhere"


class SchemaVersionMismatch(YuxiError):
    """The database was created by another schema version."""

    code = "schema_version_mismatch"


class DatabaseUnavailable(YuxiError):
    """The database server cannot be reached."""

    code = "database_unavailable"


_BY_SQLSTATE: dict[str, type[YuxiError]] = {
    "YX001": IllegalTransition,
    "YX002": NotFound,
    "YX003": LeaseLost,
    "YX004": Conflict,
    "YX005": WaitingForUser,
    "YX006": PermissionDenied,
    "YX007": InvalidRequest,
    "YX008": SandboxElsewhere,
}


def from_db(exc: psycopg.Error) -> YuxiError | None:
    """The domain error a database error stands for, or None."""
    cls = _BY_SQLSTATE.get(exc.sqlstate or "")
    if cls is None:
        return None
    message = exc.diag.message_primary if exc.diag else str(exc)
    return cls(message)


# SQLSTATEs of a lost or refused server connection, beside class 08: the
# server is shutting down or starting up.
_CONNECTION_SQLSTATES = {"57P01", "57P02", "57P03"}


def is_connection_error(exc: BaseException | None) -> bool:
    """True when `exc` (or an exception it was raised from) is an
    infrastructure fault of the database connection, not an error of the
    statement: SQLSTATE class 08, 57P01 admin shutdown (57P02, 57P03), an
    OperationalError without a SQLSTATE ("server closed the connection
    unexpectedly", "the connection is closed", a pool timeout)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, DatabaseUnavailable):
            return True
        if isinstance(exc, psycopg.OperationalError):
            state = exc.sqlstate
            if state is None or state.startswith("08") or state in _CONNECTION_SQLSTATES:
                return True
        if isinstance(exc, psycopg.InterfaceError) and "closed" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
