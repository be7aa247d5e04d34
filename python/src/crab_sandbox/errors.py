"""The daemon's error codes as exception classes.

Every failure the daemon reports is a JSON ``ApiError`` ``{"code", "message", "hint"}`` (see
``docs/api.md``). The SDK raises the class registered for its ``code``; each carries
``message`` (what failed) and ``hint`` (the fix), and ``str(e)`` shows both. An unknown code
(a newer daemon) raises the base class :class:`CrabError` with the code kept in ``e.code``.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Type

__all__ = [
    "CrabError",
    "DaemonUnavailableError",
    "InvalidRequestError",
    "UnsafeArchiveError",
    "NotFoundError",
    "SandboxNotFoundError",
    "ImageNotFoundError",
    "CheckpointNotFoundError",
    "NameConflictError",
    "PathNotFoundError",
    "AlreadyExistsError",
    "PermissionDeniedError",
    "ConflictError",
    "CorruptCheckpointError",
    "HostUnsupportedError",
    "HostCapabilityMissingError",
    "UpstreamError",
    "CommandTimeoutError",
    "PoolFullError",
    "CriuFailedError",
    "InternalError",
    "TooLargeError",
    "RequestTimeoutError",
    "BusyError",
    "CommandError",
    "CapabilityError",
    "ERROR_CLASSES",
    "error_from_body",
]


class CrabError(Exception):
    """A failure reported by (or on the way to) the Crab daemon.

    Attributes:
        code: the daemon's stable error code (``sandbox_not_found``, ...).
        message: one sentence naming what failed.
        hint: what to do about it (may be empty).
        status: the HTTP status of the answer, when there was one.
    """

    code: str = "internal"

    def __init__(
        self,
        message: str,
        hint: str = "",
        *,
        code: Optional[str] = None,
        status: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        if code is not None:
            self.code = code
        self.status = status

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message} (hint: {self.hint})"
        return self.message

    def __repr__(self) -> str:
        return f"{type(self).__name__}(code={self.code!r}, message={self.message!r}, hint={self.hint!r})"


class DaemonUnavailableError(CrabError, ConnectionError):
    """The daemon's socket is missing or nobody answers on it."""

    code = "daemon_unavailable"


class InvalidRequestError(CrabError, ValueError):
    """``invalid_request`` (400): malformed body, bad name, bad flag."""

    code = "invalid_request"


class UnsafeArchiveError(CrabError, ValueError):
    """``unsafe_archive`` (400): an import entry escapes the root."""

    code = "unsafe_archive"


class NotFoundError(CrabError, LookupError):
    """Base of the ``*_not_found`` codes (404)."""


class SandboxNotFoundError(NotFoundError):
    """``sandbox_not_found`` (404)."""

    code = "sandbox_not_found"


class ImageNotFoundError(NotFoundError):
    """``image_not_found`` (404)."""

    code = "image_not_found"


class CheckpointNotFoundError(NotFoundError):
    """``checkpoint_not_found`` (404)."""

    code = "checkpoint_not_found"


class ProcessNotFoundError(NotFoundError):
    """``process_not_found`` (404): no background process of that id in the sandbox."""

    code = "process_not_found"


class PathNotFoundError(NotFoundError, FileNotFoundError):
    """``not_found`` (404): a path inside the sandbox does not exist (the file service)."""

    code = "not_found"


class NameConflictError(CrabError):
    """``name_conflict`` (409): the name is taken."""

    code = "name_conflict"


class ConflictError(CrabError):
    """``conflict`` (409): the operation is not allowed in this state."""

    code = "conflict"


class AlreadyExistsError(CrabError, FileExistsError):
    """``already_exists`` (409): a path inside the sandbox exists already (``make_dir``)."""

    code = "already_exists"


class PermissionDeniedError(CrabError, PermissionError):
    """``permission_denied`` (403): the sandbox's user may not do that to the path."""

    code = "permission_denied"


class CorruptCheckpointError(CrabError):
    """``corrupt_checkpoint`` (422): a checkpoint failed verification."""

    code = "corrupt_checkpoint"


class HostUnsupportedError(CrabError):
    """``host_unsupported`` (501): the host lacks btrfs, cgroup2, BPF, CRIU, root or --remote."""

    code = "host_unsupported"


class HostCapabilityMissingError(CrabError):
    """``host_capability_missing`` (501): the daemon lacks a capability this operation needs on
    this sandbox (a process dump of a non-root process without ``CAP_SYS_RESOURCE``); the
    sandbox was left as it was."""

    code = "host_capability_missing"


class UpstreamError(CrabError):
    """``upstream`` (502): an LLM upstream failed."""

    code = "upstream"


class CommandTimeoutError(CrabError, TimeoutError):
    """``timeout`` (504): a command ran past its timeout and was killed.

    Raised by ``exec`` when its ``timeout`` fires; ``result`` holds what the command printed
    before it was killed.
    """

    code = "timeout"

    def __init__(self, message: str, hint: str = "", **kw: Any) -> None:
        self.result: Any = kw.pop("result", None)
        super().__init__(message, hint, **kw)


class PoolFullError(CrabError, OSError):
    """``pool_full`` (507): the btrfs pool is out of space."""

    code = "pool_full"


class CriuFailedError(CrabError):
    """``criu_failed`` (500): CRIU failed; the message names its log."""

    code = "criu_failed"


class InternalError(CrabError):
    """``internal`` (500): anything else; the message says what."""

    code = "internal"


class TooLargeError(CrabError):
    """``too_large`` (413): a request body is larger than the daemon accepts."""

    code = "too_large"


class RequestTimeoutError(CrabError):
    """``request_timeout`` (408): the request was not sent in time."""

    code = "request_timeout"


class BusyError(CrabError):
    """``busy`` (503): a bound of the daemon is reached (connections, bytes); retry shortly."""

    code = "busy"


class CommandError(CrabError):
    """A helper command run in the sandbox failed (kept for callers: the file helpers now go
    through the daemon's file service and raise its codes).

    ``exit_code`` and ``stderr`` are the command's.
    """

    code = "command_failed"

    def __init__(self, message: str, hint: str = "", *, exit_code: int = -1, stderr: str = "") -> None:
        super().__init__(message, hint)
        self.exit_code = exit_code
        self.stderr = stderr


class CapabilityError(CrabError):
    """The daemon cannot give what was required (``require_processes=True`` on a host whose
    points hold no processes, ``durable=True`` without ``--remote``): fail closed."""

    code = "capability_missing"


ERROR_CLASSES: Dict[str, Type[CrabError]] = {
    cls.code: cls
    for cls in (
        InvalidRequestError,
        UnsafeArchiveError,
        SandboxNotFoundError,
        ImageNotFoundError,
        CheckpointNotFoundError,
        ProcessNotFoundError,
        NameConflictError,
        ConflictError,
        PathNotFoundError,
        AlreadyExistsError,
        PermissionDeniedError,
        CorruptCheckpointError,
        HostUnsupportedError,
        HostCapabilityMissingError,
        UpstreamError,
        CommandTimeoutError,
        PoolFullError,
        CriuFailedError,
        InternalError,
        TooLargeError,
        RequestTimeoutError,
        BusyError,
    )
}


def error_from_body(body: Any, status: Optional[int] = None) -> CrabError:
    """The exception for an ``ApiError`` JSON document (or anything else the daemon sent)."""
    if isinstance(body, Mapping) and isinstance(body.get("code"), str):
        code = str(body["code"])
        message = str(body.get("message", ""))
        hint = str(body.get("hint", ""))
        cls = ERROR_CLASSES.get(code)
        if cls is None:
            return CrabError(message, hint, code=code, status=status)
        return cls(message, hint, status=status)
    return InternalError(f"the daemon answered {status} with an unexpected body: {body!r:.200}", status=status)
