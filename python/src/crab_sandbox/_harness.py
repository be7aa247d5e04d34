"""What the harness adapters (:mod:`crab_sandbox.inspect`, :mod:`crab_sandbox.harbor`) share:
turning a harness's names into Crab names, and finding the image a task names — a Crab image as
is, a registry reference pulled once. Each adapter stays a thin translator over the SDK; the
daemon does the work (builds, pulls, forks)."""

from __future__ import annotations

import logging
import re
from typing import Any, Dict, Mapping, Optional

from ._async import AsyncDaemon
from .errors import InvalidRequestError

logger = logging.getLogger(__name__)


def slug(name: str, n: int = 20) -> str:
    """``name`` as a piece of a sandbox or image name: lowercase letters, digits and dashes, at
    most ``n`` characters (``task`` when nothing is left)."""
    s = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
    return s[:n].strip("-") or "task"


def is_reference(image: str) -> bool:
    """Whether an image name is a registry reference (``host/repo``, ``repo:tag``, ``@digest``)
    rather than a Crab image's own name."""
    return bool(re.search(r"[/:@]", image))


async def ensure_image(d: AsyncDaemon, image: str, *, insecure: bool = False) -> str:
    """The Crab image ``image`` names: a Crab image as is, else a registry reference pulled
    once (the daemon keeps it under a name of its own, which this returns)."""
    images = await d.images()
    if image in {str(i.get("name")) for i in images}:
        return image
    for i in images:
        if i.get("reference") == image:
            return str(i["name"])
    if not is_reference(image):
        raise InvalidRequestError(
            f"no Crab image {image!r} on the daemon at {d.socket}",
            f"build or import it (`crab image build {image}`, `crab image ls`), or name a registry reference to pull",
        )
    logger.info("crab: pulling %s", image)
    info = await d.pull_image(image, insecure=insecure)
    return str(info["name"])


def log_progress(log: logging.Logger, what: str) -> Any:
    """A progress callback for a build or pull that logs its stages and output lines."""

    def on_progress(frame: Mapping[str, Any]) -> None:
        t = frame.get("t")
        if t == "stage":
            log.info("crab: %s: %s", what, frame.get("name"))
        elif t == "message":
            log.debug("crab: %s: %s", what, frame.get("line"))

    return on_progress


def labels(prefix: str, **values: Optional[str]) -> Dict[str, str]:
    """Sandbox labels ``{prefix}.{key}`` for the values given."""
    return {f"{prefix}.{k}": v for k, v in values.items() if v is not None}
