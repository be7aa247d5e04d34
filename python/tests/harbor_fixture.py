"""A task in Harbor's format for the Harbor tests (test_harbor.py) and the harness benchmark
(python/bench_harness.py): its Dockerfile is ``FROM`` the ``shell`` fixture of
scripts/test-images.sh in a loopback registry, every instruction it uses leaves a trace the test
script checks, and only the oracle's solution makes the answer (reward 1; 0 otherwise)."""

from __future__ import annotations

from pathlib import Path


def make_task(root: Path, name: str, registry: str, compose: bool = False) -> Path:
    """A task in Harbor's format: every Dockerfile instruction it uses leaves a trace the test
    script checks, and only the oracle's solution makes the answer."""
    t = root / name
    (t / "environment").mkdir(parents=True)
    (t / "tests").mkdir()
    (t / "solution").mkdir()
    (t / "task.toml").write_text(
        f"""schema_version = "1.4"

[task]
name = "crab/{name}"
version = "1.0.0"

[verifier]
timeout_sec = 120.0
environment_mode = "shared"

[agent]
timeout_sec = 120.0

[environment]
network_mode = "no-network"
build_timeout_sec = 300.0
"""
    )
    (t / "instruction.md").write_text("Write the sum of the numbers in /app/data.txt to /app/answer.txt.\n")
    (t / "environment" / "Dockerfile").write_text(
        f"""FROM {registry}/shell:1
ENV TASK_FLAVOR=crab
WORKDIR /app
COPY data.txt /app/data.txt
RUN echo "built by $TASK_FLAVOR" > /app/built.txt
"""
    )
    (t / "environment" / "data.txt").write_text("19 23\n")
    if compose:
        (t / "environment" / "docker-compose.yaml").write_text(
            "services:\n  main:\n    build: .\n  db:\n    image: postgres:16\n"
        )
    solve = t / "solution" / "solve.sh"
    solve.write_text("#!/bin/bash\nset -e\nread a b < /app/data.txt\necho $((a + b)) > /app/answer.txt\n")
    test = t / "tests" / "test.sh"
    test.write_text(
        """#!/bin/bash
ok=1
[ "$(cat /app/built.txt)" = "built by crab" ] || ok=0     # RUN saw ENV
[ "$PWD" = /app ] || ok=0                                 # WORKDIR
[ "$TASK_FLAVOR" = crab ] || ok=0                         # ENV at run time
[ "$(cat /app/answer.txt 2>/dev/null)" = 42 ] || ok=0     # the agent's work
echo "$ok" > /logs/verifier/reward.txt
"""
    )
    for f in (solve, test):
        f.chmod(0o755)
    return t
