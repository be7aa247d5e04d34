"""crab-sandbox: the Python SDK of Crab, a checkpoint/restore runtime for AI-agent sandboxes.

A thin client of the Crab daemon's HTTP API on its unix socket (``$CRAB_STATE_DIR/crab.sock``,
default ``/var/lib/crab/crab.sock``, or ``socket=``). Blocking::

    from crab_sandbox import Sandbox

    with Sandbox.create("debian") as sb:
        sb.write_file("/work/a.txt", "hello")
        print(sb.exec("cat /work/a.txt").stdout)
        p = sb.checkpoint()                 # kind="auto": the inspector decides
        sb.exec("rm /work/a.txt")
        sb.restore(p)                       # files, processes, conversation back
        branches = sb.fork(4, p)            # four new sandboxes from p
        h = sb.commands.run("python3 -m http.server", background=True)   # e2b-style
        print(sb.commands.list(), h.pid)    # kept across restores, forks, daemon restarts

and the same with ``await`` on :class:`AsyncSandbox`. Errors are the daemon's codes as
exception classes (:mod:`crab_sandbox.errors`), each with a ``hint``.
"""

from ._async import AsyncDaemon, AsyncSandbox, default_async_daemon
from ._common import IN_SANDBOX_LLM_BASE_URL, socket_path
from ._sync import Daemon, Sandbox, default_daemon
from .errors import (
    CapabilityError,
    CheckpointNotFoundError,
    CommandError,
    CommandTimeoutError,
    ConflictError,
    CorruptCheckpointError,
    BusyError,
    CrabError,
    CriuFailedError,
    DaemonUnavailableError,
    HostUnsupportedError,
    HostCapabilityMissingError,
    ImageNotFoundError,
    InternalError,
    InvalidRequestError,
    NameConflictError,
    NotFoundError,
    PathNotFoundError,
    PermissionDeniedError,
    AlreadyExistsError,
    PoolFullError,
    ProcessNotFoundError,
    RequestTimeoutError,
    SandboxNotFoundError,
    TooLargeError,
    UnsafeArchiveError,
    UpstreamError,
)
from .commands import AsyncCommandHandle, AsyncCommands, CommandHandle, CommandInfo, CommandResult, Commands
from .files import AsyncFiles, EntryInfo, FileType, Files
from .models import Capabilities, ExecEvent, ExecResult, Point, RestoreReport, SandboxInfo, Turn

__version__ = "0.1.0"

__all__ = [
    "AsyncCommandHandle",
    "AsyncCommands",
    "AlreadyExistsError",
    "AsyncDaemon",
    "AsyncFiles",
    "EntryInfo",
    "FileType",
    "Files",
    "PathNotFoundError",
    "PermissionDeniedError",
    "AsyncSandbox",
    "BusyError",
    "Capabilities",
    "CommandHandle",
    "CommandInfo",
    "CommandResult",
    "Commands",
    "CapabilityError",
    "CheckpointNotFoundError",
    "CommandError",
    "CommandTimeoutError",
    "ConflictError",
    "CorruptCheckpointError",
    "CrabError",
    "CriuFailedError",
    "Daemon",
    "DaemonUnavailableError",
    "ExecEvent",
    "ExecResult",
    "HostUnsupportedError",
    "HostCapabilityMissingError",
    "IN_SANDBOX_LLM_BASE_URL",
    "ImageNotFoundError",
    "InternalError",
    "InvalidRequestError",
    "NameConflictError",
    "NotFoundError",
    "Point",
    "PoolFullError",
    "ProcessNotFoundError",
    "RequestTimeoutError",
    "RestoreReport",
    "Sandbox",
    "SandboxInfo",
    "SandboxNotFoundError",
    "TooLargeError",
    "Turn",
    "UnsafeArchiveError",
    "UpstreamError",
    "default_async_daemon",
    "default_daemon",
    "socket_path",
]
