"""Harbor's ``--env crab_sandbox.harbor:CrabEnvironment``: :class:`CrabEnvironment`, a thin
translator from Harbor's ``BaseEnvironment`` calls (``harbor`` ≥ 0.26, Python ≥ 3.12) to the
Crab SDK, so a Terminal-Bench 2 / Harbor job runs on Crab with one setting.

Life of a trial (each step one or two SDK calls; the daemon does the work):

* ``start``: the task's image — ``environment/Dockerfile`` built by Crab's image builder
  (``Daemon.build_image``, each step cached by the daemon, so the second trial of a task builds
  nothing), or ``[environment].docker_image`` (a Crab image, or a registry reference pulled
  once) — then the trial's sandbox, a new one of the image (the fastest here: a create from a
  ready root; ``python/bench_harness.py`` measures it against a fork). With ``fork=true`` the
  first trial of an environment makes a *base* sandbox of it (Harbor's directories made, the
  environment directory uploaded when Harbor asks for that) and an ``fs`` restore point of it,
  and every trial, that one included, is a fork of that point: trials then share whatever the
  base holds, and each has the base's point to restore to.
* ``exec``: ``bash -c COMMAND`` (``sh`` when the image has no bash) through the exec stream,
  with ``cwd``, ``env`` (Harbor's persistent, per-call and scoped variables), ``user`` and
  ``timeout_sec``; output goes to Harbor's streaming callbacks as it arrives.
* uploads and downloads: the daemon's file service (a directory as one tar each way, checked on
  the way out: nothing a hostile sandbox sends lands outside the target).
* ``stop``: the trial's sandbox removed (``delete``), or kept and named. Base sandboxes are
  removed when the Harbor process exits; a daemon deadline (``base_timeout_sec``) removes one a
  killed process left behind.

Options (``--ek key=value``): ``socket`` (the daemon's; default ``$CRAB_SOCKET`` or
``/run/crab/crab.sock``), ``fork``, ``checkpoint`` (``none``, or ``exec``: a restore point after
every command, so any command of the trial can be restored or forked from), ``network``
(override the task's: ``private``, ``nat``, ``none``), ``insecure_registry`` (pull the task's
``docker_image`` over plain http), ``base_timeout_sec``.

Every sandbox it makes carries the labels ``crab.harbor.run`` (this process's run id),
``crab.harbor.role`` (``base`` or ``trial``), ``crab.harbor.env`` (the environment's name) and,
on a trial, ``crab.harbor.session`` (Harbor's session id), so ``crab sandbox ls`` tells them
apart. ``docker-compose.yaml`` environments (several services) are refused: Crab runs one
sandbox per trial.
"""

from __future__ import annotations

import asyncio
import atexit
import io
import logging
import secrets
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Literal, Optional

from harbor.environments.base import BaseEnvironment, ExecResult, transfer_tar_filter
from harbor.environments.capabilities import EnvironmentCapabilities
from harbor.environments.definition import (
    COMPOSE_FILE_NAME,
    DOCKERFILE_NAME,
    environment_content_hash,
    require_agent_environment_definition,
    should_use_prebuilt_docker_image,
)
from harbor.environments.options import EnvironmentOptions
from harbor.models.task.config import NetworkMode, TaskOS

from ._async import AsyncDaemon, AsyncSandbox, default_async_daemon
from ._common import socket_path
from ._harness import ensure_image, labels, log_progress, slug
from .errors import NotFoundError
from .files import tar_of_dir

__all__ = ["CrabEnvironment", "CrabOptions"]

logger = logging.getLogger(__name__)

ENV_TYPE = "crab"
LABELS = "crab.harbor"
#: One id per process: the labels of what this process's trials made.
RUN_ID = secrets.token_hex(4)


class CrabOptions(EnvironmentOptions):
    """``--ek`` options of :class:`CrabEnvironment` (``harbor environment schema
    crab_sandbox.harbor:CrabEnvironment``)."""

    socket: Optional[str] = None
    fork: bool = False
    checkpoint: Literal["none", "exec"] = "none"
    network: Optional[Literal["private", "nat", "none"]] = None
    insecure_registry: bool = False
    base_timeout_sec: int = 6 * 3600


@dataclass
class _Base:
    """One environment's image and, with ``fork``, its base sandbox and point."""

    image: str
    shell: str = "bash"
    sandbox: Optional[str] = None
    point: Optional[str] = None
    socket: str = ""


# Process-wide: Harbor runs a job's trials as tasks of one event loop, and all trials of one
# environment (same image, network, limits, variables) share one base.
_BASES: Dict[str, _Base] = {}
_LOCKS: Dict[str, asyncio.Lock] = {}
_BASE_SANDBOXES: Dict[str, str] = {}  # base sandbox → socket, removed at exit


def _remove_bases_at_exit() -> None:
    from ._sync import Daemon, Sandbox

    for name, sock in list(_BASE_SANDBOXES.items()):
        try:
            with Daemon(sock) as d:
                Sandbox(name, d).kill()
        except Exception as e:  # the daemon's deadline removes it later
            logger.warning("crab: could not remove the base sandbox %s: %s", name, e)
    _BASE_SANDBOXES.clear()


atexit.register(_remove_bases_at_exit)


class CrabEnvironment(BaseEnvironment):
    """One Harbor trial's Crab sandbox (see the module docstring)."""

    options_model = CrabOptions
    options: CrabOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._socket = socket_path(self.options.socket)
        self._sandbox: Optional[str] = None
        self._shell = "bash"
        #: Seconds ``start`` spent making the trial's sandbox (a fork, or a create), image
        #: work excluded; and the image work (build or pull) it waited for.
        self.setup_s: float = 0.0
        self.image_s: float = 0.0
        #: Restore points made by ``checkpoint=exec``, oldest first (the trial's commands only,
        #: not those that prepare a base).
        self.points: List[str] = []
        self._started = False

    @staticmethod
    def type() -> str:
        return ENV_TYPE

    @property
    def capabilities(self) -> EnvironmentCapabilities:
        return EnvironmentCapabilities(disable_internet=True)

    def _validate_definition(self) -> None:
        if self.os == TaskOS.WINDOWS:
            raise ValueError("the crab environment runs Linux sandboxes; this task targets Windows")
        compose = self.environment_dir / COMPOSE_FILE_NAME
        if compose.exists() and not self.task_env_config.docker_image:
            raise ValueError(
                f"{compose} declares Docker Compose services; the crab environment runs one "
                "sandbox per trial: give the task an environment/Dockerfile (start its services "
                "from it or from the agent), or run this task with --env docker"
            )
        require_agent_environment_definition(self.environment_dir, docker_image=self.task_env_config.docker_image)

    # --- the sandbox's life -------------------------------------------------------------------

    def _daemon(self) -> AsyncDaemon:
        return default_async_daemon(self._socket)

    @property
    def sandbox(self) -> AsyncSandbox:
        """The trial's sandbox, as an SDK handle (restore, fork, points, conversation)."""
        if self._sandbox is None:
            raise RuntimeError("the crab environment has no sandbox: call start() first")
        return AsyncSandbox(self._sandbox, self._daemon())

    def _network(self) -> str:
        if self.options.network is not None:
            return self.options.network
        return "private" if self._network_policy.network_mode == NetworkMode.NO_NETWORK else "nat"

    def _create_args(self) -> Dict[str, Any]:
        args: Dict[str, Any] = {"network": self._network()}
        if self._effective_memory_mb:
            args["memory"] = f"{int(self._effective_memory_mb)}M"
        if self._effective_cpus:
            args["cpus"] = float(self._effective_cpus)
        env = self._startup_env()
        if env:
            args["envs"] = env
        return args

    def _image_key(self, force_build: bool) -> str:
        prebuilt = should_use_prebuilt_docker_image(
            self.environment_dir, docker_image=self.task_env_config.docker_image, force_build=force_build
        )
        what = (
            f"image:{self.task_env_config.docker_image}"
            if prebuilt
            else f"build:{self.environment_dir.resolve()}:{environment_content_hash(self.environment_dir)}"
        )
        return f"{self._socket}\0{what}\0{sorted(self._create_args().items())}\0{self.options.fork}"

    async def _image(self, force_build: bool) -> str:
        d = self._daemon()
        cfg = self.task_env_config
        if should_use_prebuilt_docker_image(self.environment_dir, docker_image=cfg.docker_image, force_build=force_build):
            assert cfg.docker_image is not None
            return await ensure_image(d, cfg.docker_image, insecure=self.options.insecure_registry)
        dockerfile = self.environment_dir / DOCKERFILE_NAME
        h = environment_content_hash(self.environment_dir, truncate=12)
        name = f"harbor-{slug(self.environment_name, 24)}-{h}"
        self.logger.info(f"crab: building {dockerfile} into image {name}")
        build = d.build_image(
            dockerfile,
            name,
            context=self.environment_dir,
            no_cache=force_build,
            on_progress=log_progress(self.logger, f"build {name}"),
        )
        await asyncio.wait_for(build, timeout=cfg.build_timeout_sec)
        return name

    async def _create(self, image: str, name: str, role: str) -> AsyncSandbox:
        lab = labels(LABELS, run=RUN_ID, role=role, env=slug(self.environment_name, 60))
        if role == "trial":
            lab[f"{LABELS}.session"] = slug(self.session_id, 60)
        return await AsyncSandbox.create(image, name=name, labels=lab, daemon=self._daemon(), **self._create_args())

    async def _prepare(self, sb: AsyncSandbox) -> str:
        """Harbor's directories and uploads in a new sandbox; the shell ``exec`` runs."""
        probe = await sb.exec(["sh", "-c", "command -v bash || true"], user="root")
        shell = "bash" if probe.stdout.strip() else "sh"
        if shell == "sh":
            self.logger.warning("crab: the image has no bash; commands run with sh")
        self._sandbox, self._shell = sb.name, shell
        await self.ensure_dirs(self._mount_targets(writable_only=True))
        if self.task_env_config.workdir:
            await sb.exec(["mkdir", "-p", self.task_env_config.workdir], user="root")
        await self._upload_environment_dir_after_start()
        return shell

    async def _base(self, force_build: bool) -> _Base:
        key = self._image_key(force_build)
        lock = _LOCKS.setdefault(key, asyncio.Lock())
        async with lock:
            base = _BASES.get(key)
            if base is not None and not force_build:
                return base
            t0 = time.perf_counter()
            image = await self._image(force_build)
            self.image_s = time.perf_counter() - t0
            base = _Base(image=image, socket=self._socket)
            if self.options.fork:
                name = f"hb-{slug(self.environment_name)}-{secrets.token_hex(4)}-base"
                sb = await self._create(image, name, "base")
                _BASE_SANDBOXES[sb.name] = self._socket
                try:
                    base.shell = await self._prepare(sb)
                    base.point = (await sb.checkpoint(kind="fs")).id
                    await sb.set_timeout(self.options.base_timeout_sec, on_timeout="kill")
                except BaseException:
                    await _remove(sb)
                    _BASE_SANDBOXES.pop(sb.name, None)
                    raise
                finally:
                    self._sandbox = None
                base.sandbox = sb.name
            _BASES[key] = base
            return base

    async def start(self, force_build: bool) -> None:
        base = await self._base(force_build)
        t0 = time.perf_counter()
        name = f"hb-{slug(self.session_id, 40)}-{secrets.token_hex(3)}"
        if base.sandbox is not None:
            lab = labels(
                LABELS, run=RUN_ID, role="trial", env=slug(self.environment_name, 60), session=slug(self.session_id, 60)
            )
            (sb,) = await AsyncSandbox(base.sandbox, self._daemon()).fork(1, base.point, names=[name], labels=lab)
            self._sandbox, self._shell = sb.name, base.shell
        else:
            sb = await self._create(base.image, name, "trial")
            try:
                await self._prepare(sb)
            except BaseException:
                await _remove(sb)
                self._sandbox = None
                raise
        self.setup_s = time.perf_counter() - t0
        self._started = True
        self.logger.info(
            f"crab: sandbox {sb.name} ready in {self.setup_s * 1e3:.1f} ms "
            f"({'fork of ' + base.sandbox if base.sandbox else 'image ' + base.image}); "
            f"attach: crab exec -it {sb.name} -- {self._shell}"
        )

    async def stop(self, delete: bool) -> None:
        if self._sandbox is None:
            return
        sb = self.sandbox
        self._sandbox, self._started = None, False
        if not delete:
            self.logger.info(f"crab: kept the sandbox {sb.name} (remove it: crab sandbox rm {sb.name})")
            return
        try:
            await _remove(sb)
        except Exception as e:
            self.logger.error(f"crab: could not remove the sandbox {sb.name}: {e}")

    # --- commands -----------------------------------------------------------------------------

    async def exec(
        self,
        command: str,
        cwd: Optional[str] = None,
        env: Optional[Dict[str, str]] = None,
        timeout_sec: Optional[int] = None,
        user: Optional[str | int] = None,
    ) -> ExecResult:
        sb = self.sandbox
        who = self._resolve_user(user)
        merged = self._merge_env(env)
        emit = self._output_callback()
        out: Dict[str, List[bytes]] = {"stdout": [], "stderr": []}
        code: Optional[int] = None
        timed_out = False
        async for ev in sb.exec_stream(
            [self._shell, "-c", command],
            cwd=cwd or self.task_env_config.workdir,
            env=merged,
            timeout=timeout_sec,
            user=None if who is None else str(who),
        ):
            if ev.kind in out:
                out[ev.kind].append(ev.data)
                if emit is not None:
                    await emit(ev.text, ev.kind)  # type: ignore[arg-type]
            elif ev.kind == "exit":
                code, timed_out = ev.exit_code, ev.timed_out
        if timed_out:
            raise RuntimeError(f"Command timed out after {timeout_sec} seconds")
        if self.options.checkpoint == "exec" and self._started:
            self.points.append((await sb.checkpoint()).id)
        return ExecResult(
            stdout=b"".join(out["stdout"]).decode("utf-8", "replace"),
            stderr=b"".join(out["stderr"]).decode("utf-8", "replace"),
            return_code=-1 if code is None else code,
        )

    # --- files --------------------------------------------------------------------------------

    async def upload_file(self, source_path: Path | str, target_path: str) -> None:
        src = Path(source_path)
        with src.open("rb") as f:
            await self.sandbox.files.write(target_path, f, user="root", mode=src.stat().st_mode & 0o7777)

    async def upload_dir(self, source_dir: Path | str, target_dir: str) -> None:
        src = Path(source_dir)
        if not src.is_dir():
            raise NotADirectoryError(f"{src} is not a directory")
        await self.sandbox.files.tar_in(target_dir, tar_of_dir(src), user="root")

    async def download_file(self, source_path: str, target_path: Path | str) -> None:
        data = await self.sandbox.files.read(source_path, format="bytes", user="root")
        dest = Path(target_path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)

    async def download_dir(self, source_dir: str, target_dir: Path | str) -> None:
        data = await self.sandbox.files.tar_out(source_dir, contents=True, user="root")
        dest = Path(target_dir)
        dest.mkdir(parents=True, exist_ok=True)
        # Harbor's own filter: the `data` filter (no absolute names, `..`, links out), with
        # FIFOs and device nodes skipped instead of failing the whole download.
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tf:
            tf.extractall(str(dest), filter=transfer_tar_filter)

    async def attach(self) -> None:
        import os

        if self._sandbox is None:
            raise RuntimeError("the crab environment has no sandbox: call start() first")
        os.execvp("crab", ["crab", "exec", "-it", self._sandbox, "--", self._shell])

    # --- what only Crab does ------------------------------------------------------------------

    async def checkpoint(self, kind: str = "auto") -> str:
        """A restore point of the trial's sandbox now (its id)."""
        return (await self.sandbox.checkpoint(kind=kind)).id

    async def restore(self, point: Optional[str] = None) -> None:
        """The trial's sandbox back to ``point`` (default: its newest)."""
        await self.sandbox.restore(point)

    async def fork(self, count: int, point: Optional[str] = None) -> List[AsyncSandbox]:
        """``count`` new sandboxes from ``point`` of the trial's sandbox (its newest by
        default), e.g. to branch trials that share this one's prefix."""
        return await self.sandbox.fork(count, point)


async def _remove(sb: AsyncSandbox) -> None:
    try:
        await sb.kill()
    except NotFoundError:
        pass
