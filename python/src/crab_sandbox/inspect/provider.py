"""Inspect AI's ``sandbox="crab"``: :class:`CrabSandboxEnvironment`, a thin translator from
Inspect's ``SandboxEnvironment`` calls to the Crab SDK.

Registered as ``crab`` by ``@sandboxenv`` when this module is imported, which Inspect does
through the ``inspect_ai`` entry point in ``python/pyproject.toml``; so ``pip install
crab-sandbox`` is all an eval needs to say ``sandbox="crab"``.

Life of a task (each step one or two SDK calls; the daemon does the work):

* ``task_init``: the image — built from a Dockerfile (``Daemon.build_image``, cached by the
  daemon's step store), pulled from a registry (``pull_image``), or a Crab image as is — then,
  with ``fork=True`` (the default), one *base* sandbox of it and an ``fs`` restore point of it.
* ``sample_init``: a fork of the base point (``AsyncSandbox.fork``: a btrfs snapshot and a fresh
  init, tens of milliseconds, no image work); ``fork=False``: a new sandbox of the image.
* ``exec``/``write_file``/``read_file``: ``exec_stream`` (``input`` → stdin, ``cwd``, ``env``,
  ``user``, ``timeout``) and the file service, with Inspect's errors and output limits.
* ``sample_cleanup``: the sample's sandbox removed (shielded from cancellation when the sample
  was interrupted); ``task_cleanup``: the base and any sample left of this run removed (by
  label); ``cli_cleanup`` (``inspect sandbox cleanup crab``): every sandbox this provider made.

Every sandbox it makes carries the labels ``crab.inspect.run`` (this process's run id),
``crab.inspect.task``, ``crab.inspect.role`` (``base`` or ``sample``) and, on a sample, ``crab.inspect.base``
(its base sandbox, or image with ``fork=False``), so ``crab sandbox ls``
tells them apart and a cleanup finds them.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import logging
import os
import posixpath
import secrets
import shlex
import time
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional, Tuple, Union, overload

import anyio
from inspect_ai.util import (
    ExecResult,
    OutputLimitExceededError,
    SandboxConnection,
    SandboxEnvironment,
    SandboxEnvironmentConfigType,
    SandboxEnvironmentLimits,
    sandboxenv,
)
from inspect_ai.util._sandbox.compose import COMPOSE_FILES, DOCKERFILE
from inspect_ai.util._sandbox.environment import SandboxUnavailableError
from pydantic import BaseModel

from .._async import AsyncDaemon, AsyncSandbox, default_async_daemon
from .._common import socket_path
from .._harness import ensure_image, slug
from ..errors import (
    ConflictError,
    CrabError,
    DaemonUnavailableError,
    InvalidRequestError,
    NotFoundError,
    PathNotFoundError,
    PermissionDeniedError,
    SandboxNotFoundError,
)
from .config import CrabSandboxConfig, resolve_config

__all__ = ["CrabSandboxConfig", "CrabSandboxEnvironment"]

logger = logging.getLogger(__name__)

PROVIDER = "crab"
LABEL_RUN = "crab.inspect.run"
LABEL_TASK = "crab.inspect.task"
LABEL_ROLE = "crab.inspect.role"
LABEL_BASE = "crab.inspect.base"
#: One id per process: the labels of what this process's tasks made.
RUN_ID = secrets.token_hex(4)
DEFAULT_IMAGE = "debian"


def _labels(task_name: str, role: str, base: Optional[str] = None) -> Dict[str, str]:
    labels = {LABEL_RUN: RUN_ID, LABEL_TASK: slug(task_name, 60), LABEL_ROLE: role}
    if base is not None:
        labels[LABEL_BASE] = base
    return labels


def _what(cfg: CrabSandboxConfig) -> str:
    """A short name of what a config makes (the image, or the Dockerfile's directory)."""
    if cfg.dockerfile is not None:
        return slug(Path(cfg.dockerfile).parent.name or "build", 16)
    return slug(cfg.image or DEFAULT_IMAGE, 16)


@dataclass
class _Base:
    """What ``task_init`` made for one (task, config): the image, and the base sandbox with its
    point when samples are forks."""

    image: str
    socket: str
    sandbox: Optional[str] = None
    point: Optional[str] = None
    working_dir: str = "/"
    account: str = "root"


# Keyed by the config alone: Inspect's eval calls `task_init("startup", config)` and
# `task_cleanup("shutdown", config, …)`, and `sample_init` with the task's own name. Process-wide,
# not a ContextVar: Inspect may run task_init in a sibling task of the samples.
_BASES: Dict[str, _Base] = {}
_LOCKS: Dict[str, asyncio.Lock] = {}


def _key(cfg: CrabSandboxConfig) -> str:
    return cfg.model_dump_json()


def _daemon(socket: str) -> AsyncDaemon:
    """The running loop's client of the daemon on ``socket`` (Inspect may run tasks on other
    loops than the one ``task_init`` ran on; the SDK keeps one client per loop)."""
    return default_async_daemon(socket)


def _image_name(cfg: CrabSandboxConfig) -> str:
    """A stable image name for a Dockerfile build: the same Dockerfile and context build into
    the same name (the daemon's step cache makes a rebuild of an unchanged one a no-op)."""
    h = hashlib.sha256(f"{cfg.dockerfile}\0{cfg.context}".encode()).hexdigest()[:12]
    return f"inspect-{_what(cfg)}-{h}"


async def _ensure_image(d: AsyncDaemon, cfg: CrabSandboxConfig) -> str:
    """The image the config names, built or pulled first when it must be."""
    if cfg.dockerfile is not None:
        if not Path(cfg.dockerfile).is_file():
            raise InvalidRequestError(
                f"the Dockerfile {cfg.dockerfile} does not exist", "check the compose file's build: context and dockerfile"
            )
        name = _image_name(cfg)
        logger.info("crab: building %s into image %s", cfg.dockerfile, name)
        await d.build_image(cfg.dockerfile, name, context=cfg.context, build_args=cfg.build_args or None)
        return name
    return await ensure_image(d, cfg.image or DEFAULT_IMAGE, insecure=cfg.insecure_registry)


async def _probe(sb: AsyncSandbox, cfg: CrabSandboxConfig) -> Tuple[str, str]:
    """Where ``exec`` runs when no ``cwd`` is given and who it runs as when no ``user`` is: the
    config's, else the image's (asked of the sandbox, as Inspect's docker provider asks
    ``pwd``). File operations then act as that account too, as they do in a docker container."""
    r = await sb.exec(["sh", "-c", "pwd; id -un"], user=cfg.user)
    lines = r.stdout.splitlines() if r.exit_code == 0 else []
    wd = cfg.working_dir or (lines[0].strip() if lines and lines[0].startswith("/") else "/")
    who = lines[1].strip() if len(lines) > 1 and lines[1].strip() else (cfg.user or "root")
    return wd, who


async def _create(d: AsyncDaemon, image: str, name: str, labels: Dict[str, str], cfg: CrabSandboxConfig) -> AsyncSandbox:
    return await AsyncSandbox.create(
        image,
        name=name,
        memory=cfg.memory,
        cpus=cfg.cpus,
        network=cfg.network,
        pids=cfg.pids,
        labels=labels,
        envs=cfg.environment or None,
        daemon=d,
    )


async def _remove(d: AsyncDaemon, name: str) -> None:
    try:
        await AsyncSandbox(name, d).kill()
    except NotFoundError:
        pass


@sandboxenv(name=PROVIDER)
class CrabSandboxEnvironment(SandboxEnvironment):
    """One sample's Crab sandbox (see the module docstring)."""

    def __init__(self, sandbox: str, socket: str, cfg: CrabSandboxConfig, working_dir: str, account: str) -> None:
        super().__init__()
        self.sandbox_name = sandbox
        self._socket = socket
        self._cfg = cfg
        self._working_dir = working_dir
        #: The account ``exec`` runs as by default; file operations act as it.
        self._account = account
        #: Seconds ``sample_init`` took to make this sandbox (a fork, or a create).
        self.setup_s: float = 0.0

    # --- what Inspect asks of the class -------------------------------------------------------

    @classmethod
    def config_files(cls) -> List[str]:
        return COMPOSE_FILES + [DOCKERFILE]

    @classmethod
    def is_docker_compatible(cls) -> bool:
        return True

    @classmethod
    def config_deserialize(cls, config: Dict[str, Any]) -> BaseModel:
        return CrabSandboxConfig(**config)

    @classmethod
    async def task_init(cls, task_name: str, config: Optional[SandboxEnvironmentConfigType]) -> None:
        await cls._base(task_name, config)

    @classmethod
    async def _base(cls, task_name: str, config: Any) -> _Base:
        """The base of a config, made once per config (Inspect names the task ``startup`` in
        ``task_init``, the task itself in ``sample_init``) — by ``task_init``, or by the first
        ``sample_init`` when a caller skipped it."""
        cfg = resolve_config(config)
        key = _key(cfg)
        lock = _LOCKS.setdefault(key, asyncio.Lock())
        async with lock:
            base = _BASES.get(key)
            if base is not None:
                return base
            sock = socket_path(cfg.socket)
            d = _daemon(sock)
            image = await _ensure_image(d, cfg)
            base = _Base(image=image, socket=sock)
            if cfg.fork:
                name = f"insp-{_what(cfg)}-{secrets.token_hex(4)}-base"
                sb = await _create(d, image, name, _labels(task_name, "base"), cfg)
                try:
                    base.working_dir, base.account = await _probe(sb, cfg)
                    base.point = (await sb.checkpoint(kind="fs")).id
                except BaseException:
                    await _remove(d, sb.name)
                    raise
                base.sandbox = sb.name
            _BASES[key] = base
            return base

    @classmethod
    async def sample_init(
        cls, task_name: str, config: Optional[SandboxEnvironmentConfigType], metadata: Dict[str, str]
    ) -> Dict[str, SandboxEnvironment]:
        cfg = resolve_config(config)
        base = await cls._base(task_name, config)
        d = _daemon(base.socket)
        t0 = time.perf_counter()
        name = f"insp-{slug(task_name)}-{secrets.token_hex(4)}"
        labels = _labels(task_name, "sample", base.sandbox or base.image)
        if base.sandbox is not None:
            (sb,) = await AsyncSandbox(base.sandbox, d).fork(1, base.point, names=[name], labels=labels)
            working_dir, account = base.working_dir, base.account
        else:
            sb = await _create(d, base.image, name, labels, cfg)
            try:
                working_dir, account = await _probe(sb, cfg)
            except BaseException:
                await _remove(d, sb.name)
                raise
        env = cls(sb.name, base.socket, cfg, working_dir, account)
        env.setup_s = time.perf_counter() - t0
        logger.debug("crab: sample sandbox %s ready in %.1f ms", sb.name, env.setup_s * 1e3)
        return {"default": env}

    @classmethod
    async def sample_cleanup(
        cls,
        task_name: str,
        config: Optional[SandboxEnvironmentConfigType],
        environments: Dict[str, SandboxEnvironment],
        interrupted: bool,
    ) -> None:
        # An interrupted sample is being cancelled: remove its sandbox anyway (shielded), and
        # never let a cleanup failure mask why it was interrupted.
        with anyio.CancelScope(shield=interrupted):
            for env in environments.values():
                if not isinstance(env, CrabSandboxEnvironment):
                    continue
                try:
                    await _remove(_daemon(env._socket), env.sandbox_name)
                except CrabError as e:
                    if not interrupted:
                        raise
                    logger.warning("crab: could not remove %s: %s", env.sandbox_name, e)

    @classmethod
    async def task_cleanup(
        cls, task_name: str, config: Optional[SandboxEnvironmentConfigType], cleanup: bool
    ) -> None:
        cfg = resolve_config(config)
        base = _BASES.pop(_key(cfg), None)
        _LOCKS.pop(_key(cfg), None)
        if base is None:
            return
        d = _daemon(base.socket)
        if not cleanup:
            if base.sandbox:
                print(f"crab: kept the base sandbox {base.sandbox} (remove it: crab sandbox rm {base.sandbox})")
            return
        if base.sandbox:
            await _remove(d, base.sandbox)
        # Samples of this run and base that sample_cleanup did not remove (a crash, an
        # interruption): by label.
        mine = base.sandbox or base.image
        for info in await d.sandboxes():
            labels = info.raw.get("labels") or {}
            if labels.get(LABEL_RUN) == RUN_ID and labels.get(LABEL_BASE) == mine:
                await _remove(d, info.name)

    @classmethod
    async def cli_cleanup(cls, id: Optional[str]) -> None:
        """``inspect sandbox cleanup crab [ID]``: the sandbox named ``ID``, else every sandbox
        this provider made on the daemon of ``$CRAB_STATE_DIR`` (any run)."""
        d = AsyncDaemon()
        try:
            if id is not None:
                await _remove(d, id)
                return
            for info in await d.sandboxes():
                if LABEL_RUN in (info.raw.get("labels") or {}):
                    await _remove(d, info.name)
        finally:
            await d.aclose()

    # --- one sample's sandbox ----------------------------------------------------------------

    @property
    def crab_sandbox(self) -> AsyncSandbox:
        """The SDK handle of this sample's sandbox (``CrabSnapshotStrategy`` resolves ``env``
        through it)."""
        return AsyncSandbox(self.sandbox_name, _daemon(self._socket))

    def _path(self, file: str) -> str:
        return file if posixpath.isabs(file) else posixpath.join(self._working_dir, file)

    def _unavailable(self, e: CrabError) -> SandboxUnavailableError:
        return SandboxUnavailableError(f"the Crab sandbox {self.sandbox_name} cannot run commands: {e}")

    async def exec(
        self,
        cmd: List[str],
        input: Union[str, bytes, None] = None,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        user: Optional[str] = None,
        timeout: Optional[int] = None,
        timeout_retry: bool = True,
        concurrency: bool = True,
    ) -> ExecResult[str]:
        workdir = self._working_dir if cwd is None else self._path(cwd)
        limit = SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE
        out, err = bytearray(), bytearray()
        exit_code: Optional[int] = None
        timed_out = False
        stdin = input.encode("utf-8") if isinstance(input, str) else input
        try:
            stream = self.crab_sandbox.exec_stream(
                cmd, workdir, env, timeout, stdin=stdin, user=user if user is not None else self._cfg.user
            )
            async with aclosing(stream) as events:  # leaving early kills the command
                async for ev in events:
                    if ev.kind == "exit":
                        exit_code, timed_out = ev.exit_code, ev.timed_out
                        continue
                    buf = out if ev.kind == "stdout" else err
                    buf += ev.data
                    if len(buf) > limit:
                        raise OutputLimitExceededError(
                            SandboxEnvironmentLimits.MAX_EXEC_OUTPUT_SIZE_STR,
                            bytes(buf[:limit]).decode("utf-8", "replace"),
                        )
        except (SandboxNotFoundError, ConflictError, DaemonUnavailableError) as e:
            raise self._unavailable(e) from e
        stdout, stderr = out.decode("utf-8", "replace"), err.decode("utf-8", "replace")
        if timed_out:
            te = TimeoutError(f"Command timed out after {timeout} seconds")
            if stdout or stderr:
                setattr(te, "truncated_output", stdout + stderr)
            raise te
        code = -1 if exit_code is None else int(exit_code)
        if code == 126 and not stdout.strip() and "permission denied" in stderr.lower():
            raise PermissionError(f"Permission denied executing command: {shlex.join(cmd)}: {stderr.strip()}")
        return ExecResult(success=code == 0, returncode=code, stdout=stdout, stderr=stderr)

    # Root's files go through the daemon's file service (streamed, no command). Another account's
    # go through `exec` as that account — the daemon's own account switch — as a docker
    # container's do: the file service switches with `setpriv`, which minimal images lack, and it
    # replaces a file by renaming a new one over it, which a user who may write the directory
    # but not the file could do (Inspect, like open(2), expects EACCES). Only POSIX sh and `cat`
    # are needed; the exit codes are the file service's (43 permission, 44 missing, 47 a
    # directory).
    _WRITE_SH = (
        'd=${1%/*}; [ -n "$d" ] || d=/; [ -d "$d" ] || mkdir -p -- "$d" 2>/dev/null || exit 43; '
        '[ -d "$1" ] && exit 47; (: >> "$1") 2>/dev/null || exit 43; exec cat > "$1"'
    )
    _READ_SH = '[ -e "$1" ] || exit 44; [ -d "$1" ] && exit 47; [ -r "$1" ] || exit 43; exec cat -- "$1"'

    def _file_error(self, code: int, file: str, what: str, stderr: str) -> OSError:
        if code == 43:
            return PermissionError(errno.EACCES, "Permission denied", file)
        if code == 44:
            return FileNotFoundError(errno.ENOENT, "No such file or directory", file)
        if code == 47:
            return IsADirectoryError(errno.EISDIR, "Is a directory", file)
        return OSError(errno.EIO, f"{what} failed in {self.sandbox_name} (exit {code}): {stderr.strip()[-500:]}", file)

    async def write_file(self, file: str, contents: Union[str, bytes]) -> None:
        path = self._path(file)
        data = contents.encode("utf-8") if isinstance(contents, str) else contents
        try:
            if self._account == "root":
                await self.crab_sandbox.files.write(path, data)
                return
            r = await self.crab_sandbox.exec(["sh", "-c", self._WRITE_SH, "sh", path], stdin=data, user=self._account)
            if r.exit_code != 0:
                raise self._file_error(r.exit_code, file, "write_file", r.stderr)
        except PermissionDeniedError as e:
            raise PermissionError(errno.EACCES, f"Permission denied: {e.message}", file) from e
        except InvalidRequestError as e:
            if "directory" in str(e).lower():
                raise IsADirectoryError(errno.EISDIR, "Is a directory", file) from e
            raise
        except (SandboxNotFoundError, ConflictError, DaemonUnavailableError) as e:
            raise self._unavailable(e) from e

    @overload
    async def read_file(self, file: str, text: Literal[True] = True) -> str: ...

    @overload
    async def read_file(self, file: str, text: Literal[False]) -> bytes: ...

    async def read_file(self, file: str, text: bool = True) -> Union[str, bytes]:
        if posixpath.basename(file.rstrip("/")) in (".", ".."):
            raise IsADirectoryError(errno.EISDIR, "Is a directory", file)
        path = self._path(file)
        limit = SandboxEnvironmentLimits.MAX_READ_FILE_SIZE
        buf, err = bytearray(), bytearray()
        code = 0
        try:
            if self._account == "root":
                chunks: Any = await self.crab_sandbox.files.read(path, format="stream")
            else:
                chunks = self.crab_sandbox.exec_stream(["sh", "-c", self._READ_SH, "sh", path], user=self._account)
            async with aclosing(chunks) as it:  # leaving early ends the transfer (or kills `cat`)
                async for chunk in it:
                    if not isinstance(chunk, (bytes, bytearray)):  # an exec event
                        if chunk.kind == "exit":
                            code = int(chunk.exit_code if chunk.exit_code is not None else -1)
                            continue
                        if chunk.kind == "stderr":
                            err += chunk.data[: 1 << 16]
                            continue
                        chunk = chunk.data
                    buf += chunk
                    if len(buf) > limit:
                        raise OutputLimitExceededError(SandboxEnvironmentLimits.MAX_READ_FILE_SIZE_STR, None)
        except PathNotFoundError as e:
            raise FileNotFoundError(errno.ENOENT, "No such file or directory", file) from e
        except PermissionDeniedError as e:
            raise PermissionError(errno.EACCES, "Permission denied", file) from e
        except InvalidRequestError as e:
            if "directory" in str(e).lower():
                raise IsADirectoryError(errno.EISDIR, "Is a directory", file) from e
            raise
        except (SandboxNotFoundError, ConflictError, DaemonUnavailableError) as e:
            raise self._unavailable(e) from e
        if code != 0:
            raise self._file_error(code, file, "read_file", err.decode("utf-8", "replace"))
        return bytes(buf).decode("utf-8") if text else bytes(buf)

    async def connection(self, *, user: Optional[str] = None) -> SandboxConnection:
        """How a human attaches: ``crab exec -i`` of a login shell in this sample's sandbox
        (Crab's exec has no terminal of its own: a line-by-line shell)."""
        try:
            state = await self.crab_sandbox.status()
        except (NotFoundError, DaemonUnavailableError) as e:
            raise ConnectionError(f"the Crab sandbox {self.sandbox_name} is not there: {e}") from e
        if state != "running":
            raise ConnectionError(f"the Crab sandbox {self.sandbox_name} is {state}, not running")
        argv = ["crab"]
        state_dir = os.path.dirname(self._socket)
        if self._socket != socket_path(None) or state_dir != "/var/lib/crab":
            argv += ["--state-dir", state_dir]
        argv += ["exec", "-i"]
        if user:
            argv += ["-u", user]
        argv += [self.sandbox_name, "bash", "-li"]
        return SandboxConnection(type=PROVIDER, command=shlex.join(argv), container=self.sandbox_name)

    def default_polling_interval(self) -> float:
        return 0.2
