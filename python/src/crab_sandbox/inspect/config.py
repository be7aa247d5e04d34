"""What ``sandbox="crab"`` is given, as one :class:`CrabSandboxConfig`.

Inspect hands a provider ``None``, an absolute file path (a string config is resolved against
the task's directory) or a config object. :func:`resolve_config` turns each into a
:class:`CrabSandboxConfig`:

* ``None``: the daemon's ``debian`` image, Crab's defaults.
* a compose file (``compose.yaml`` and Inspect's other compose names): its one service's
  ``image`` (a Crab image name, else a registry reference to pull) or ``build`` (a Dockerfile
  for Crab's builder), ``mem_limit``/``cpus``/``pids_limit``/``deploy.resources.limits``,
  ``network_mode``, ``working_dir``, ``user``, ``environment``. What a Crab sandbox cannot
  honour (ports, volumes, devices, extra services, a main ``command`` other than an idle one,
  …) is refused naming the key, never silently dropped.
* a ``Dockerfile`` (``Dockerfile``, ``x.Dockerfile``, ``Dockerfile.x``): built, its directory the
  context.
* any other ``.yaml``/``.yml``/``.json`` file: a Crab provider config, the fields of
  :class:`CrabSandboxConfig`; relative ``dockerfile``/``context`` paths are the file's
  directory's.
* a :class:`CrabSandboxConfig`, or Inspect's ``ComposeConfig`` (what it deserializes a compose
  config to).

Parsing is bounded: a config file over 1 MiB is refused before it is read whole.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError

__all__ = ["CrabSandboxConfig", "resolve_config"]

#: A config file larger than this is refused (a compose file is a few hundred bytes).
MAX_CONFIG_BYTES = 1 << 20

Network = Literal["private", "none", "nat", "host"]


class CrabSandboxConfig(BaseModel):
    """The Crab provider's configuration (``SandboxEnvironmentSpec("crab", CrabSandboxConfig(...))``).

    The image is one of: ``image`` (a Crab image name, ``crab image ls``; a name no Crab image
    has is pulled as a registry reference with ``crab image pull``), or ``dockerfile`` (built by
    the daemon's builder, ``crab image build -f``; its ``FROM`` names a Crab image). Neither: the
    ``debian`` image.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    image: Optional[str] = Field(default=None)
    """A Crab image name, or a registry reference to pull when no Crab image has that name."""

    dockerfile: Optional[str] = Field(default=None)
    """A Dockerfile to build (absolute, or relative to the config file)."""

    context: Optional[str] = Field(default=None)
    """The build context (default: the Dockerfile's directory)."""

    build_args: Dict[str, str] = Field(default_factory=dict)
    """``--build-arg`` values."""

    memory: Optional[Union[int, str]] = Field(default=None)
    """Memory limit: bytes or ``512M``/``2G`` (default: the daemon's)."""

    cpus: Optional[float] = Field(default=None)
    """CPU limit in cores."""

    pids: Optional[int] = Field(default=None)
    """Task limit."""

    network: Network = Field(default="private")
    """``private`` (loopback only), ``none``, ``nat`` (outbound through the host) or ``host``."""

    working_dir: Optional[str] = Field(default=None)
    """Where ``exec`` runs and relative paths resolve (default: the image's, else ``/``)."""

    user: Optional[str] = Field(default=None)
    """Who ``exec`` runs as when the caller names nobody (default: the image's ``User``, else root)."""

    environment: Dict[str, str] = Field(default_factory=dict)
    """Environment of every command."""

    fork: bool = Field(default=True)
    """Each sample a fork of the task's base point (``False``: a fresh sandbox per sample)."""

    insecure_registry: bool = Field(default=False)
    """Pull ``image`` over plain http (a loopback test registry)."""

    socket: Optional[str] = Field(default=None)
    """The daemon's socket (default ``$CRAB_STATE_DIR/crab.sock``, else ``/var/lib/crab/crab.sock``)."""

    def __hash__(self) -> int:  # dict fields: hash the JSON form (as Inspect's ComposeConfig does)
        return hash(self.model_dump_json())


# Compose keys of a service, by what the provider does with them.
_TAKEN = {
    "image", "build", "mem_limit", "cpus", "pids_limit", "deploy", "network_mode", "working_dir",
    "user", "environment", "command", "entrypoint", "x-default", "x_default",
}
_IGNORED = {  # harmless for a Crab sandbox: it has its own init and no restart policy
    "init", "restart", "stop_grace_period", "stdin_open", "tty", "pull_policy", "mem_reservation", "x-local",
}
_IDLE = {"tail -f /dev/null", "sleep infinity", "sleep inf"}


def _refuse(what: str, source: str, hint: str) -> InvalidRequestError:
    return InvalidRequestError(f"{source}: {what}, which a Crab sandbox cannot honour", hint)


def _read(path: Path) -> str:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise InvalidRequestError(
            f"sandbox config {path} does not exist", "pass an existing compose.yaml, Dockerfile or Crab config file"
        ) from None
    if size > MAX_CONFIG_BYTES:
        raise InvalidRequestError(f"sandbox config {path} is {size} bytes", f"a config file is at most {MAX_CONFIG_BYTES} bytes")
    return path.read_text(encoding="utf-8")


def _is_compose(path: Path) -> bool:
    from inspect_ai.util._sandbox.compose import is_compose_yaml

    return is_compose_yaml(str(path))


def _is_dockerfile(path: Path) -> bool:
    from inspect_ai.util._sandbox.compose import is_dockerfile

    return is_dockerfile(str(path))


def _rel(base: Path, p: Optional[str]) -> Optional[str]:
    if p is None:
        return None
    q = Path(p).expanduser()
    return str(q if q.is_absolute() else (base / q).resolve())


def _words(v: Any) -> str:
    return " ".join(v) if isinstance(v, list) else str(v)


def _env(v: Any, source: str) -> Dict[str, str]:
    if v is None:
        return {}
    if isinstance(v, dict):
        return {str(k): "" if x is None else str(x) for k, x in v.items()}
    out: Dict[str, str] = {}
    for item in v:
        k, sep, x = str(item).partition("=")
        if not sep:
            raise _refuse(f"environment entry {item!r} takes its value from the host", source, "give it as KEY=VALUE")
        out[k] = x
    return out


def _network(mode: Optional[str], networks: Any, source: str) -> Network:
    if networks:
        names = list(networks) if not isinstance(networks, list) else networks
        if [n for n in names if n != "default"]:
            raise _refuse(f"networks {names}", source, "a Crab sandbox has one network; use network_mode")
    if mode in (None, "bridge", "default"):
        return "nat"  # Docker's default: outbound access through the host
    if mode in ("none", "host"):
        return mode  # type: ignore[return-value]
    raise _refuse(f"network_mode {mode!r}", source, "use none, bridge (Crab's nat) or host")


def from_compose(raw: Dict[str, Any], base: Path, source: str) -> CrabSandboxConfig:
    """A compose document (already parsed) as a Crab config; ``base``: where its relative paths
    start."""
    services = raw.get("services")
    if not isinstance(services, dict) or not services:
        raise InvalidRequestError(f"{source} has no services", "give it one service (`services: {default: {image: …}}`)")
    if len(services) > 1:
        raise _refuse(
            f"{len(services)} services ({', '.join(services)})",
            source,
            "a Crab sample is one sandbox: give the compose file one service",
        )
    for top in raw:
        if top not in ("services", "x-default") and not str(top).startswith("x-") and raw[top]:
            raise _refuse(f"top-level {top!r}", source, f"remove {top!r}")
    (svc_name, svc), = services.items()
    if not isinstance(svc, dict):
        svc = svc.model_dump(exclude_none=True, by_alias=True) if hasattr(svc, "model_dump") else {}
    platform = svc.get("platform")
    if platform not in (None, "linux/amd64"):
        raise _refuse(f"platform {platform!r}", source, "Crab runs linux/amd64 images on this host")
    for key, val in svc.items():
        if key == "platform" or key in _TAKEN or key in _IGNORED or str(key).startswith("x-") or val in (None, [], {}):
            continue
        raise _refuse(f"service {svc_name!r} sets {key!r}", source, f"remove {key!r} from the service")
    for key in ("command", "entrypoint"):
        if svc.get(key) is not None and _words(svc[key]).strip() not in _IDLE:
            raise _refuse(
                f"service {svc_name!r} has a main {key} ({_words(svc[key])!r})",
                source,
                "a Crab sandbox runs no main process: start it from the task's setup "
                "(or leave an idle one: `tail -f /dev/null`)",
            )
    memory = svc.get("mem_limit")
    cpus = svc.get("cpus")
    deploy = svc.get("deploy") or {}
    limits = ((deploy.get("resources") or {}).get("limits") or {}) if isinstance(deploy, dict) else {}
    for key in limits:
        if key not in ("memory", "cpus") and limits[key] is not None:
            raise _refuse(f"deploy.resources.limits.{key}", source, "Crab limits memory, cpus and pids only")
    memory = memory or limits.get("memory")
    cpus = cpus if cpus is not None else limits.get("cpus")
    if isinstance(deploy, dict) and [k for k in deploy if k != "resources" and deploy[k]]:
        raise _refuse(f"deploy keys {[k for k in deploy if k != 'resources']}", source, "keep only deploy.resources.limits")
    pids = svc.get("pids_limit")
    pids = None if pids in (None, -1, "-1") else int(pids)
    build = svc.get("build")
    dockerfile = context = None
    if build is not None:
        if isinstance(build, str):
            context = _rel(base, build)
            dockerfile = str(Path(context) / "Dockerfile")
        else:
            for key in build:
                if key not in ("context", "dockerfile") and build[key] not in (None, False):
                    if key != "args":
                        raise _refuse(f"build.{key}", source, "give build.context and build.dockerfile (and args)")
            context = _rel(base, build.get("context") or ".")
            dockerfile = str(Path(context) / (build.get("dockerfile") or "Dockerfile"))
    args = build.get("args") if isinstance(build, dict) else None
    return CrabSandboxConfig(
        image=None if build is not None else svc.get("image"),
        dockerfile=dockerfile,
        context=context,
        build_args=_env(args, source),
        memory=memory,
        cpus=None if cpus is None else float(cpus),
        pids=pids,
        network=_network(svc.get("network_mode"), svc.get("networks"), source),
        working_dir=svc.get("working_dir"),
        user=None if svc.get("user") is None else str(svc.get("user")),
        environment=_env(svc.get("environment"), source),
    )


def from_file(path: str) -> CrabSandboxConfig:
    """A config file (compose, Dockerfile or Crab's own) as a config."""
    p = Path(path)
    if _is_dockerfile(p):
        if not p.exists():
            raise InvalidRequestError(f"Dockerfile {p} does not exist", "pass an existing Dockerfile")
        return CrabSandboxConfig(dockerfile=str(p.resolve()), context=str(p.resolve().parent))
    text = _read(p)
    try:
        raw = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:
        raise InvalidRequestError(f"sandbox config {p} is not valid YAML/JSON: {e}", "fix the file") from None
    if not isinstance(raw, dict):
        raise InvalidRequestError(f"sandbox config {p} is not a mapping", "give it keys (services: … or image: …)")
    base = p.resolve().parent
    if _is_compose(p) or "services" in raw:
        return from_compose(raw, base, str(p))
    try:
        cfg = CrabSandboxConfig.model_validate(raw)
    except ValueError as e:
        raise InvalidRequestError(f"sandbox config {p}: {e}", "use the fields of CrabSandboxConfig") from None
    if cfg.dockerfile is not None:
        df = _rel(base, cfg.dockerfile)
        ctx = _rel(base, cfg.context) if cfg.context is not None else str(Path(df or ".").parent)
        cfg = cfg.model_copy(update={"dockerfile": df, "context": ctx})
    return cfg


def resolve_config(config: Any) -> CrabSandboxConfig:
    """Whatever Inspect handed the provider, as a :class:`CrabSandboxConfig`."""
    if config is None:
        return CrabSandboxConfig()
    if isinstance(config, CrabSandboxConfig):
        return config
    if isinstance(config, str):
        return from_file(config)
    if isinstance(config, BaseModel) and type(config).__name__ == "ComposeConfig":
        raw = config.model_dump(exclude_none=True, by_alias=True)
        return from_compose(raw, Path.cwd(), "compose config")
    if isinstance(config, dict):
        return CrabSandboxConfig.model_validate(config)
    raise InvalidRequestError(
        f"the crab sandbox cannot use a {type(config).__name__} config",
        "pass a compose.yaml / Dockerfile / Crab config file path, or a CrabSandboxConfig",
    )
